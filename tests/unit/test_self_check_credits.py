"""A self check reserves its worker's credits only when it sends probes (node/trainer/reply_checks.py).

The probes' credits are released by their calls' outcomes; a check with nothing to probe (a zero
gradient, or a zero input) sends no call, so it must reserve nothing. A tail answering zeros once had
two credits taken at every reply, was starved of traffic after three lies and never flagged.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from agora.node.trainer.blame import Blame
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.reply_checks import ReplyChecks
from agora.node.trainer.routing import Roster, WorkerView
from agora.node.trainer.stage_client import ReplyScales
from agora.node.trainer.stats import TrainerStats
from agora.pipeline.codec import WireCodec

CODEC = WireCodec("fp32")
TAIL = WorkerView("tail", "127.0.0.1:5002", 2, announced_credits=8)


def _checks(calls: list[str]) -> tuple[ReplyChecks, Roster]:
    roster = Roster(microbatch_size=1)
    roster.refresh([TAIL])
    stats = TrainerStats()
    blame = Blame(roster, stats, ReplyScales(factor=8.0, warmup=4), CODEC, clock=lambda: 100.0)

    async def held_out(view, probe_id, tokens, frame, targets, full_precision):
        calls.append(probe_id)
        roster.workers[view.peer_id].in_flight -= 1  # what the trainer's timed call does with its credit
        # On other weights than the gradient's: nothing judged.
        return SimpleNamespace(loss=2.5, wire=None, weights_version=99, compute_s=0.0, full_precision=True)

    options = TrainerOptions(run_id="test", gradient_check_share=1.0)
    return ReplyChecks(options, CODEC, roster, stats, blame, lambda: 100.0, held_out), roster


def _check_tail(checks: ReplyChecks, gradient: torch.Tensor) -> None:
    tokens = torch.zeros(1, 4, dtype=torch.long)
    wire = torch.randn(1, 4, 8)
    checks.self_check(checks.roster.workers["tail"], "mb-1", tokens, tokens, CODEC.encode(wire),
                      CODEC.encode(gradient), None, 3, trained=(2.5, 3))


def test_a_zero_gradient_reserves_no_credit_and_sends_no_probe():
    async def run():
        calls: list[str] = []
        checks, roster = _checks(calls)
        for _ in range(5):
            _check_tail(checks, torch.zeros(1, 4, 8))
        await checks.drain()
        assert roster.workers["tail"].in_flight == 0 and calls == []
    asyncio.run(run())


def test_a_gradient_to_probe_reserves_the_two_probes_credits():
    async def run():
        calls: list[str] = []
        checks, roster = _checks(calls)
        _check_tail(checks, torch.randn(1, 4, 8))
        assert roster.workers["tail"].in_flight == 2
        await checks.drain()
        assert sorted(calls) == ["mb-1.grad-minus", "mb-1.grad-plus"] and roster.workers["tail"].in_flight == 0
    asyncio.run(run())
