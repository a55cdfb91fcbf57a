"""A swarm to attack: tiny in three stages (head, body, tail), two replicas each, on loopback.

Six StageWorkers and one SwarmTrainer in this process, no DHT (StaticDiscovery), so a liar at any
position has an honest twin on its stage. A `Plan` names a run: its seed and steps, the verifier on
or off, an attack of `ATTACKS` at a position (or none: clean), the liar's schedule, and churn (a
body replica leaving half-way). `run_plan` trains it and returns what the trainer caught: per peer
its first catch (the verifier's flag, the scale bound's refusal, or blame for a refusal
downstream), with the liar's lies and its stage's step at that moment, and the held-out loss
after the run (the liar's held-out replies are honest: the loss measures what its lies did to
the weights). The liar is replica 1 of its stage (`s<stage>r1`); a stage's replicas are averaged every
`AVERAGE_EVERY` steps (`ReplicaAverage`). bench/attacks.py runs the suite;
tests/integration/test_attack_suite.py its quick form.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
from dataclasses import dataclass, replace

import torch

from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.trainer import SwarmTrainer
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data
from lying_workers import BEHAVIOURS, LieSchedule, make_liar

__all__ = ["ATTACKS", "AVERAGE_EVERY", "Attack", "CATCHES", "CHURNED", "PEERS", "POSITIONS", "Plan", "ReplicaAverage",
           "run_plan"]

POSITIONS = {"head": 0, "body": 1, "tail": 2}
PEERS = {f"s{stage}r{replica}": stage for stage in POSITIONS.values() for replica in range(2)}
CHURNED = "s1r1"  # the body replica a churned clean run loses half-way
# A stage's replicas are averaged exactly every this many steps, as the verifier's own measurements
# assume (tests/unit/test_verification.py): replicas that never average drift apart, and over a
# hundred steps the verifier rightly tells one from the other.
AVERAGE_EVERY = 3
# Trainer stats methods whose first call on a peer is a catch, and how it reads in the table.
CATCHES = {"flagged": "verifier", "extreme_reply": "scale bound", "blamed": "blamed"}


@dataclass(frozen=True)
class Attack:
    """A behaviour of lying_workers.BEHAVIOURS and in which frame a head or body lies (a tail: always its
    input gradient); `period` > 0: on-off, lying that many replies, honest as many; `late`: a plan
    gives it a long honest start (the plan's schedule says how long)."""

    behaviour: str
    frame: str = "output"
    period: int = 0
    late: bool = False

    def frame_at(self, position: str) -> str | None:
        """The frame lied in at `position`; None where this attack has nothing to lie in."""
        if position == "tail":
            return "input_grad"
        return None if position == "head" and self.frame == "input_grad" else self.frame


ATTACKS = {
    "x10": Attack("x10"), "x1e4": Attack("x1e4"), "noise": Attack("noise"), "sign-grad": Attack("sign", "input_grad"),
    "zeros": Attack("zeros"), "constant": Attack("constant"), "stale": Attack("stale"), "bias": Attack("bias"),
    "on-off": Attack("x10", period=4), "late": Attack("x10", late=True),
}


@dataclass(frozen=True)
class Plan:
    """One run: its seed and steps, the verifier on or off, the attack and where (None: clean)."""

    seed: int
    steps: int
    verify: bool = True
    attack: str | None = None
    position: str | None = None
    schedule: LieSchedule = LieSchedule()
    churn: bool = False
    lie_in_checks: bool = False  # the liar lies in held-out Forwards too (make_liar's `in_checks`)


def _config(seed: int):
    # 16 held-out batches: with 4, the figure moved 2% between runs that differed only in routing.
    # Short sequences: a run of 40 steps takes seconds, so a suite of ~120 runs fits 15 minutes.
    config = PRESETS["tiny"].with_stages(len(POSITIONS))
    return replace(config, seed=seed, train=replace(config.train, batch_size=8, microbatches=4, seq_len=32,
                                                    eval_every=0, eval_batches=16))


def _trainer_options(verify: bool, spot_share: float | None, gradient_share: float | None = None) -> TrainerOptions:
    """The trainer's options; `spot_share` and `gradient_share` go to its `spot_check_share` and
    `gradient_check_share` fields where it has them (None: the trainer's default)."""
    extra, fields = {}, {f.name for f in dataclasses.fields(TrainerOptions)}
    for name, share in (("spot_check_share", spot_share), ("gradient_check_share", gradient_share)):
        if share is not None:
            if name not in fields:
                raise SystemExit(f"this trainer has no {name} option")
            extra[name] = share
    return TrainerOptions(run_id="attacks", max_in_flight=2, verify_replies=verify, **extra)


def _check_named(evidence) -> str:
    """Which of the trainer's checks a flag's evidence (`Evidence.describe()`) comes from."""
    text = str(evidence)
    for words, name in (("finite-difference", "gradient check"), ("replays on the same weights", "replay check"),
                        ("spot check", "spot check"), ("repeated one of its earlier replies", "repeat check")):
        if words in text:
            return name
    return "verifier"


def _record_catches(stats, liar_worker: StageWorker | None, liar) -> dict[str, dict]:
    """Per peer, its first catch by the trainer: how, the liar's lies so far and its stage's step then."""
    catches: dict[str, dict] = {}
    for method, how in CATCHES.items():
        original = getattr(stats, method)

        def recording(peer, *args, _original=original, _how=how, **kwargs):
            if peer not in catches:
                catches[peer] = {"how": _check_named(args[-1]) if _how == "verifier" and args else _how,
                                 "lies": liar.lies if liar else 0,
                                 "step": liar_worker.compute.optimizer.steps if liar_worker else None}
            return _original(peer, *args, **kwargs)
        setattr(stats, method, recording)
    return catches


def _add(compute, delta: list[torch.Tensor]) -> None:
    compute.weights_changing()
    with torch.no_grad():
        for parameter, change in zip(compute.optimizer.parameters, delta):
            parameter.add_(change)


class ReplicaAverage:
    """A stage's replicas averaged exactly every `every` steps, in place of averaging over a DHT.

    A step hook on each replica's compute thread snapshots its weights at every `every`-th step;
    the replica whose snapshot completes the round computes the mean and each replica adds
    (mean - its snapshot) on its own compute thread (the delta rule of node/averaging: steps taken
    since the snapshot are kept). A round a replica never reaches (it left) is never applied."""

    def __init__(self, workers: list[StageWorker], every: int = AVERAGE_EVERY):
        self._workers, self._every = workers, every
        self._snapshots: dict[int, dict[int, list[torch.Tensor]]] = {}
        self._lock = threading.Lock()
        self.rounds = 0
        for index, worker in enumerate(workers):
            worker.compute.step_hooks.append(functools.partial(self._stepped, index))

    def _stepped(self, index: int, compute) -> None:
        step = compute.optimizer.steps
        if step % self._every:
            return
        with self._lock:
            snapshots = self._snapshots.setdefault(step, {})
            snapshots[index] = [parameter.detach().clone() for parameter in compute.optimizer.parameters]
            if len(snapshots) < len(self._workers):
                return
            del self._snapshots[step]
            self.rounds += 1
        mean = [torch.stack(group).mean(dim=0) for group in zip(*snapshots.values())]
        for other, worker in enumerate(self._workers):
            delta = [average - own for average, own in zip(mean, snapshots[other])]
            if other == index:
                _add(compute, delta)
            else:
                worker.submit_compute(functools.partial(_add, delta=delta))


def _leave_half_way(workers: dict[str, StageWorker], steps: int, stopped: set[str], loop) -> list:
    """Churn: the body replica `CHURNED` stops once its twin has taken half the steps (a step hook);
    returns the list its stop's future goes into."""
    leaving: list = []

    def stepped(compute) -> None:
        if compute.optimizer.steps == steps // 2 and not leaving:
            stopped.add(CHURNED)
            leaving.append(asyncio.run_coroutine_threadsafe(workers[CHURNED].stop(0), loop))
    workers["s1r0"].compute.step_hooks.append(stepped)
    return leaving


async def run_plan(plan: Plan, spot_share: float | None = None, gradient_share: float | None = None) -> dict:
    """Train one `plan` on a fresh swarm: the liar's catches, the held-out loss, the lies told, and
    (where the trainer checks gradients) whom those checks flagged and each checked worker's
    smallest and largest ratio."""
    config = _config(plan.seed)
    data = build_data(config)
    torch.manual_seed(plan.seed)
    workers = {peer: StageWorker(config, stage, run_id="attacks", options=WorkerOptions())
               for peer, stage in PEERS.items()}
    stopped: set[str] = set()
    liar_peer = liar = None
    try:
        for worker in workers.values():
            await worker.start()
        averages = [ReplicaAverage([workers[peer] for peer, of in PEERS.items() if of == stage])
                    for stage in POSITIONS.values()]
        leaving = _leave_half_way(workers, plan.steps, stopped, asyncio.get_running_loop()) if plan.churn else []
        if plan.attack is not None:
            liar_peer = f"s{POSITIONS[plan.position]}r1"
            attack = ATTACKS[plan.attack]
            liar = make_liar(workers[liar_peer], BEHAVIOURS[attack.behaviour], frame=attack.frame_at(plan.position),
                             schedule=plan.schedule, in_checks=plan.lie_in_checks)
        views = [WorkerView(peer, w.address, PEERS[peer], announced_samples_per_s=100.0) for peer, w in workers.items()]
        options = _trainer_options(plan.verify, spot_share, gradient_share)
        async with SwarmTrainer(config, data, StaticDiscovery(views), options) as trainer:
            catches = _record_catches(trainer.stats, workers.get(liar_peer), liar)
            await trainer.run(plan.steps)
            for stop in leaving:
                await asyncio.wrap_future(stop)
            held_out = await trainer.evaluate(data.heldout_batches(config.train.eval_batches, config.train.batch_size))
            judge = trainer.checks.gradients.judge
        return {"seed": plan.seed, "steps": plan.steps, "attack": plan.attack, "position": plan.position,
                "verify": plan.verify, "churn": plan.churn, "liar": liar_peer, "caught": catches, "heldout": held_out,
                "lies": liar.lies if liar else 0, "replies": liar.replies if liar else 0,
                "started_at": liar.started_at if liar else None, "averaging_rounds": [a.rounds for a in averages],
                "first_lie_step": liar.lie_steps[0] if liar and liar.lie_steps else None,
                "gradient_flagged": sorted(judge.flagged) if judge else [],
                "gradient_ratios": judge.extremes() if judge else {},
                "replay_distances": judge.farthest_replays() if judge and hasattr(judge, "farthest_replays") else {},
                "check_failures": judge.failures() if judge and hasattr(judge, "failures") else {}}
    finally:
        await asyncio.gather(*(w.stop(0) for peer, w in workers.items() if peer not in stopped))
