"""What a simulation yields, and where its bottleneck is.

- tokens/s: tokens of the microbatches through the pipeline (Backward done) after the warm-up, over
  the time after it (a global batch is too coarse a unit for a short run).
- per-stage utilization: compute time of the stage's replicas after the warm-up over their time
  alive then (a stage at ~1 is the pipeline's bound).
- round durations: every averaging round's matchmaking plus all-reduce (mean, max; committed ones),
  and the mean of its members' time from their start to the group's forming.
- newcomers: seconds from a newcomer's start to its stage's state and to member, None if it was
  not a member by the end.
- the bottleneck, named by the first rule that holds: a stage busy at least `BUSY` of the time is
  compute; else the trainers' uplinks busy at least `BUSY` of the time after the warm-up (every frame
  of a microbatch leaves its trainer: with many replicas and few trainers they are the bound, and a
  trainer's adaptive depth, which cannot tell its own send queue from the latency it hides, grows
  into that queue); else the trainers' depth held at its cap while a microbatch's unqueued latency needs more
  in flight than that to fill the busiest stage is the in-flight cap; else the links and round trips
  (the latency of one microbatch exceeds what the trainers have in flight times the busiest stage's
  compute); and the ratio of a round's communication to its compute window (the time between two
  rounds) is given alongside, the regime where averaging no longer hides behind compute.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Optional

from agora.node.trainer.inflight import fill_depth

__all__ = ["BUSY", "NewcomerTimes", "SimulationResult", "summarize", "format_result"]

BUSY = 0.85


@dataclass(frozen=True)
class NewcomerTimes:
    stage: int
    started_s: float
    to_state_s: Optional[float]
    to_member_s: Optional[float]
    to_donor_s: Optional[float] = None  # its first reads named a donor
    to_visible_s: Optional[float] = None  # its first record at a holder: others can read it


@dataclass(frozen=True)
class SimulationResult:
    seconds: float
    tokens_per_s: float
    global_batches: int
    stage_utilization: list[float]
    round_mean_s: Optional[float]
    round_max_s: Optional[float]
    formation_mean_s: Optional[float]  # a member's start to its group's forming, committed rounds
    rounds: int
    rounds_committed: int
    round_window_s: Optional[float]  # compute time between two rounds of a stage
    latency_s: Optional[float]  # a microbatch's mean unqueued latency
    depth_cap: int
    depth_last: list[int]
    newcomers: list[NewcomerTimes] = field(default_factory=list)
    departures: int = 0
    moves: int = 0
    duplicates: int = 0
    bottleneck: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _utilization(swarm) -> list[float]:
    start, end = swarm.scenario.run.warmup_s, swarm.env.now
    busy, alive = [0.0] * swarm.scenario.run.stages, [0.0] * swarm.scenario.run.stages
    for worker in swarm.workers.values():
        left = getattr(worker, "left_at", end)
        alive[worker.stage] += max(0.0, left - max(start, worker.started_at))
        busy[worker.stage] += worker.busy_s
    return [b / a if a > 0 else 0.0 for b, a in zip(busy, alive)]


def _bottleneck(swarm, utilization: list[float], latency: Optional[float], window: Optional[float],
                round_mean: Optional[float]) -> str:
    s = swarm.scenario
    busiest = max(range(len(utilization)), key=lambda i: utilization[i])
    regime = "" if not (window and round_mean) else \
        f"; a round's communication / its compute window: {round_mean / window:.2f}"
    if utilization[busiest] >= BUSY:
        return f"compute: stage {busiest} busy {utilization[busiest]:.0%}{regime}"
    measured = swarm.env.now - s.run.warmup_s
    uplinks = [t.link.busy_s / measured for t in swarm.trainers] if measured > 0 else []
    if uplinks and statistics.fmean(uplinks) >= BUSY:
        return (f"the trainers' uplinks: {len(uplinks)} busy {statistics.fmean(uplinks):.0%} on average, stage "
                f"{busiest} busy {utilization[busiest]:.0%}{regime}")
    if latency is None:
        return "no microbatch finished"
    per_replica = [ms / 1000.0 / max(1, s.workers.replicas) for ms in s.compute.ms]
    trainers = swarm.trainers
    cap = trainers[0].max_in_flight
    needed = fill_depth(latency, per_replica, cap=10**6)
    held = sum(t.limit.limit for t in trainers)
    if held >= len(trainers) * cap and needed > held:
        return (f"in-flight cap: {len(trainers)} trainer(s) x {cap} in flight against the {needed} that "
                f"{latency * 1000:.0f} ms of latency needs to fill stage {busiest}{regime}")
    return (f"latency: {latency * 1000:.0f} ms per microbatch, {held} in flight; stage {busiest} busy "
            f"{utilization[busiest]:.0%}{regime}")


def summarize(swarm) -> SimulationResult:
    s, end = swarm.scenario, swarm.env.now
    done = [(t, n) for trainer in swarm.trainers for t, n in trainer.tokens_done] + swarm.batches
    tokens_per_s = sum(n for t, n in done if t >= s.run.warmup_s) / (end - s.run.warmup_s)
    batches = sum(len(trainer.committed) for trainer in swarm.trainers) + len(swarm.batches)
    utilization = _utilization(swarm)
    rounds = [r for r in swarm.rounds.log if r.started >= s.run.warmup_s] or swarm.rounds.log
    committed = [r.seconds for r in rounds if r.committed]
    formations = [f for r in rounds if r.committed for f in r.formations]
    round_mean = statistics.fmean(committed) if committed else None
    window = None
    if batches and s.averaging.method != "none":
        window = s.averaging.every_steps * end / batches  # every replica steps on every global batch
    latencies = [x for trainer in swarm.trainers for x in trainer.latencies]
    latency = statistics.fmean(latencies) if latencies else None
    newcomers = [NewcomerTimes(w.stage, round(w.started_at, 3), w.state_at,
                               next((at for phase, at in w.history if phase == "member"), None), w.donor_at,
                               w.visible_at)
                 for w in swarm.joins]
    return SimulationResult(
        seconds=end, tokens_per_s=tokens_per_s, global_batches=batches, stage_utilization=utilization,
        round_mean_s=round_mean, round_max_s=max(committed) if committed else None,
        formation_mean_s=statistics.fmean(formations) if formations else None, rounds=len(rounds),
        rounds_committed=len(committed), round_window_s=window, latency_s=latency,
        depth_cap=swarm.trainers[0].max_in_flight if swarm.trainers else 0,
        depth_last=[t.limit.limit for t in swarm.trainers], newcomers=newcomers, departures=swarm.departures,
        moves=swarm.moves, duplicates=swarm.board.duplicates,
        bottleneck=_bottleneck(swarm, utilization, latency, window, round_mean) if swarm.trainers else "")


def format_result(result: SimulationResult) -> str:
    """The result as a few lines a person reads."""
    def seconds(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.1f} s"

    lines = [f"simulated {result.seconds:,.0f} s: {result.tokens_per_s:,.0f} tokens/s, "
             f"{result.global_batches} global batches",
             "stage utilization: " + ", ".join(f"{i}: {u:.0%}" for i, u in enumerate(result.stage_utilization)),
             f"microbatch latency (unqueued): {seconds(result.latency_s)}; depth now "
             f"{', '.join(map(str, result.depth_last))} (cap {result.depth_cap})",
             f"averaging rounds: {result.rounds} ({result.rounds_committed} committed), mean {seconds(result.round_mean_s)}, "
             f"max {seconds(result.round_max_s)}; group formed after {seconds(result.formation_mean_s)} (mean)",
             f"bottleneck: {result.bottleneck}"]
    for newcomer in result.newcomers:
        lines.append(f"newcomer at {newcomer.started_s:.0f} s (stage {newcomer.stage}): donor named after "
                     f"{seconds(newcomer.to_donor_s)}, seen by others after {seconds(newcomer.to_visible_s)}, "
                     f"state after {seconds(newcomer.to_state_s)}, member after {seconds(newcomer.to_member_s)}")
    if result.departures or result.moves:
        lines.append(f"departures: {result.departures}, rebalancing moves: {result.moves}")
    return "\n".join(lines)
