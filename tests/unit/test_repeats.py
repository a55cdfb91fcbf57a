"""Repeat checks (node/trainer/repeats.py) on what tiny's three stages really send, without sockets.

The honest traffic is a real pipeline's (tests/helpers/reply_traffic.py) after a few global batches
of training: every frame kind of every stage is held to its worker's earlier replies, and no reply may
come near the tolerance; a replayed reply must be named on its first replay, and a microbatch sent
again (its own tokens) or one sharing a prefix with an earlier one never.
"""

from __future__ import annotations

import pytest
import torch

from agora.node.trainer.repeats import KEPT, MIN_POSITIONS, TOLERANCE, RepeatJudge, repeat_distance, sketch
from agora.pipeline.data import build_data
from reply_traffic import CONFIG, MICROBATCHES, WatchedTraining

pytestmark = pytest.mark.timeout(300)

TRAINED_STEPS = 6
MICROBATCH_COUNT = 24


def _frames(training: WatchedTraining, tokens: torch.Tensor, targets: torch.Tensor) -> dict[tuple[str, str], torch.Tensor]:
    """Every frame one honest route sends for `tokens`: (peer, kind) -> frame."""
    stages = training.pipeline.stages
    head_out = stages["h"](tokens)
    wire0 = head_out.detach().requires_grad_()
    body_out = stages["b0"](tokens, wire0)
    wire1 = body_out.detach().requires_grad_()
    loss = stages["t"](tokens, wire1, targets)
    (tail_grad,) = torch.autograd.grad(loss, [wire1])
    (body_grad,) = torch.autograd.grad(body_out, [wire0], tail_grad)
    return {("h", "output"): head_out.detach(), ("b0", "output"): body_out.detach(),
            ("t", "input_grad"): tail_grad, ("b0", "input_grad"): body_grad}


@pytest.fixture(scope="module")
def traffic() -> list[tuple[torch.Tensor, dict]]:
    """(tokens, frames) of MICROBATCH_COUNT honest microbatches, after TRAINED_STEPS global batches."""
    data, training = build_data(CONFIG), WatchedTraining(seed=0)
    training.train(TRAINED_STEPS, data)
    routes, step = [], 100
    while len(routes) < MICROBATCH_COUNT:
        for micro in data.train.unit(step).chunk(MICROBATCHES):
            routes.append((micro[:, :-1], _frames(training, micro[:, :-1], micro[:, 1:])))
        step += 1
    return routes[:MICROBATCH_COUNT]


def test_honest_replies_to_other_tokens_stand_far_beyond_the_tolerance(traffic):
    judge, closest = RepeatJudge(), {}
    for index, (tokens, frames) in enumerate(traffic):
        for (peer, kind), frame in frames.items():
            assert judge.observe(0, kind, peer, tokens, frame) is None, (peer, kind, index)
    directions = judge._directions
    for (peer, kind) in traffic[0][1]:
        sketches = [(tokens, sketch(frames[(peer, kind)], directions[frames[(peer, kind)].shape[-1]]))
                    for tokens, frames in traffic]
        distances = [repeat_distance(*sketches[i], *sketches[j]) for i in range(len(sketches))
                     for j in range(max(0, i - KEPT), i)]
        closest[(peer, kind)] = min(d for d in distances if d is not None)
    # Measured: the closest honest pairs are the body's outputs, at 0.22 of their size (22 tolerances);
    # the head's outputs 0.36, the gradients 1.1-1.3.
    assert min(closest.values()) > 10 * TOLERANCE, closest


@pytest.mark.parametrize("peer,kind", [("h", "output"), ("b0", "output"), ("t", "input_grad"), ("b0", "input_grad")])
def test_a_replayed_reply_is_named_on_its_first_replay(traffic, peer, kind):
    judge = RepeatJudge()
    for tokens, frames in traffic[:5]:
        assert judge.observe(1, kind, peer, tokens, frames[(peer, kind)]) is None
    tokens, _ = traffic[5]
    evidence = judge.observe(1, kind, peer, tokens, traffic[4][1][(peer, kind)])  # the previous reply again
    assert evidence is not None and evidence.peer == peer and evidence.feature == "repeated_reply"
    assert evidence.value == 0.0 and evidence.cusum >= MIN_POSITIONS
    assert "repeated one of its earlier replies" in evidence.describe()


def test_a_replay_with_noise_under_the_tolerance_is_named_and_one_past_it_is_not(traffic):
    (first, frames), (second, _) = traffic[0], traffic[1]
    frame = frames[("b0", "output")]
    rms = frame.square().mean().sqrt()
    for size, named in ((TOLERANCE / 10, True), (TOLERANCE * 10, False)):
        judge = RepeatJudge()
        judge.observe(1, "output", "b0", first, frame)
        replayed = frame + torch.randn(frame.shape, generator=torch.Generator().manual_seed(1)) * rms * size
        assert (judge.observe(1, "output", "b0", second, replayed) is not None) is named


def test_a_microbatch_sent_again_or_sharing_a_prefix_is_never_a_repeat(traffic):
    judge = RepeatJudge()
    tokens, frames = traffic[0]
    frame = frames[("h", "output")]
    assert judge.observe(0, "output", "h", tokens, frame) is None
    assert judge.observe(0, "output", "h", tokens.clone(), frame.clone()) is None  # rerun: the same tokens
    # Another microbatch sharing all but its last MIN_POSITIONS - 1 tokens of each row: too few to compare.
    shared = tokens.clone()
    shared[:, -(MIN_POSITIONS - 1):] = traffic[1][0][:, -(MIN_POSITIONS - 1):]
    if int((shared != tokens).sum()) < MIN_POSITIONS:
        assert judge.observe(0, "output", "h", shared, frame) is None


def test_frames_with_no_size_or_not_laid_out_by_token_are_not_compared(traffic):
    judge = RepeatJudge()
    (first, frames), (second, _) = traffic[0], traffic[1]
    zeros = torch.zeros_like(frames[("h", "output")])
    assert judge.observe(0, "output", "h", first, zeros) is None
    assert judge.observe(0, "output", "h", second, zeros) is None  # zeros are the verifier's
    assert judge.observe(0, "output", "h", first, torch.ones(3)) is None


def test_forgetting_a_worker_drops_what_was_kept(traffic):
    judge = RepeatJudge()
    (first, frames), (second, _) = traffic[0], traffic[1]
    frame = frames[("h", "output")]
    judge.observe(0, "output", "h", first, frame)
    judge.forget("h")
    assert judge.observe(0, "output", "h", second, frame) is None
