"""The trainer's verifier over real gRPC: a trainer and StageWorkers on loopback, no DHT, and the
run's authorizer (grpc.aio, TLS under the run's root) that admitted the liar and the trainer.

Two head replicas and one tail; one head turns liar after 40 honest global batches and scales every
output by ten from then on: within every format check and scale bound (x1000), and still a lie
the tail would train on. The trainer must flag that head (and no one else) within the stated
number of its replies, exclude it for the rest of the run, refuse the reply that showed it (the
microbatch rerun on the honest head), and finish the run; and report it to the authorizer, which
bans it (the ban list every node reads, tests/integration/test_bans.py) and refuses its renewal.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace

import pytest

from agora.auth.admission import CredentialRenewer, RenewalRefused
from agora.monitor.metrics import sample_value
from agora.node.trainer.reports import WorkerReports
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.trainer import SwarmTrainer
from agora.node.trainer.verification import DETECTION_REPLIES
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data
from lying_workers import BEHAVIOURS, LieSchedule, make_liar
import authorizer_world as world
from authorizer_world import join, serving

pytestmark = pytest.mark.timeout(180)

authority, keys, nodes = world.authority, world.keys, world.nodes  # fixtures

HONEST_STEPS = 40  # the liar's optimizer steps before it lies: global batches past tiny's early drift
# Keyed to steps, not to the liar's replies: routing splits each global batch's four microbatches by
# the heads' measured speed, which a loaded host moves, and a liar that reaches a count of honest
# replies early lies while tiny's values still drift fast. Lying from step 20 it stood 2 to 3 spreads
# off and owned half the reference before its CUSUM was half-way: 72 lies, none flagged; from step 40,
# 5 to 8 (spread 0.22-0.32 of log RMS). Room after the start for 4 * DETECTION_REPLIES lies at a
# quarter of the microbatches and more.
STEPS = HONEST_STEPS + 4 * DETECTION_REPLIES + 8


def _config():
    config = PRESETS["tiny"].with_stages(2)
    return replace(config, train=replace(config.train, batch_size=8, microbatches=4, seq_len=32,
                                         eval_every=0, eval_batches=2))


CONFIG = _config()


async def _train_with_a_liar(data, liar: str, stats: TrainerStats, on_flagged):
    """`liar`: the lying head's peer id (an admitted worker's); `on_flagged`: the trainer's reporter."""
    stages = {"s0r0": 0, liar: 0, "s1r0": 1}
    workers = {}
    for peer, stage in stages.items():
        workers[peer] = StageWorker(CONFIG, stage, run_id="test", options=WorkerOptions())
        await workers[peer].start()
    try:
        lies = make_liar(workers[liar], BEHAVIOURS["x10"], schedule=LieSchedule(honest_steps=HONEST_STEPS))
        views = [WorkerView(peer, w.address, stages[peer], announced_samples_per_s=100.0) for peer, w in workers.items()]
        # Self checks off: a head's replays would name the x10 liar on their own; shown here is the
        # verifier's path from flag to ban (self checks take the same one: test_gradient_checks_grpc.py).
        options = TrainerOptions(run_id="test", max_in_flight=1, verify_warmup=16, gradient_check_share=0.0)
        async with SwarmTrainer(CONFIG, data, StaticDiscovery(views), options, stats=stats,
                                on_flagged=on_flagged) as trainer:
            records = await trainer.run(STEPS)
        return records, trainer, lies
    finally:
        await asyncio.gather(*(w.stop(0) for w in workers.values()))


async def _train_reported(data, liar_node, trainer_node, authority):
    """The run with the authorizer that admitted the liar and the trainer; what the run, the reporter
    and the liar's next renewal got."""
    async with serving(authority, credential_lifetime_s=600.0) as (service, address):
        await join(address, liar_node, authority)
        await join(address, trainer_node, authority, role="trainer")
        stats = TrainerStats()
        async with WorkerReports(address, trainer_node, stats) as reports:
            run = await _train_with_a_liar(data, liar_node.peer_id, stats, reports.flagged)
        try:
            await CredentialRenewer(address, liar_node, on_revoked=pytest.fail).renew_once()
        except RenewalRefused as refused:
            return run, reports.receipts, refused.reason
        return run, reports.receipts, None


def test_a_head_replica_scaling_its_outputs_by_ten_is_flagged_excluded_reported_and_banned(authority, nodes, caplog):
    caplog.set_level(logging.WARNING, logger="agora.node.trainer")
    liar_node, trainer_node, liar = nodes(0), nodes(1), nodes(0).peer_id
    try:
        (records, trainer, liar_record), receipts, renewal = asyncio.run(
            _train_reported(build_data(CONFIG), liar_node, trainer_node, authority))
        ban = authority.is_banned(liar)
    finally:
        authority.unban(liar)
    stats = trainer.stats
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert set(stats.flagged_by_peer) == {liar}, json.dumps(  # a string: shown whole, not abbreviated
        {"lies": liar_record.lies, "lie_steps": liar_record.lie_steps, "flagged": stats.flagged_by_peer, "failures": stats.failures_by_peer,
         "verification": trainer.verification_summary()})
    assert "output" in stats.flagged_by_peer[liar]
    # One microbatch in flight: every lie was judged before the next call; the one that tripped the
    # verifier was refused (its route aborted and rerun), and the liar was never called again. Tiny's
    # head output scale varies by a fifth to a third between microbatches, so x10 is 7 to 12 spreads
    # off: 4 to 9 over the drift allowance per reply, the bar passed on the 4th to the 8th reply (no
    # lie, however large, before DETECTION_REPLIES; the bound asserted is the unit tests').
    assert DETECTION_REPLIES <= liar_record.lies <= 4 * DETECTION_REPLIES, (
        liar_record, trainer.verification_summary(), trainer.checks.verifier.flagged()[liar].fields())
    assert stats.failures_by_peer.get(liar) == 1 and set(stats.failures_by_peer) == {liar}
    assert stats.aborts, stats.aborts  # the refused reply's route was aborted
    assert sample_value(stats.registry, "agora_trainer_flagged_workers_total", {"stage": "0", "kind": "output"}) == 1
    flagged = [r for r in caplog.records if getattr(r, "milestone", None) == "worker_flagged"]
    assert len(flagged) == 1 and flagged[0].fields["peer"] == liar and flagged[0].fields["feature"] == "log_rms"
    # The honest head carried the rest of the run.
    assert trainer.roster.excluded == {liar}
    # Reported once, in the background, and banned by the authorizer: the ban names the trainer, and
    # the liar's credential is not renewed (it leaves within one lifetime).
    assert set(receipts) == {liar} and receipts[liar].banned
    assert sample_value(stats.registry, "agora_trainer_worker_reports_total", {"outcome": "sent"}) == 1
    assert ban is not None and trainer_node.peer_id in ban.reason and "stage 0 output log_rms" in ban.reason, ban
    assert renewal is not None and renewal.startswith("banned: flagged by 1 trainer(s)"), renewal
