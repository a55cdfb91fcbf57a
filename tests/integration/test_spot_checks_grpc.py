"""Spot checks over real gRPC: a trainer and StageWorkers on loopback, no DHT.

Three head replicas and one tail; one head lies from its first training Forward in a way no
statistic of its replies shows (each of its replies keeps an honest reply's scale, spread and
direction): it answers for the batch's rows rolled by one. It answers held-out Forwards honestly, as
a liar that knows them would. Without spot checks the verifier lets it through; with them it is
named by the two honest heads, whose replies agree with each other's answers, excluded,
and the run goes on. Honest replicas checked on every Forward are never named. A head replaying its
previous microbatch's output keeps every statistic too, but its first replay repeats an earlier
reply to other tokens: the repeat checks name it, spot checks or not.

The head replicas are averaged every `AVERAGE_EVERY` global batches, on their compute threads as
an averaging round applies its result (`weights_changing`, then the write): between rounds they
drift apart, as replicas under asynchronous averaging do. (Never averaged, tiny's head replicas
drift as far apart as a lie within a dozen steps, and then no comparison can tell them from one.)
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import pytest
import torch

from agora.monitor.metrics import sample_value
from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.trainer import SwarmTrainer
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.codec import WireCodec
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data
from lying_workers import rewrite_replies

pytestmark = pytest.mark.timeout(240)

# The liar's 16th checked reply names it (`MIN_CHECKED`): at a third of the heads' 4 Forwards a step,
# some 12 steps of checks if none is skipped. 20 steps named it on the last few, and under load (checks
# skipped for want of a free credit, the liar routed less) not at all; 28 leave room.
STEPS = 28
AVERAGE_EVERY = 2
# A quarter of tiny's: at tiny's own, one Adam step moves a head replica's outputs (an embedding of
# std 0.02) by a quarter to a half of their size, as far as a lie; a model's step moves them far less.
LEARNING_RATE = 5e-4
STAGES = {"s0r0": 0, "s0r1": 0, "s0r2": 0, "s1r0": 1}
LIAR = "s0r2"
CODEC = WireCodec("fp32")


def rewritten_output(transform):
    """A Forward reply's output rewritten: `transform(honest output, the previous honest output or None)`."""
    previous = [None]

    def rewrite(reply):
        honest = CODEC.decode(reply.wire)
        lie = transform(honest, previous[0])
        previous[0] = honest
        return replace(reply, wire=CODEC.encode(lie))
    return rewrite


LIES = {
    "stale": lambda output, previous: output if previous is None else previous,
    "rows_rolled": lambda output, previous: output.roll(1, dims=0),
}


def _config():
    config = PRESETS["tiny"].with_stages(2)
    return replace(config, optim=replace(config.optim, lr=LEARNING_RATE),
                   train=replace(config.train, batch_size=8, microbatches=4, seq_len=32, eval_every=0, eval_batches=2))


CONFIG = _config()


async def _average(heads: list[StageWorker]) -> None:
    """Every head replica's weights set to their mean (the replicas' outputs are then alike again)."""
    copies = await asyncio.gather(*(head.on_compute(
        lambda compute: [p.detach().clone() for p in compute.optimizer.parameters]) for head in heads))
    means = [torch.stack(group).mean(dim=0) for group in zip(*copies)]

    def apply(compute) -> None:
        compute.weights_changing()
        with torch.no_grad():
            for parameter, mean in zip(compute.optimizer.parameters, means):
                parameter.copy_(mean)
    await asyncio.gather(*(head.on_compute(apply) for head in heads))


async def _train(lie, share: float):
    workers = {peer: StageWorker(CONFIG, stage, run_id="test", options=WorkerOptions())
               for peer, stage in STAGES.items()}
    try:
        for worker in workers.values():
            await worker.start()
        if lie is not None:
            rewrite_replies(workers[LIAR], rewritten_output(lie))
        views = [WorkerView(peer, w.address, STAGES[peer], announced_samples_per_s=100.0)
                 for peer, w in workers.items()]
        # Self checks off: their replays would name a lying head on their own (tests/integration/
        # test_gradient_checks_grpc.py); what is shown here is what spot checks do.
        options = TrainerOptions(run_id="test", max_in_flight=2, verify_warmup=16, spot_check_share=share,
                                 gradient_check_share=0.0)
        heads, rounds = [w for peer, w in workers.items() if STAGES[peer] == 0], set()

        def averaged(record) -> None:
            if record.step % AVERAGE_EVERY == 0:
                rounds.add(asyncio.get_running_loop().create_task(_average(heads)))
        async with SwarmTrainer(CONFIG, build_data(CONFIG), StaticDiscovery(views), options,
                                on_record=averaged) as trainer:
            records = await trainer.run(STEPS)
            await asyncio.gather(*rounds)
        return records, trainer
    finally:
        await asyncio.gather(*(w.stop(0) for w in workers.values()))


def test_a_head_replaying_its_previous_output_is_named_by_its_first_repeat_without_spot_checks():
    records, trainer = asyncio.run(_train(LIES["stale"], 0.0))
    assert len(records) == STEPS and set(trainer.stats.flagged_by_peer) == {LIAR}, trainer.stats.flagged_by_peer
    assert "repeated one of its earlier replies" in trainer.stats.flagged_by_peer[LIAR]  # node/trainer/repeats.py


# A replay of the previous output is the repeat checks' (above); what only spot checks see is an answer
# for other rows of the same batch.
@pytest.mark.parametrize("lie", ["rows_rolled"])
def test_a_head_lying_from_its_first_reply_past_every_statistic_is_named_by_spot_checks(lie, caplog):
    caplog.set_level(logging.WARNING, logger="agora.node.trainer")
    records, unchecked = asyncio.run(_train(LIES[lie], 0.0))
    assert len(records) == STEPS and unchecked.stats.flagged_by_peer == {}, unchecked.stats.flagged_by_peer
    assert unchecked.stats.spot_check_split() == {}

    caplog.clear()
    records, trainer = asyncio.run(_train(LIES[lie], 1.0))
    stats = trainer.stats
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert set(stats.flagged_by_peer) == {LIAR}, (stats.flagged_by_peer, stats.spot_check_split(),
                                                  stats.failures_by_peer)
    assert "disagreed on spot checks" in stats.flagged_by_peer[LIAR]
    assert trainer.roster.excluded == {LIAR}
    assert sample_value(stats.registry, "agora_trainer_flagged_workers_total", {"stage": "0", "kind": "output"}) == 1
    flagged = [r for r in caplog.records if getattr(r, "milestone", None) == "worker_flagged"]
    assert len(flagged) == 1 and flagged[0].fields["peer"] == LIAR and flagged[0].fields["feature"] == "spot_check"
    split = stats.spot_check_split()
    assert set(split) == {"0"} and split["0"]["sent"] > 0 and split["0"]["disagreements"] >= 2
    assert split["0"]["compute_s"] > 0


def test_honest_replicas_checked_on_every_forward_are_never_named():
    records, trainer = asyncio.run(_train(None, 1.0))
    stats = trainer.stats
    assert len(records) == STEPS
    assert stats.flagged_by_peer == {} and trainer.roster.excluded == set()
    split = stats.spot_check_split()
    # Between averaging rounds tiny's head replicas drift apart by up to half their outputs' size over
    # the first steps: some checks disagree, no worker's replies mostly do.
    assert split["0"]["sent"] > STEPS and split["0"]["disagreements"] < split["0"]["sent"] / 2, split
