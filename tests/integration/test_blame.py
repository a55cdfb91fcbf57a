"""Whose failure a refused value is, over real gRPC: a trainer and StageWorkers on loopback, no DHT.

A worker that lies about what it computed is played by an honest one whose replies are rewritten on
its compute thread (its Forward's output wire, or a tail's input gradient). The trainer must count
the failure against the liar, exclude it and finish the run on the honest replicas, and never count
it against the honest worker downstream that received (or refused) the lie:

- outputs a million times too large, after the trainer has seen the stage's ordinary ones: refused
  by the trainer's own bound before they are relayed (node/trainer/stage_client.py `ReplyScales`);
- outputs or input gradients at float32's limit, before the trainer's bound knows the stage: the
  next worker overflows and refuses them naming the frame (`agora-refused-input`), and the trainer
  blames the worker that produced them (node/trainer/blame.py);
- a worker that refuses an ordinary wire, claiming it overflowed: its own failure, its producer
  untouched (the trainer's warmed-up bound vouches for what it relayed).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import replace

import pytest
import torch

from agora.node.replica.request_frames import ExtremeInput
from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.trainer import SwarmTrainer
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.codec import WireCodec
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data
from lying_workers import rewrite_replies, scaled_output

pytestmark = pytest.mark.timeout(180)

CODEC = WireCodec("fp32")
STEPS = 4
FLOAT32_LIMIT = 3.4e38


def _config():
    config = PRESETS["tiny"].with_stages(2)
    return replace(config, train=replace(config.train, batch_size=4, microbatches=2, seq_len=32,
                                         eval_every=0, eval_batches=2))


CONFIG = _config()


@pytest.fixture(scope="module")
def data():
    return build_data(CONFIG)


def _record_largest_wire(worker: StageWorker) -> list[float]:
    """The largest |value| of every wire the worker was sent."""
    forward, seen = worker.compute.forward, []

    def recording(request, **caller):
        seen.append(CODEC.inspect(request.wire).largest_magnitude)
        return forward(request, **caller)
    worker.compute.forward = recording
    return seen


def _limit(field: str):
    def rewrite(reply):
        frame = getattr(reply, field)
        return dataclasses.replace(reply, **{field: CODEC.encode(torch.full_like(CODEC.decode(frame), FLOAT32_LIMIT))})
    return rewrite


async def _train(data, replicas: tuple[int, int], prepare, options: TrainerOptions):
    """Workers (`replicas` per stage, peer ids "s{stage}r{replica}"), `prepare(workers)` to make liars,
    then one trainer's run of STEPS global batches: (records, the trainer's stats, workers by peer,
    what `prepare` returned)."""
    workers: dict[str, StageWorker] = {}
    views = []
    for stage, count in enumerate(replicas):
        for replica in range(count):
            worker = StageWorker(CONFIG, stage, run_id="test", options=WorkerOptions())
            await worker.start()
            peer = f"s{stage}r{replica}"
            workers[peer] = worker
            views.append(WorkerView(peer, worker.address, stage, announced_samples_per_s=100.0))
    try:
        prepared = prepare(workers)
        async with SwarmTrainer(CONFIG, data, StaticDiscovery(views), options) as trainer:
            records = await trainer.run(STEPS)
        return records, trainer.stats, workers, prepared
    finally:
        await asyncio.gather(*(w.stop(0) for w in workers.values()))


def test_a_worker_whose_outputs_turn_a_million_times_larger_is_refused_before_they_reach_the_next_stage(data):
    """Two head replicas, one of which scales its outputs by 1e6 from its third Forward on, when the
    trainer's bound for the head's outputs is warm (4 replies). Stage 1 gets nothing of it (before the
    bound, stage 1 got every lie: a tiny tail normalises its input and computes on), the liar is
    counted and banned, and the run ends on the honest head."""
    def prepare(workers):
        rewrite_replies(workers["s0r1"], scaled_output(1e6), after=2)
        return _record_largest_wire(workers["s1r0"])

    options = TrainerOptions(run_id="test", max_in_flight=1, reply_bound_warmup=4)
    records, stats, _, wires = asyncio.run(_train(data, (2, 1), prepare, options))
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert max(wires) < 100.0, max(wires)  # honest outputs are below 1; the lies were 1e6 times that
    assert stats.extreme_replies_by_peer.get("s0r1", 0) >= 1 and "s0r0" not in stats.extreme_replies_by_peer
    assert "s0r1" in stats.failures_by_peer and "s1r0" not in stats.failures_by_peer
    assert stats.blamed_by_peer == {}


@pytest.mark.parametrize("liar, refuser, field", [("s0r1", "s1r0", "wire"), ("s1r1", "s0r0", "output_grad")],
                         ids=["output", "input_grad"])
def test_a_worker_that_refuses_what_another_produced_gets_the_producer_blamed_not_itself(data, liar, refuser, field):
    """A liar sends values at float32's limit from its first Forward: a head replica its output wire,
    or a tail replica its input gradient. The trainer's bound never warms up here (it would stop them
    itself), so the honest worker downstream (the tail) or upstream (the head's Backward) overflows and
    refuses them naming the frame. The liar is blamed, banned and excluded, the route aborted as after
    any failure; the refuser, the only replica of its stage, is never counted as failed, and the run
    ends."""
    stage_of_liar = int(liar[1])
    replicas = (2, 1) if stage_of_liar == 0 else (1, 2)

    def prepare(workers):
        rewrite_replies(workers[liar], _limit("wire" if stage_of_liar == 0 else "input_grad"))

    options = TrainerOptions(run_id="test", max_in_flight=1, reply_bound_warmup=10**6)
    records, stats, workers, _ = asyncio.run(_train(data, replicas, prepare, options))
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert refuser not in stats.failures_by_peer, stats.failures_by_peer
    assert stats.blamed_by_peer.get(liar, 0) >= 1 and set(stats.blamed_by_peer) == {liar}
    assert stats.failures_by_peer.get(liar, 0) == stats.blamed_by_peer[liar]
    assert workers[refuser].refusals.snapshot().get(f"extreme_{field}", 0) >= 1
    assert stats.aborts.get("dropped", 0) >= 1  # the route was aborted: the head's stashed input dropped


def test_a_worker_crying_wolf_over_an_ordinary_wire_fails_itself_and_its_producer_is_not_blamed(data):
    """One head, two tails; one tail refuses every wire from its third Forward on, claiming it overflowed.
    By then the trainer's bound for the head's outputs is warm and holds those wires ordinary: the
    claim is the claimant's failure, and the head is never blamed or banned."""
    def prepare(workers):
        def crying(reply):
            raise ExtremeInput("wire: the request's values overflowed it (a lie)", "wire")
        rewrite_replies(workers["s1r1"], crying, after=2)

    options = TrainerOptions(run_id="test", max_in_flight=1, reply_bound_warmup=2)
    records, stats, workers, _ = asyncio.run(_train(data, (1, 2), prepare, options))
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert stats.blamed_by_peer == {} and "s0r0" not in stats.failures_by_peer
    assert stats.failures_by_peer.get("s1r1", 0) >= 1
    assert workers["s1r1"].refusals.snapshot().get("extreme_wire", 0) >= 1
