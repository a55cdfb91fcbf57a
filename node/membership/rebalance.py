"""Rebalancing: a member of a stage that is over-covered relative to another moves to that one.

A pipeline runs at the pace of its least covered stage, and churn leaves stages unevenly covered
(joiners all assigned while one stage was short, departures). Every worker judges the swarm from
the DHT records it already reads, and at most one moves at a time.

Design choices:
- Coverage is announced throughput, tokens/s of compute summed over a stage's replicas (so a
  heavier stage needs more replicas for the same coverage), per job that a token costs the stage:
  a worker's throughput is measured per compute job, and a head or body runs two jobs per
  microbatch (Forward, then Backward) where the tail runs one (its Forward does the backward too),
  so a head's or body's announced rate is halved before stages are compared (measured on tiny:
  bodies announce 3.6x the tail's rate, 1.8x once halved). In `stage_coverage` replicas still
  syncing count (they are coming), and one that has not measured its throughput yet (0) counts as
  the median of its stage's that have, else of the run's, else 1; a move waits for both to pass
  (below). What the mover adds to the other stage is that stage's median replica, not its own
  rate: a replica's speed depends on the stage it computes.
- Hysteresis, so the swarm does not oscillate: a member moves from its stage S to the least covered
  stage T only when S covers at least `min_ratio` times what T does, and after the move T would hold
  at most `1 + slack` times what S keeps. With `1 + slack < min_ratio` no move can be followed by
  the move back: after it, T over S is at most `1 + slack`, below the ratio a move needs
  (replicas of equal speed: 3 against 1 moves, to 2 and 2; 2 against 1 never moves).
- That argument holds for throughputs as they are, not as one reading announces them: a replica's
  rate is an average over its last ~10 jobs (node/replica/compute.py), and on a contended host it
  swings by more than `min_ratio` (2 against 2 replicas announced 11,114 against 5,110 tokens/s,
  and a mover went back). So the comparison waits for figures that mean something:
  - nothing is planned while any covering replica of the run is not yet a member (syncing: its rate
    is a guess, and it may be the mover of a move not finished) or has no measurement yet, nor while
    a move is in transit (its own included: the mover's record says a move is under way);
  - once none of that holds, the swarm is settled, and a worker plans only after it has read it
    settled for `settle_intervals` readings in a row (`Settling`), comparing each replica's
    throughput averaged over the last `settle_intervals` readings, not the last one. A change (a
    move, a joiner, a replica not seen before) starts the count over, so a mover that just arrived
    is judged on several intervals of its own compute on its new stage, and noise that flips
    between readings averages out instead of crossing the ratio.
  The settle period is counted by each reader from when it saw the swarm settle, not by a move
  record that lives longer: a transit of unknown length (admission, weight sync under load) then
  never eats into it, and it covers joiners too. The longer window is the reader's, not a second
  figure in the record: the announced rate stays short-window for the trainers' routing, which
  must follow a replica that slows now. A real imbalance still moves, `settle_intervals +
  confirmations - 1` readings after the last change: only noise within the window is smoothed, not
  a difference that persists across it (nothing in the records tells a host's lasting contention
  from a slower machine).
- One move at a time in the whole swarm: the mover announces a `MoveRecord` (dht/records.py) for as
  long as its transit may take (leaving, admission again, a new process), and nobody plans a move
  while one is live; otherwise a second member would judge the stages while the first is on its
  way, counted nowhere, and follow it.
- One mover: among S's members the one with the least throughput (ties by peer id), computed alike
  by every member from the same records, so only it moves; S keeps at least one member. A plan must
  hold for `confirmations` readings in a row (`interval_s` apart), so a record missing from one DHT
  read (a late heartbeat) never moves anyone, and the swarm sees the mover leave before anyone
  judges again.
- The move itself (node/worker/join.py, node/cli.py): the worker leaves its stage as on SIGTERM
  (record withdrawn, in-flight work finished) and starts again as `join --stage T` with the same
  key, so the authorizer admits it for T and issues a credential naming T (a credential names the
  stage; the averager, the DHT validators and the TLS name all hold it to it); there it syncs like
  any joiner (weight sync from T's members, optimizer sync, member). A process rather than an
  in-process switch, because hivemind's averager is forked per stage before any gRPC server exists
  (dht/ docs: a process that has run gRPC does not fork reliably).
- `plan_move` is pure and unit-tested; `Rebalancer` only reads the DHT and confirms.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Optional, Sequence

from agora.auth.policy import jobs_per_microbatch
from agora.dht.records import COVERING_PHASES, MoveRecord, Phase, WorkerRecord

__all__ = ["RebalancePolicy", "Move", "stage_coverage", "unsettled", "plan_move", "Settling", "Rebalancer",
           "moved_argv"]

logger = logging.getLogger("agora.node.join")

# Phases whose replicas cover a stage: trained or training, or about to be.
_COVERING = COVERING_PHASES


@dataclass(frozen=True)
class RebalancePolicy:
    min_ratio: float = 1.5
    slack: float = 0.25
    interval_s: float = 30.0
    confirmations: int = 2
    settle_intervals: int = 10

    def __post_init__(self):
        if not 1.0 + self.slack < self.min_ratio or self.slack < 0:
            raise ValueError(f"rebalancing: need 0 <= slack and 1 + slack < min_ratio (no move back), got "
                             f"slack={self.slack}, min_ratio={self.min_ratio}")
        if self.interval_s <= 0 or self.confirmations < 1:
            raise ValueError("rebalancing: interval_s must be positive and confirmations at least 1")
        if self.settle_intervals < 1:
            raise ValueError(f"rebalancing: settle_intervals must be at least 1, got {self.settle_intervals}")


@dataclass(frozen=True)
class Move:
    target: int
    why: str


def _median(values: Sequence[float], default: float) -> float:
    return statistics.median(values) if values else default


def _covering(by_stage: Mapping[int, Sequence[WorkerRecord]], n_stages: int) -> dict[int, list[WorkerRecord]]:
    return {stage: [r for r in by_stage.get(stage, ()) if r.phase in _COVERING and r.stage == stage]
            for stage in range(n_stages)}


def _capacities(covering: Mapping[int, Sequence[WorkerRecord]]) -> tuple[dict[str, float], dict[int, float]]:
    """Each covering replica's capacity (announced tokens/s over the stage's jobs per microbatch), and
    each stage's typical replica (module docstring)."""
    n_stages = len(covering)
    rate = {r.peer_id: r.throughput / jobs_per_microbatch(stage, n_stages)
            for stage, records in covering.items() for r in records}
    everyone = _median([v for v in rate.values() if v > 0], 1.0)
    typical = {stage: _median([rate[r.peer_id] for r in records if rate[r.peer_id] > 0], everyone)
               for stage, records in covering.items()}
    capacity = {r.peer_id: rate[r.peer_id] if rate[r.peer_id] > 0 else typical[stage]
                for stage, records in covering.items() for r in records}
    return capacity, typical


def stage_coverage(by_stage: Mapping[int, Sequence[WorkerRecord]], n_stages: int) -> dict[int, float]:
    """Each stage's announced throughput over its covering replicas (see the module docstring)."""
    covering = _covering(by_stage, n_stages)
    capacity, _ = _capacities(covering)
    return {stage: sum(capacity[r.peer_id] for r in records) for stage, records in covering.items()}


def unsettled(by_stage: Mapping[int, Sequence[WorkerRecord]], n_stages: int,
              moving: Sequence[MoveRecord] = ()) -> Optional[str]:
    """Why the announced throughputs cannot be compared now (see the module docstring), or None."""
    if moving:
        return f"{moving[0].peer_id} is moving to stage {moving[0].to_stage}"
    for stage, records in _covering(by_stage, n_stages).items():
        for record in records:
            if record.phase != Phase.MEMBER:
                return f"{record.peer_id} is in {record.phase} on stage {stage}"
            if record.throughput <= 0:
                return f"{record.peer_id} has not measured its throughput on stage {stage} yet"
    return None


def plan_move(by_stage: Mapping[int, Sequence[WorkerRecord]], n_stages: int, own_peer_id: str, own_phase: str,
              policy: RebalancePolicy, moving: Sequence[MoveRecord] = ()) -> Optional[Move]:
    """Where this worker should move now, or None (pure; see the module docstring). `moving`: the
    moves announced in transit. The throughputs compared are the records' (`Settling` passes
    averages over the settled readings)."""
    if unsettled(by_stage, n_stages, moving) is not None:
        return None
    own = next((r for records in by_stage.values() for r in records if r.peer_id == own_peer_id), None)
    if own is None or own_phase != Phase.MEMBER or n_stages < 2:
        return None
    covering = _covering(by_stage, n_stages)
    capacity, typical = _capacities(covering)
    members = [r for r in covering.get(own.stage, ()) if r.phase == Phase.MEMBER]
    if len(members) < 2 or own.peer_id not in {m.peer_id for m in members}:
        return None  # never empty a stage
    mover = min(members, key=lambda r: (capacity.get(r.peer_id, 0.0), r.peer_id))
    if mover.peer_id != own_peer_id:
        return None
    coverage = {stage: sum(capacity[r.peer_id] for r in records) for stage, records in covering.items()}
    target = min((s for s in range(n_stages) if s != own.stage), key=lambda s: (coverage[s], s))
    source, destination, mine = coverage[own.stage], coverage[target], capacity[own_peer_id]
    if destination > 0 and source < policy.min_ratio * destination:
        return None
    if destination + typical[target] > (source - mine) * (1.0 + policy.slack):
        return None
    return Move(target, f"stage {own.stage} covers {source:,.0f} tokens/s against stage {target}'s {destination:,.0f}; "
                        f"this replica ({mine:,.0f}) is its slowest member")


@dataclass
class Settling:
    """One reader's count of the readings it has seen settled in a row, and each covering replica's
    throughputs in the last `settle_intervals` of them (keyed by peer and stage: a replica that moved
    is another figure; one missing from a reading, a late heartbeat, is averaged over the others).
    A window rather than everything since the swarm settled, so a replica that slows down for good
    (its host got busy) shows within `settle_intervals` readings, however long the swarm was quiet."""

    policy: RebalancePolicy
    readings: int = 0
    history: dict[tuple[str, int], deque[float]] = field(default_factory=dict)

    def observe(self, by_stage: Mapping[int, Sequence[WorkerRecord]], n_stages: int,
                moving: Sequence[MoveRecord] = ()) -> Optional[dict[int, list[WorkerRecord]]]:
        """The covering records with each one's throughput averaged over the window, once there have
        been `settle_intervals` settled readings; None before. An unsettled reading, or a replica not
        seen since the count began, starts it over."""
        if unsettled(by_stage, n_stages, moving) is not None:
            self.readings, self.history = 0, {}
            return None
        covering = _covering(by_stage, n_stages)
        if any((r.peer_id, stage) not in self.history for stage, records in covering.items() for r in records):
            self.readings = 0
            self.history = {(r.peer_id, stage): deque(maxlen=self.policy.settle_intervals)
                            for stage, records in covering.items() for r in records}
        self.readings += 1
        for stage, records in covering.items():
            for r in records:
                self.history[(r.peer_id, stage)].append(r.throughput)
        if self.readings < self.policy.settle_intervals:
            return None
        return {stage: [r.model_copy(update={"throughput": statistics.fmean(self.history[(r.peer_id, stage)])})
                        for r in records] for stage, records in covering.items()}


class Rebalancer:
    """Reads every stage's records (and the moves in transit) each `interval_s` and calls `on_move`
    once a plan is confirmed."""

    def __init__(self, read: Callable[[], Awaitable[tuple[Mapping[int, Sequence[WorkerRecord]], Sequence[MoveRecord]]]],
                 *, n_stages: int,
                 own_peer_id: str, own_phase: Callable[[], str], policy: RebalancePolicy,
                 on_move: Callable[[Move], None]):
        self.read, self.n_stages, self.own_peer_id, self.own_phase = read, n_stages, own_peer_id, own_phase
        self.policy, self.on_move = policy, on_move
        self.settling = Settling(policy)
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="rebalance")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        confirmed: Optional[Move] = None
        count = 0
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                by_stage, moving = await self.read()
            except Exception as error:  # a DHT hiccup: no plan from it, and the counts start over
                logger.debug("rebalancing: could not read the stages' records: %s", error)
                confirmed, count = None, 0
                self.settling = Settling(self.policy)
                continue
            settled = self.settling.observe(by_stage, self.n_stages, moving)
            plan = None if settled is None else plan_move(settled, self.n_stages, self.own_peer_id, self.own_phase(),
                                                          self.policy, moving)
            if plan is None or confirmed is None or plan.target != confirmed.target:
                confirmed, count = plan, int(plan is not None)
            else:
                count += 1
            if confirmed is not None and count >= self.policy.confirmations:
                logger.warning("rebalancing: moving to stage %d: %s", plan.target, plan.why,
                               extra={"milestone": "rebalance", "fields": {"to": plan.target, "why": plan.why}})
                self.on_move(plan)
                return


def moved_argv(argv: Sequence[str], stage: int, state_dir: Optional[str]) -> list[str]:
    """`agora-node ... join ...` arguments for the same worker on `stage` (pure): `--stage` replaced
    (or added after `join`), `--resume-step` dropped (its checkpoints are another stage's), and the
    state directory named, so the key, hence the identity, stays."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--stage", "--resume-step"):
            skip = True
            continue
        if arg.startswith(("--stage=", "--resume-step=")):
            continue
        out.append(arg)
    join = out.index("join")
    extra = ["--stage", str(stage)]
    if state_dir is not None and "--state-dir" not in out and not any(a.startswith("--state-dir=") for a in out):
        extra += ["--state-dir", state_dir]
    return out[:join + 1] + extra + out[join + 1:]
