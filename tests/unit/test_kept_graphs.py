"""Kept forward graphs (node/replica/kept_graphs.py): the same bits as the recompute, only while valid,
bounded in count, dropped with their microbatch."""

from __future__ import annotations

import pytest
import torch

from agora.node.replica.compute import StageCompute
from agora.node.replica.stash import ForwardStash
from agora.pipeline.codec import WireCodec, encode_tokens
from agora.pipeline.config import PRESETS
from agora.protos.stage_adapter import AbortRequest, BackwardRequest, ForwardRequest, StepRequest

pytestmark = pytest.mark.timeout(120)

CONFIG = PRESETS["tiny"].with_stages(3)
CODEC = WireCodec("fp32", max_bytes=2**24)


def pipeline(keep_graphs: int, capacity: int = 8) -> list[StageCompute]:
    return [StageCompute(CONFIG, index, run_id="run", codec=CODEC, stash=ForwardStash(capacity, 600.0),
                         synchronous=True, keep_graphs=keep_graphs) for index in range(3)]


def tokens_and_targets(seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG.model.vocab_size, (2, 33), generator=generator)
    return encode_tokens(ids[:, :-1], CONFIG.model.vocab_size), encode_tokens(ids[:, 1:], CONFIG.model.vocab_size)


def forward(stages, microbatch_id: str, seed: int) -> list[bytes]:
    """Head and body forwards; the tail's forward-and-backward; the frames each sent."""
    tokens, targets = tokens_and_targets(seed)
    head = stages[0].forward(ForwardRequest("run", microbatch_id, 0, tokens))
    body = stages[1].forward(ForwardRequest("run", microbatch_id, 1, tokens, wire=head.wire))
    tail = stages[2].forward(ForwardRequest("run", microbatch_id, 2, tokens, wire=body.wire, targets=targets))
    return [head.wire, body.wire, tail.input_grad]


def backward(stages, microbatch_id: str, tail_grad: bytes) -> list[bytes]:
    body = stages[1].backward(BackwardRequest("run", microbatch_id, 1, tail_grad))
    head = stages[0].backward(BackwardRequest("run", microbatch_id, 0, body.input_grad))
    return [body.input_grad, head.input_grad]


def step(stages, number: int) -> None:
    for stage in stages:
        stage.step(StepRequest("run", stage.index, microbatches=2, step=number))


def test_kept_graphs_give_the_recomputes_bits_through_steps():
    recompute, kept = pipeline(0), pipeline(4)
    for number in range(3):
        frames = {}
        for name, stages in (("recompute", recompute), ("kept", kept)):
            sent = []
            for m in range(2):
                sent += forward(stages, f"s{number}m{m}", seed=10 * number + m)
            for m in range(2):
                sent += backward(stages, f"s{number}m{m}", sent[3 * m + 2])
            frames[name] = sent
        assert frames["kept"] == frames["recompute"]  # every frame, byte for byte
        for a, b in zip(recompute, kept):
            for p, q in zip(a.optimizer.parameters, b.optimizer.parameters):
                assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
        step(recompute, number)
        step(kept, number)
        for a, b in zip(recompute, kept):
            for p, q in zip(a.optimizer.parameters, b.optimizer.parameters):
                assert torch.equal(p, q)
    assert kept[0].kept.used == kept[1].kept.used == 6 and len(kept[0].kept) == 0
    assert kept[2].kept.used == 0  # the tail's backward runs inside its forward anyway


def test_a_graph_is_not_used_once_the_weights_changed():
    recompute, kept = pipeline(0), pipeline(4)
    results = []
    for stages in (recompute, kept):
        sent = forward(stages, "m", seed=3)
        for stage in stages[:2]:  # an averaging apply lands between forward and backward
            stage.weights_changing()
            with torch.no_grad():
                stage.optimizer.parameters[0].add_(0.01)
        results.append(backward(stages, "m", sent[2]))
    assert results[0] == results[1]  # both recomputed on the forward's (pinned) weights
    assert kept[0].kept.used == kept[1].kept.used == 0


def test_graphs_are_bounded_and_leave_with_their_microbatch():
    stages = pipeline(2, capacity=3)
    grads = [forward(stages, f"m{i}", seed=i)[2] for i in range(3)]
    assert len(stages[1].kept) == 2  # the third forward ran under no_grad and will recompute
    backward(stages, "m2", grads[2])
    backward(stages, "m0", grads[0])
    assert stages[1].kept.used == 1 and len(stages[1].kept) == 1
    stages[1].abort(AbortRequest("run", "m1", 1))
    assert len(stages[1].kept) == 0
    for i in range(3, 7):  # past the stash's capacity: evicted microbatches' graphs are forgotten
        forward(stages, f"m{i}", seed=i)
    assert len(stages[1].kept) <= 2 and all(m in stages[1].stash for m in stages[1].kept._graphs)
