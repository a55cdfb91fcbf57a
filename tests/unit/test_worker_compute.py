"""A worker's compute and stash without sockets: stepping rules, stale inputs, nothing half-applied."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agora.node.replica.compute import StageCompute
from agora.node.replica.request_frames import (
    ComputeError,
    ExtremeInput,
    InvalidRequest,
    PreconditionFailed,
    UnknownMicrobatch,
)
from agora.node.replica.stash import AlreadyStashed, ForwardStash
from agora.pipeline.codec import WireCodec, encode_tokens
from agora.pipeline.config import PRESETS
from agora.pipeline.wire_scale import WireScale
from agora.protos.stage_adapter import AbortRequest, BackwardRequest, ForwardRequest, StepRequest
from fake_clock import FakeClock

pytestmark = pytest.mark.timeout(60)

CONFIG = PRESETS["tiny"].with_stages(3)
CODEC = WireCodec("fp32", max_bytes=2**24)


def make_compute(index: int, *, synchronous: bool = True, local_batch: int | None = 4, clock=None,
                 capacity: int = 8, ttl_s: float = 60.0) -> StageCompute:
    stash = ForwardStash(capacity, ttl_s, clock=clock or FakeClock())
    return StageCompute(CONFIG, index, run_id="run", codec=CODEC, stash=stash, synchronous=synchronous,
                        local_batch=local_batch)


def batch(seed: int, size: int = 2, seq: int = 16):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.model.vocab_size, (size, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def forward_request(index: int, tokens, wire=None, targets=None, microbatch_id="m0",
                    evaluate: bool = False) -> ForwardRequest:
    vocab = CONFIG.model.vocab_size
    return ForwardRequest(run_id="run", microbatch_id=microbatch_id, stage=index, tokens=encode_tokens(tokens, vocab),
                          wire=CODEC.encode(wire) if wire is not None else b"",
                          targets=encode_tokens(targets, vocab) if targets is not None else b"", evaluate=evaluate)


def grad_request(index: int, grad, microbatch_id="m0") -> BackwardRequest:
    return BackwardRequest(run_id="run", microbatch_id=microbatch_id, stage=index, output_grad=CODEC.encode(grad))


def test_stash_evicts_oldest_beyond_capacity_and_expires_by_ttl():
    clock = FakeClock()
    stash = ForwardStash(2, ttl_s=10.0, clock=clock)
    assert stash.put("a", 1) == [] and stash.put("b", 2) == []
    assert stash.put("c", 3) == ["a"]
    assert "a" not in stash and stash.get("b") == 2
    clock.now = 5.0
    with pytest.raises(AlreadyStashed):
        stash.put("b", 20)  # a live key is never replaced
    assert stash.get("b") == 2
    clock.now = 10.0  # "b" and "c" are past their TTL: a key may be stored again once gone
    assert len(stash.values()) == 0 and stash.put("b", 20) == []
    assert stash.pop("b") == 20
    with pytest.raises(KeyError):
        stash.pop("b")


def test_asynchronous_worker_steps_when_its_local_batch_fills():
    head = make_compute(0, synchronous=False, local_batch=4)
    tokens, _ = batch(0)
    for i in range(2):
        reply = head.forward(forward_request(0, tokens, microbatch_id=f"m{i}"))
        out = CODEC.decode(reply.wire)
        head.backward(grad_request(0, torch.ones_like(out), microbatch_id=f"m{i}"))
        assert head.optimizer.steps == i  # 2 samples, then 4: the step comes with the second
    assert head.accumulated_samples == 0 and head.last_step.accumulated == 2
    with pytest.raises(PreconditionFailed, match="asynchronous"):
        head.step(StepRequest(run_id="run", stage=0, microbatches=2))


def test_step_barrier_is_idempotent_per_step_number():
    tail = make_compute(2)
    tokens, targets = batch(1)
    wire = torch.randn(2, 16, CONFIG.model.wire_dim)
    tail.forward(forward_request(2, tokens, wire, targets))
    first = tail.step(StepRequest(run_id="run", stage=2, microbatches=1, step=0))
    assert first.step == 1 and first.accumulated == 1
    assert tail.step(StepRequest(run_id="run", stage=2, microbatches=1, step=0)) == first  # a retry
    assert tail.optimizer.steps == 1
    with pytest.raises(PreconditionFailed, match="step 5"):
        tail.step(StepRequest(run_id="run", stage=2, microbatches=1, step=5))
    with pytest.raises(InvalidRequest, match="microbatches"):
        tail.step(StepRequest(run_id="run", stage=2, microbatches=0))


def test_backward_after_ttl_is_unknown_and_bad_grad_keeps_the_stash():
    clock = FakeClock()
    body = make_compute(1, clock=clock, ttl_s=30.0)
    tokens, _ = batch(2)
    wire = torch.randn(2, 16, CONFIG.model.wire_dim)
    body.forward(forward_request(1, tokens, wire, microbatch_id="a"))
    body.forward(forward_request(1, tokens, wire, microbatch_id="b"))
    with pytest.raises(InvalidRequest, match="shape mismatch"):
        body.backward(grad_request(1, torch.ones(2, 15, CONFIG.model.wire_dim), microbatch_id="a"))
    body.backward(grad_request(1, torch.ones(2, 16, CONFIG.model.wire_dim), microbatch_id="a"))  # still stashed
    clock.now = 31.0
    with pytest.raises(UnknownMicrobatch, match="'b'.*rerun"):
        body.backward(grad_request(1, torch.ones(2, 16, CONFIG.model.wire_dim), microbatch_id="b"))


def test_non_finite_loss_fails_without_accumulating_anything():
    tail = make_compute(2)
    with torch.no_grad():
        tail.stage.lm_head.weight.fill_(float("inf"))
    tokens, targets = batch(3)
    with pytest.raises(ComputeError, match="non-finite loss"):
        tail.forward(forward_request(2, tokens, torch.randn(2, 16, CONFIG.model.wire_dim), targets))
    assert tail.accumulated_microbatches == 0
    assert all(p.grad is None for p in tail.optimizer.parameters)


def test_values_the_previous_stage_produced_that_overflow_a_stage_are_refused_naming_that_frame():
    """A wire at float32's limit (finite: the codec takes it) overflows a body's output and a tail's loss.
    The refusal names the frame another worker computed (`ExtremeInput.field`), so a trainer can blame
    that worker; nothing is stashed or accumulated. (An output gradient that overflows the head:
    tests/unit/test_control_messages.py.)"""
    tokens, targets = batch(6)
    limit = torch.full((2, 16, CONFIG.model.wire_dim), 3.4e38)
    body, tail = make_compute(1), make_compute(2)
    for compute, request in ((body, forward_request(1, tokens, limit)), (tail, forward_request(2, tokens, limit, targets))):
        with pytest.raises(ExtremeInput, match="the request's values overflowed it") as refused:
            compute.forward(request)
        assert refused.value.field == "wire"
        assert (len(compute.stash), compute.accumulated_microbatches) == (0, 0)


def test_an_output_gradient_far_beyond_the_accepted_ones_is_refused_after_the_warm_up_and_nothing_applied():
    """A body bounds its output gradients by the ones it accepted (warm-up 3, factor 100): before the
    warm-up anything finite the body can take is taken (one that overflows it fails after the bound and
    is never counted in), after it a gradient 1e4 times the usual is an `ExtremeInput`
    naming output_grad. The stashed input is kept (the owner may send a sane gradient), nothing is
    accumulated, the refused value never enters the scale, and a gradient 50 times the usual (a
    loss spike) is still taken."""
    stash = ForwardStash(8, 60.0, clock=FakeClock())
    body = StageCompute(CONFIG, 1, run_id="run", codec=CODEC, stash=stash, synchronous=True, local_batch=None,
                        output_grad_scale=WireScale(factor=100.0, warmup=3))
    tokens, _ = batch(7)
    usual = torch.randn(2, 16, CONFIG.model.wire_dim, generator=torch.Generator().manual_seed(7)) * 1e-3

    def forward(microbatch_id: str) -> None:
        body.forward(forward_request(1, tokens, torch.randn(2, 16, CONFIG.model.wire_dim) * 0.1,
                                     microbatch_id=microbatch_id))

    forward("overflow")  # a gradient that fails after the bound (it overflows the body) is not counted in
    with pytest.raises(ExtremeInput, match="output_grad"):
        body.backward(grad_request(1, torch.full_like(usual, 3.4e38), microbatch_id="overflow"))
    assert body.output_grad_scale.accepted == 0
    forward("early")
    body.backward(grad_request(1, usual * 1e4, microbatch_id="early"))  # nothing known yet: taken
    for index in range(3):
        forward(f"m{index}")
        body.backward(grad_request(1, usual, microbatch_id=f"m{index}"))
    forward("huge")
    accumulated, scale = body.accumulated_microbatches, body.output_grad_scale.scale
    with pytest.raises(ExtremeInput, match="output_grad: values up to .*nothing applied, the stashed input is kept") \
            as refused:
        body.backward(grad_request(1, usual * 1e4, microbatch_id="huge"))
    assert refused.value.field == "output_grad" and "huge" in body.stash
    assert (body.accumulated_microbatches, body.output_grad_scale.scale) == (accumulated, scale)
    body.backward(grad_request(1, usual * 50, microbatch_id="huge"))  # the same microbatch, a spike: taken
    assert body.accumulated_microbatches == accumulated + 1 and body.output_grad_scale.refused == 1


def test_misaddressed_and_malformed_inputs_are_invalid():
    head = make_compute(0)
    tokens, targets = batch(4)
    with pytest.raises(InvalidRequest, match="takes token ids only"):
        head.forward(forward_request(0, tokens, wire=torch.zeros(2, 16, CONFIG.model.wire_dim)))
    with pytest.raises(InvalidRequest, match="only the tail takes targets"):
        head.forward(forward_request(0, tokens, targets=targets))
    with pytest.raises(InvalidRequest, match="stage 1 reached a worker of stage 0"):
        head.forward(forward_request(1, tokens))
    long_tokens = torch.zeros(1, CONFIG.model.max_seq_len + 1, dtype=torch.long)
    with pytest.raises(InvalidRequest, match="max_seq_len"):
        head.forward(forward_request(0, long_tokens))


def test_single_stage_pipeline_is_head_and_tail_at_once():
    config = PRESETS["tiny"]
    stash = ForwardStash(4, 60.0, clock=FakeClock())
    full = StageCompute(config, 0, run_id="run", codec=CODEC, stash=stash, synchronous=True, local_batch=2)
    tokens, targets = batch(5)
    reply = full.forward(forward_request(0, tokens, targets=targets))
    assert reply.loss > 0 and reply.input_grad == b"" and reply.wire == b""
    assert full.accumulated_microbatches == 1 and len(stash) == 0


def test_abort_takes_back_exactly_what_an_abandoned_microbatch_added():
    """An abandoned route leaves nothing half-applied: gradients return to what they were."""
    import torch

    from agora.node.replica.compute import StageCompute
    from agora.node.replica.stash import ForwardStash
    from agora.pipeline.codec import WireCodec, encode_tokens
    from agora.pipeline.config import PRESETS
    from agora.protos.stage_adapter import AbortRequest, ForwardRequest

    config = PRESETS["tiny"].with_stages(2)
    tail = StageCompute(config, 1, run_id="r", codec=WireCodec(), stash=ForwardStash(8, 60.0),
                        synchronous=True, local_batch=100)
    codec = WireCodec()
    generator = torch.Generator().manual_seed(0)

    def request(name):
        tokens = torch.randint(0, 256, (2, 16), generator=generator)
        wire = torch.randn(2, 16, config.model.wire_dim, generator=generator) * 0.1
        return ForwardRequest(run_id="r", microbatch_id=name, stage=1, tokens=encode_tokens(tokens, 256),
                              wire=codec.encode(wire), targets=encode_tokens(tokens, 256))

    tail.forward(request("kept"))
    before = [p.grad.clone() for p in tail.optimizer.parameters]
    tail.forward(request("abandoned"))
    reply = tail.abort(AbortRequest(run_id="r", microbatch_id="abandoned", stage=1))
    assert reply.reverted and reply.outcome == "reverted"
    for grad, expected in zip((p.grad for p in tail.optimizer.parameters), before):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
    assert tail.accumulated_microbatches == 1
    assert tail.abort(AbortRequest(run_id="r", microbatch_id="abandoned", stage=1)).outcome == "unknown"
    tail._step(1)
    assert tail.abort(AbortRequest(run_id="r", microbatch_id="kept", stage=1)).outcome == "stepped"


def _report(compute: StageCompute, batch_id: int, microbatches: int = 2, replicas: int = 1):
    return compute.step(StepRequest(run_id="run", stage=compute.index, microbatches=microbatches,
                                    completed_batch=batch_id, replicas=replicas))


def test_asynchronous_worker_steps_once_per_reported_global_batch():
    head = make_compute(0, synchronous=False, local_batch=None)
    tokens, _ = batch(7)
    for i in range(2):
        out = CODEC.decode(head.forward(forward_request(0, tokens, microbatch_id=f"m{i}")).wire)
        head.backward(grad_request(0, torch.ones_like(out), microbatch_id=f"m{i}"))
    assert head.optimizer.steps == 0  # no report yet: it waits for the stage's shared epoch
    first = _report(head, 0)
    assert first.step == 1 and first.accumulated == 2 and first.grad_norm > 0
    assert _report(head, 0) == first and head.optimizer.steps == 1  # a second report of batch 0 is not counted
    weights = [p.detach().clone() for p in head.optimizer.parameters]
    empty = _report(head, 1)  # nothing routed here during batch 1: the count moves, the weights do not
    assert (empty.step, empty.accumulated) == (2, 0)
    assert all(torch.equal(p, w) for p, w in zip(head.optimizer.parameters, weights))
    with pytest.raises(PreconditionFailed, match="asynchronous"):
        head.step(StepRequest(run_id="run", stage=0, microbatches=2))
    with pytest.raises(InvalidRequest, match="replicas"):
        _report(head, 2, replicas=0)
    with pytest.raises(PreconditionFailed, match="synchronous mode"):
        _report(make_compute(0, synchronous=True), 0)
    with pytest.raises(PreconditionFailed, match="--local-batch"):
        _report(make_compute(0, synchronous=False, local_batch=4), 0)


def test_a_replica_joining_mid_run_adopts_the_stage_epoch_from_the_reported_batch():
    from agora.node.replica.compute import EPOCH_CATCH_UP_BATCHES
    from agora.pipeline.optim import lr_at

    joiner = make_compute(0, synchronous=False, local_batch=None)
    late = EPOCH_CATCH_UP_BATCHES + 500  # the swarm is 500 batches further than any reordering
    reply = _report(joiner, late)
    assert reply.step == late + 1 and reply.lr == pytest.approx(lr_at(late, joiner.optimizer.config))
    assert _report(joiner, late - 3).step == late + 2  # a batch reported out of order still counts once
    assert _report(joiner, late + 1).step == late + 3  # and small gaps are not jumps


def test_step_hooks_run_after_every_step_and_a_failing_hook_fails_no_step(caplog):
    head = make_compute(0, synchronous=False, local_batch=None)
    seen = []

    def broken(compute):
        raise RuntimeError("a bug in a hook")

    head.step_hooks += [lambda compute: seen.append(compute.optimizer.steps), broken]
    tokens, _ = batch(7)
    out = CODEC.decode(head.forward(forward_request(0, tokens)).wire)
    head.backward(grad_request(0, torch.ones_like(out)))
    assert _report(head, 0).step == 1  # a step with an update
    assert _report(head, 1).step == 2  # and one without (nothing accumulated)
    assert _report(head, 1).step == 2  # a repeated report is no step: no hook
    assert seen == [1, 2]
    assert sum("step hook" in r.getMessage() for r in caplog.records) == 2


def _pipeline_microbatch(computes: list[StageCompute], microbatch_id: str, sample: torch.Tensor) -> float:
    """One microbatch through one replica per stage, as the trainer drives it (without sockets)."""
    tokens, targets = sample[:, :-1], sample[:, 1:]
    wire = None
    for compute in computes[:-1]:
        wire = CODEC.decode(compute.forward(forward_request(compute.index, tokens, wire,
                                                            microbatch_id=microbatch_id)).wire)
    reply = computes[-1].forward(forward_request(computes[-1].index, tokens, wire, targets, microbatch_id))
    grad = CODEC.decode(reply.input_grad)
    for compute in reversed(computes[:-1]):
        back = compute.backward(grad_request(compute.index, grad, microbatch_id))
        grad = CODEC.decode(back.input_grad) if back.input_grad else None
    return reply.loss


def test_shared_epoch_gives_every_replica_the_centralized_step_count_and_schedule():
    """One replica per stage, batches one after another: exactly the centralized run. Two replicas
    per stage, each taking half of every batch: both step once per batch, at the run's lr."""
    from agora.pipeline.centralized import CentralizedTrainer
    from agora.pipeline.data import build_data
    from agora.pipeline.optim import lr_at

    data = build_data(CONFIG)
    steps = 3
    expected = [r.loss for r in CentralizedTrainer(CONFIG, data).run(steps)]
    n_micro = CONFIG.train.microbatches
    for replicas in (1, 2):
        routes = [[make_compute(i, synchronous=False, local_batch=None) for i in range(3)] for _ in range(replicas)]
        losses = []
        for unit in range(steps):
            chunks = data.train.unit(unit).chunk(n_micro)
            losses.append(sum(_pipeline_microbatch(routes[m % replicas], f"u{unit}m{m}", chunk)
                              for m, chunk in enumerate(chunks)) / n_micro)
            for compute in (c for route in routes for c in route):
                reply = _report(compute, unit, n_micro, replicas)
                assert reply.accumulated == n_micro // replicas and reply.lr == pytest.approx(lr_at(unit, CONFIG.optim))
        assert all(c.optimizer.steps == steps for route in routes for c in route)
        if replicas == 1:
            assert losses == pytest.approx(expected, abs=1e-5)


def test_a_replica_divides_its_gradient_by_its_expected_share_of_the_batch():
    """Two replicas of a tail, one global batch of 4 microbatches routed 3 + 1: the mean of their
    gradients is the batch's mean gradient (the one train-local steps on), so the replica that got
    one microbatch steps on half of that microbatch's gradient, not on a whole mean of its own."""
    tokens, targets = batch(11)
    wire = torch.randn(2, 16, CONFIG.model.wire_dim, generator=torch.Generator().manual_seed(1)) * 0.1
    requests = [forward_request(2, tokens, wire * (1 + i), targets, f"m{i}") for i in range(4)]
    whole = make_compute(2, synchronous=True)
    for request in requests:
        whole.forward(request)
    expected = [p.grad / 4 for p in whole.optimizer.parameters]
    a, b = make_compute(2, synchronous=False, local_batch=None), make_compute(2, synchronous=False, local_batch=None)
    for request in requests[:3]:
        a.forward(request)
    b.forward(requests[3])
    divided = []
    for replica in (a, b):
        original = replica.optimizer.step
        replica.optimizer.step = lambda n, r=replica, o=original: (  # capture the divided gradient
            divided.append([p.grad / n for p in r.optimizer.parameters]), o(n))[1]
        _report(replica, 0, microbatches=4, replicas=2)
    for got_a, got_b, want in zip(*divided, expected):
        torch.testing.assert_close(got_a + got_b, 2 * want, rtol=1e-5, atol=1e-7)


def _reference_gradients(stage, tokens, wire, output_grad):
    wire = wire.clone().requires_grad_(True)
    params = [p for p in stage.parameters() if p.requires_grad]
    grads = torch.autograd.grad(stage(tokens, wire), [wire] + params, grad_outputs=output_grad)
    return grads[0], grads[1:]


def _body_microbatch(compute, microbatch_id, seed):
    tokens, _ = batch(seed)
    wire = torch.randn(*tokens.shape, CONFIG.model.wire_dim, generator=torch.Generator().manual_seed(seed))
    reply = compute.forward(forward_request(1, tokens, wire=wire, microbatch_id=microbatch_id))
    return tokens, wire, torch.randn_like(CODEC.decode(reply.wire))


def _perturb(compute):
    """A write to the weights (an optimizer step or an averaging delta would do the same)."""
    compute.weights_changing()
    with torch.no_grad():
        for p in compute.optimizer.parameters:
            p.add_(0.05 * torch.randn_like(p))


@pytest.mark.parametrize("pinned", [2, 0])
def test_backward_uses_the_weights_its_forward_ran_on(pinned):
    import copy

    torch.manual_seed(0)
    body = make_compute(1, synchronous=False, local_batch=None)
    body.pinned_versions = pinned
    tokens, wire, output_grad = _body_microbatch(body, "m0", seed=1)
    at_forward = copy.deepcopy(body.stage)
    _perturb(body)
    assert body.pinned_weight_copies == (1 if pinned else 0)
    reply = body.backward(grad_request(1, output_grad, microbatch_id="m0"))
    assert reply.weights_version == (0 if pinned else 1)  # the weights its gradient was computed on

    reference = at_forward if pinned else body.stage
    wire_grad, param_grads = _reference_gradients(reference, tokens, wire, output_grad)
    torch.testing.assert_close(CODEC.decode(reply.input_grad), wire_grad)
    for param, expected in zip(body.optimizer.parameters, param_grads):
        torch.testing.assert_close(param.grad, expected)
    if pinned:  # and the current weights would have given another gradient: the pin mattered
        _, current = _reference_gradients(body.stage, tokens, wire, output_grad)
        assert any(not torch.allclose(a, b) for a, b in zip(current, param_grads))
    assert body.pinned_weight_copies == 0  # no pending backward needs the old weights any more
    _report(body, 0, microbatches=1)
    assert body.weights_version == 2


def test_every_forward_names_the_weights_it_ran_on_and_a_write_to_them_changes_the_name():
    tail = make_compute(2, synchronous=False, local_batch=None)
    tokens, targets = batch(1)
    wire = torch.randn(*tokens.shape, CONFIG.model.wire_dim, generator=torch.Generator().manual_seed(1))
    held_out = forward_request(2, tokens, wire=wire, targets=targets, microbatch_id="e0", evaluate=True)
    before = tail.forward(held_out)
    trained = tail.forward(forward_request(2, tokens, wire=wire, targets=targets, microbatch_id="m0"))
    assert before.weights_version == trained.weights_version == tail.weights_version
    _perturb(tail)  # an averaging round's write: the optimizer step count stays, the weights' name does not
    after = tail.forward(held_out)
    assert after.step == before.step and after.weights_version == before.weights_version + 1


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_a_full_precision_held_out_forward_of_a_bf16_worker_is_computed_in_float32_when_its_weights_are(weights):
    # A gradient check's probes differ from each other by about 1e-3 of the input: bf16 autocast, or
    # a bf16 reply frame, would round that difference away (node/trainer/gradient_checks.py).
    from agora.pipeline.runtime import Runtime

    torch.manual_seed(0)
    stash = ForwardStash(8, 60.0, clock=FakeClock())
    body = StageCompute(CONFIG, 1, run_id="run", codec=WireCodec("bf16"), stash=stash, synchronous=False,
                        runtime=Runtime(dtype="bf16", weights=weights))
    tokens, _ = batch(1)
    wire = torch.randn(*tokens.shape, CONFIG.model.wire_dim, generator=torch.Generator().manual_seed(1))
    request = forward_request(1, tokens, wire=wire, microbatch_id="e0", evaluate=True)
    usual = body.forward(request)
    precise = body.forward(dataclasses.replace(request, full_precision=True))
    assert not usual.full_precision and precise.full_precision == (weights == "fp32")
    if weights == "fp32":
        with torch.no_grad():
            expected = body.stage(tokens, wire)  # float32 throughout (the request's wire is fp32)
        torch.testing.assert_close(WireCodec("fp32").decode(precise.wire), expected, rtol=1e-6, atol=1e-6)
        assert len(precise.wire) > len(usual.wire)  # fp32 payload, where the worker's wire is bf16
    else:
        assert precise.wire == usual.wire


def test_pinned_weights_are_bounded_and_the_oldest_falls_back_to_current_weights():
    import copy

    torch.manual_seed(0)
    body = make_compute(1, synchronous=False, local_batch=None)
    body.pinned_versions = 1
    first = _body_microbatch(body, "m0", seed=1)
    _perturb(body)
    second = _body_microbatch(body, "m1", seed=2)
    at_second = copy.deepcopy(body.stage)
    _perturb(body)
    assert body.pinned_weight_copies == 1  # version 0 was dropped for version 1
    assert body.backward(grad_request(1, first[2], microbatch_id="m0")).weights_version == 2
    _, on_current = _reference_gradients(body.stage, *first)
    for param, expected in zip(body.optimizer.parameters, on_current):
        torch.testing.assert_close(param.grad, expected)
    body.optimizer.zero_grad()
    assert body.backward(grad_request(1, second[2], microbatch_id="m1")).weights_version == 1
    _, on_pinned = _reference_gradients(at_second, *second)
    for param, expected in zip(body.optimizer.parameters, on_pinned):
        torch.testing.assert_close(param.grad, expected)
    _report(body, 0, microbatches=2)
    assert body.pinned_weight_copies == 0


def test_abort_after_a_weights_change_takes_back_exactly_the_gradient_it_added():
    torch.manual_seed(0)
    body = make_compute(1, synchronous=False, local_batch=None)
    _, _, output_grad = _body_microbatch(body, "m0", seed=1)
    _body_microbatch(body, "m1", seed=2)  # still in flight: its backward needs these weights
    body.backward(grad_request(1, output_grad, microbatch_id="m0"))
    added = [p.grad.clone() for p in body.optimizer.parameters]
    _perturb(body)  # an averaging delta lands before the trainer abandons m0's route
    assert body.pinned_weight_copies == 1
    reply = body.abort(AbortRequest(run_id="run", microbatch_id="m0", stage=1))
    assert reply.reverted
    for param, grad in zip(body.optimizer.parameters, added):
        assert param.grad.abs().max() <= 1e-6 * max(1.0, grad.abs().max())


def test_aborting_a_forward_releases_the_weights_pinned_for_it():
    body = make_compute(1, synchronous=False, local_batch=None)
    _body_microbatch(body, "m0", seed=1)
    _perturb(body)
    assert body.pinned_weight_copies == 1
    assert body.abort(AbortRequest(run_id="run", microbatch_id="m0", stage=1)).outcome == "dropped"
    assert body.pinned_weight_copies == 0


def test_a_worker_applies_a_units_microbatch_once_whoever_runs_it_again():
    """A reclaimed unit's microbatch (same work key, a new attempt's id) is computed, so the stages
    around it can go on, but its gradient is not added a second time, not even after a step; an
    attempt whose gradient was taken back (Abort) leaves the key free for the next one."""
    from dataclasses import replace

    from agora.node.replica.work_ledger import MAX_WORK_KEY_CHARS

    head, tail = make_compute(0), make_compute(2)
    tokens, targets = batch(1)
    wire = torch.randn(2, 16, CONFIG.model.wire_dim, generator=torch.Generator().manual_seed(2)) * 0.1

    def tail_forward(microbatch_id, key="u7m0"):
        return tail.forward(replace(forward_request(2, tokens, wire, targets, microbatch_id), work_key=key))

    first = tail_forward("u7m0.a0.x")
    applied = [p.grad.clone() for p in tail.optimizer.parameters]
    again = tail_forward("u7m0.a0.y")  # the unit reclaimed by another trainer
    assert not first.repeat and again.repeat and again.loss == pytest.approx(first.loss)
    assert again.input_grad == first.input_grad  # the stage before it still gets its gradient
    assert tail.accumulated_microbatches == 1 and tail.work.repeats == 1
    for grad, expected in zip((p.grad for p in tail.optimizer.parameters), applied):
        assert torch.equal(grad, expected)
    tail._step(1)
    assert tail_forward("u7m0.a1.z").repeat and tail.accumulated_microbatches == 0  # across steps too
    assert not tail_forward("u7m1.a0.w", key="u7m1").repeat  # another microbatch of the unit is new work
    assert not tail_forward("noise", key="").repeat and not tail_forward("noise2", key="").repeat  # no key

    head.forward(replace(forward_request(0, tokens, microbatch_id="u3m0.a0.p"), work_key="u3m0"))
    grad = torch.ones(2, 16, CONFIG.model.wire_dim)
    assert not head.backward(grad_request(0, grad, "u3m0.a0.p")).repeat
    assert head.abort(AbortRequest(run_id="run", microbatch_id="u3m0.a0.p", stage=0)).reverted
    head.forward(replace(forward_request(0, tokens, microbatch_id="u3m0.a1.q"), work_key="u3m0"))
    assert not head.backward(grad_request(0, grad, "u3m0.a1.q")).repeat  # the aborted attempt left no trace
    head.forward(replace(forward_request(0, tokens, microbatch_id="u3m0.a2.r"), work_key="u3m0"))
    assert head.backward(grad_request(0, grad, "u3m0.a2.r")).repeat and head.accumulated_microbatches == 1

    with pytest.raises(InvalidRequest, match="work_key"):
        tail_forward("long", key="k" * (MAX_WORK_KEY_CHARS + 1))


def test_a_checkpoint_keeps_the_work_its_weights_hold_and_a_resumed_worker_does_not_add_it_twice(tmp_path):
    """The ledger goes into the checkpoint with the weights: keys whose gradient was stepped in,
    not those still accumulating, so after a restart a reclaimed unit that the saved weights hold is
    a repeat and one whose gradient was lost with the process is applied again."""
    from dataclasses import replace

    from agora.node.replica.checkpoints import checkpoint_snapshot, restore_stage
    from agora.pipeline.checkpoint import save_checkpoint
    from agora.pipeline.config import ConfigError

    tokens, targets = batch(1)
    wire = torch.randn(2, 16, CONFIG.model.wire_dim, generator=torch.Generator().manual_seed(2)) * 0.1

    def tail_forward(compute, microbatch_id, key):
        return compute.forward(replace(forward_request(2, tokens, wire, targets, microbatch_id), work_key=key))

    tail = make_compute(2)
    tail_forward(tail, "u1m0.a0.x", "u1m0")
    tail._step(1)
    tail_forward(tail, "u2m0.a0.y", "u2m0")  # accumulating when the snapshot is taken
    state = checkpoint_snapshot(tail)
    assert tail.work.keys() == ["u1m0", "u2m0"] and state.work == ["u1m0"]
    save_checkpoint(tmp_path / "ok", tail.optimizer.steps, CONFIG, [state])

    fresh = make_compute(2)
    assert restore_stage(fresh, tmp_path / "ok", CONFIG)[0] == 1
    assert fresh.work.keys() == ["u1m0"]
    assert tail_forward(fresh, "u1m0.a1.z", "u1m0").repeat  # the saved weights hold it
    assert not tail_forward(fresh, "u2m0.a1.w", "u2m0").repeat  # its gradient died with the process

    save_checkpoint(tmp_path / "old", 1, CONFIG, [replace(state, work=None)])  # written before the ledger was saved
    older = make_compute(2)
    restore_stage(older, tmp_path / "old", CONFIG)
    assert older.work.keys() == []
    save_checkpoint(tmp_path / "bad", 1, CONFIG, [replace(state, work=["u1m0", 7])])
    broken = make_compute(2)
    before = [p.detach().clone() for p in broken.stage.parameters()]
    with pytest.raises(ConfigError, match="work keys: expected a list of strings"):
        restore_stage(broken, tmp_path / "bad", CONFIG)
    assert broken.work.keys() == [] and broken.optimizer.steps == 0  # a refused checkpoint changes nothing
    assert all(torch.equal(a, b) for a, b in zip(broken.stage.parameters(), before))
