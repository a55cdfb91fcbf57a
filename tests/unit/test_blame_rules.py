"""Whom a refused value is blamed on (node/trainer/blame.py), without sockets: the producer, unless
the trainer's warmed-up scale vouches for the value and no check suspects the producer."""

from __future__ import annotations

import grpc
import pytest
import torch

from agora.node.trainer.blame import Blame, ProducerBlamed
from agora.node.trainer.routing import Roster, WorkerView
from agora.node.trainer.stage_client import InputRefused, ReplyScales
from agora.node.trainer.stats import TrainerStats
from agora.pipeline.codec import WireCodec

CODEC = WireCodec("fp32")


def _route() -> list[WorkerView]:
    return [WorkerView(f"s{stage}", f"127.0.0.1:{5000 + stage}", stage) for stage in range(3)]


def _blame(route: list[WorkerView], suspected: set[str]) -> Blame:
    roster = Roster(microbatch_size=1)
    roster.refresh(route)
    scales = ReplyScales(factor=8.0, warmup=4)
    for _ in range(8):  # the tail's input gradients, ten times inflated half the time: all ordinary to the scale
        scales.of(2, "input_grad").accept(10.0)
        scales.of(2, "input_grad").accept(1.0)
    return Blame(roster, TrainerStats(), scales, CODEC, clock=lambda: 100.0, suspected=suspected.__contains__)


@pytest.mark.parametrize("suspected, blamed", [(set(), "s1"), ({"s2"}, "s2")])
def test_a_refused_gradient_is_the_producers_failure_when_a_check_suspects_the_producer(suspected, blamed):
    """The body refuses the tail's gradient (ten times its own range). The trainer's scale learnt the
    tail's inflated values as ordinary (they were half of what it saw), so it vouches for them: the
    refuser is blamed, unless a check suspects the tail, whose failure it then is."""
    route = _route()
    _, body, tail = route
    blame = _blame(route, suspected)
    frame = CODEC.encode(torch.full((1, 4, 8), 10.0))
    refusal = InputRefused(grpc.StatusCode.INVALID_ARGUMENT, "output_grad far beyond this stage's range",
                           address=body.endpoint, method="Backward", field="output_grad")
    error = blame.refused_input(refusal, route, 1, frame, backward=True)
    assert (error.address, isinstance(error, ProducerBlamed)) == (
        (tail.endpoint, True) if blamed == "s2" else (body.endpoint, False))
    assert blame.roster.workers[blamed].failures > 0
    assert all(view.failures == 0 for peer, view in blame.roster.workers.items() if peer != blamed)
