"""A swarm to attack: tiny in three stages (head, body, tail), two replicas each, on loopback.

Six StageWorkers and one SwarmTrainer in this process, no DHT (StaticDiscovery), so a liar at any
position has an honest twin on its stage. A `Plan` names a run: its seed and steps, the verifier on
or off, an attack of `ATTACKS` at a position (or none: clean), the liar's schedule, and churn (a
body replica leaving half-way). `run_plan` trains it and returns what the trainer caught: per peer
its first catch (the verifier's flag, the scale bound's refusal, or blame for a refusal
downstream), with the liar's lies and its stage's step at that moment, and the held-out loss
after the run (the liar's held-out replies are honest: the loss measures what its lies did to
the weights). The liar is replica 1 of its stage (`s<stage>r1`). bench/attacks.py runs the suite;
tests/integration/test_attack_suite.py its quick form.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, replace

import torch

from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.trainer import SwarmTrainer, TrainerOptions
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data
from lying_workers import BEHAVIOURS, LieSchedule, make_liar

__all__ = ["ATTACKS", "Attack", "CATCHES", "CHURNED", "PEERS", "POSITIONS", "Plan", "run_plan"]

POSITIONS = {"head": 0, "body": 1, "tail": 2}
PEERS = {f"s{stage}r{replica}": stage for stage in POSITIONS.values() for replica in range(2)}
CHURNED = "s1r1"  # the body replica a churned clean run loses half-way
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


def _config(seed: int):
    # 16 held-out batches: with 4, the figure moved 2% between runs that differed only in routing.
    # Short sequences: a run of 40 steps takes seconds, so a suite of ~120 runs fits 15 minutes.
    config = PRESETS["tiny"].with_stages(len(POSITIONS))
    return replace(config, seed=seed, train=replace(config.train, batch_size=8, microbatches=4, seq_len=32,
                                                    eval_every=0, eval_batches=16))


def _trainer_options(verify: bool, spot_share: float | None) -> TrainerOptions:
    """The trainer's options; `spot_share` goes to a `spot_check_share` field where the trainer has one."""
    extra = {}
    if spot_share is not None:
        if "spot_check_share" not in {f.name for f in dataclasses.fields(TrainerOptions)}:
            raise SystemExit("--spot-share: this trainer has no spot_check_share option")
        extra["spot_check_share"] = spot_share
    return TrainerOptions(run_id="attacks", max_in_flight=2, verify_replies=verify, **extra)


def _record_catches(stats, liar_worker: StageWorker | None, liar) -> dict[str, dict]:
    """Per peer, its first catch by the trainer: how, the liar's lies so far and its stage's step then."""
    catches: dict[str, dict] = {}
    for method, how in CATCHES.items():
        original = getattr(stats, method)

        def recording(peer, *args, _original=original, _how=how, **kwargs):
            if peer not in catches:
                catches[peer] = {"how": _how, "lies": liar.lies if liar else 0,
                                 "step": liar_worker.compute.optimizer.steps if liar_worker else None}
            return _original(peer, *args, **kwargs)
        setattr(stats, method, recording)
    return catches


async def _leave_half_way(workers: dict[str, StageWorker], steps: int, stopped: set[str]) -> None:
    """Churn: the body replica `CHURNED` goes once its twin's stage has taken half the steps."""
    twin = workers["s1r0"].compute.optimizer
    while twin.steps < steps // 2:
        await asyncio.sleep(0.05)
    stopped.add(CHURNED)
    await workers[CHURNED].stop(0)


async def run_plan(plan: Plan, spot_share: float | None = None) -> dict:
    """Train one `plan` on a fresh swarm: the liar's catches, the held-out loss, the lies told."""
    config = _config(plan.seed)
    data = build_data(config)
    torch.manual_seed(plan.seed)
    workers = {peer: StageWorker(config, stage, run_id="attacks", options=WorkerOptions()) for peer, stage in PEERS.items()}
    stopped: set[str] = set()
    liar_peer = liar = None
    try:
        for worker in workers.values():
            await worker.start()
        if plan.attack is not None:
            liar_peer = f"s{POSITIONS[plan.position]}r1"
            attack = ATTACKS[plan.attack]
            liar = make_liar(workers[liar_peer], BEHAVIOURS[attack.behaviour], frame=attack.frame_at(plan.position),
                             schedule=plan.schedule)
        views = [WorkerView(peer, w.address, PEERS[peer], announced_samples_per_s=100.0) for peer, w in workers.items()]
        async with SwarmTrainer(config, data, StaticDiscovery(views), _trainer_options(plan.verify, spot_share)) as trainer:
            catches = _record_catches(trainer.stats, workers.get(liar_peer), liar)
            churn = asyncio.create_task(_leave_half_way(workers, plan.steps, stopped)) if plan.churn else None
            await trainer.run(plan.steps)
            if churn is not None:
                churn.cancel()
            held_out = await trainer.evaluate(data.heldout_batches(config.train.eval_batches, config.train.batch_size))
        return {"seed": plan.seed, "steps": plan.steps, "attack": plan.attack, "position": plan.position, "verify": plan.verify,
                "churn": plan.churn, "liar": liar_peer, "caught": catches, "heldout": held_out,
                "lies": liar.lies if liar else 0, "replies": liar.replies if liar else 0,
                "started_at": liar.started_at if liar else None,
                "first_lie_step": liar.lie_steps[0] if liar and liar.lie_steps else None}
    finally:
        await asyncio.gather(*(w.stop(0) for peer, w in workers.items() if peer not in stopped))
