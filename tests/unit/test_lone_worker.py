"""A stage's only worker whose statistics trip (node/trainer/lone_worker.py), as the trainer's reply checks
wire it (node/trainer/reply_checks.py): not flagged, logged, checked at once; and the pure rule itself.
"""

from __future__ import annotations

import logging

import pytest
import torch

from agora.node.trainer.blame import Blame, SuspectReply
from agora.node.trainer.lone_worker import LoneNotice, held_to, lone_trip, vouched
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.reply_checks import ReplyChecks
from agora.node.trainer.routing import Roster, WorkerView
from agora.node.trainer.stage_client import ReplyScales
from agora.node.trainer.stats import TrainerStats
from agora.pipeline.codec import WireCodec

CODEC = WireCodec("fp32")
TAIL = WorkerView("tail", "127.0.0.1:5002", 1, announced_credits=8)
REPLIES_A_VERSION = 8


def _checks(gradient_share: float) -> ReplyChecks:
    roster = Roster(microbatch_size=1)
    roster.refresh([TAIL])
    stats = TrainerStats()
    blame = Blame(roster, stats, ReplyScales(factor=1e6, warmup=4), CODEC, clock=lambda: 100.0)

    async def held_out(*call):  # no probe is sent here: `verify` alone is exercised
        raise AssertionError("no held-out call expected")

    options = TrainerOptions(run_id="test", gradient_check_share=gradient_share)
    return ReplyChecks(options, CODEC, roster, stats, blame, lambda: 100.0, held_out)


def _spiking_tail(checks: ReplyChecks, versions: int) -> list[Exception | None]:
    """The sole tail's input gradients, flat for 10 weights versions, then 9-fold (2.2 in log-RMS) as the loss
    spikes; what `verify` made of each (None: relayed)."""
    generator, outcomes = torch.Generator().manual_seed(0), []
    for index in range(versions * REPLIES_A_VERSION):
        version = index // REPLIES_A_VERSION
        scale = 9.0 if version >= 10 else 1.0
        gradient = scale * 1e-4 * torch.randn(1, 16, 8, generator=generator)
        tokens = torch.randint(0, 1000, (1, 16), generator=generator)
        try:
            checks.verify(checks.roster.workers["tail"], "input_grad", CODEC.encode(gradient), None, "Forward",
                          [], tokens, version=version)
            outcomes.append(None)
        except SuspectReply as refused:
            outcomes.append(refused)
    return outcomes


def test_a_lone_tails_spike_is_logged_and_checked_at_once_not_flagged(caplog):
    caplog.set_level(logging.INFO, logger="agora.node.trainer")
    checks = _checks(gradient_share=0.05)
    outcomes = _spiking_tail(checks, versions=12)  # the check at once undecided all along: held, not flagged
    assert outcomes == [None] * len(outcomes) and checks.roster.excluded == set()
    lone = [r for r in caplog.records if getattr(r, "milestone", None) == "lone_worker_checked"]
    assert len(lone) == 1 and lone[0].fields["peer"] == "tail" and lone[0].fields["feature"] == "log_rms"
    assert checks.gradients.suspected("tail")  # on probation: its next reply is checked, credits free or not
    assert checks.verification_summary()["lone_trips"] == 1


def test_with_self_checks_off_nothing_vouches_and_the_second_trip_flags_it():
    checks = _checks(gradient_share=0.0)
    outcomes = _spiking_tail(checks, versions=12)
    assert any(outcomes) and checks.roster.excluded == {"tail"} and checks.verification_summary()["lone_trips"] == 1


def test_the_rule_excuses_once_holds_while_its_check_is_undecided_and_flags_past_the_window():
    notice = LoneNotice(since=100, passes=3, version=10)
    assert lone_trip(None, 100, window=64, checking=False) == "excuse"
    assert lone_trip(notice, 120, window=64, checking=True) == "hold"
    assert lone_trip(notice, 164, window=64, checking=True) == "flag"
    assert lone_trip(notice, 120, window=64, checking=False) == "flag"
    assert vouched(notice, passes=4, checking=False) and not vouched(notice, passes=4, checking=True)
    assert not vouched(notice, passes=3, checking=False) and not vouched(None, passes=9, checking=False)
    assert held_to(notice, 14) == 10 and held_to(notice, 9) == 9 and held_to(None, 14) == 14


@pytest.mark.parametrize("version", [None, 12])
def test_without_versions_a_notice_holds_nothing_back(version):
    assert held_to(LoneNotice(since=0, passes=0, version=None), version) == version
