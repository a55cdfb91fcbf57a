"""Gradient checks' pure parts (node/trainer/gradient_checks.py): the ratio and whom it names.

The ratio is computed on tiny's real stages (a body and a tail at initialisation, float32, on the
real codec): an honest gradient's stands at 1, a sign flip's at -1, a gradient scaled by ten at
0.1, noise at the gradient's scale about 0.5; the wire's own encoding (bf16) does not move an
honest ratio, since the probes go in fp32 around the frame the worker decoded.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
import torch

from agora.monitor.metrics import sample_value
from agora.node.trainer.gradient_checks import (
    BAND, FAILURES, OFFSET_TOLERANCE, RECENT, TOLERANCE, GradientChecks, GradientJudge, Probe, checkable,
    gradient_ratio, in_band, probe_inputs, replay_distance, replay_measure, replay_offset, tail_ratio,
)
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.stats import TrainerStats
from agora.pipeline.codec import WireCodec
from agora.pipeline.config import PRESETS
from agora.pipeline.stages import build_stage

pytestmark = pytest.mark.timeout(120)

CONFIG = PRESETS["tiny"].with_stages(3)
LIES = {"honest": lambda g: g, "sign": lambda g: -g, "x10": lambda g: 10 * g, "x0.1": lambda g: g / 10,
        "noise": lambda g: g + torch.randn_like(g) * g.square().mean().sqrt()}


def _route(wire_dtype: str):
    """A body and a tail of tiny, a microbatch through them, every frame through the real codec: the
    body's input wire, the output gradient the trainer sent it, its input gradient, the tail's."""
    torch.manual_seed(0)
    codec = WireCodec(wire_dtype)
    body, tail = build_stage(CONFIG.model, 1), build_stage(CONFIG.model, 2)
    tokens = torch.randint(0, CONFIG.model.vocab_size, (2, 32))
    targets = torch.randint(0, CONFIG.model.vocab_size, (2, 32))
    body_in = codec.decode(codec.encode(build_stage(CONFIG.model, 0)(tokens).detach()))
    leaf = body_in.clone().requires_grad_(True)
    output = body(tokens, leaf)
    tail_in = codec.decode(codec.encode(output.detach())).requires_grad_(True)
    tail_grad, = torch.autograd.grad(tail(tokens, tail_in, targets), tail_in)
    tail_grad = codec.decode(codec.encode(tail_grad))
    body_grad, = torch.autograd.grad(output, leaf, tail_grad)
    return body, tail, tokens, targets, body_in, tail_in.detach(), tail_grad, codec.decode(codec.encode(body_grad))


def _body_ratio(body, tokens, wire, output_grad, input_grad) -> float:
    plus, minus, step = probe_inputs(wire, input_grad)
    fp32 = WireCodec("fp32")
    with torch.no_grad():
        answers = [body(tokens, fp32.decode(fp32.encode(probe))) for probe in (plus, minus)]
    return gradient_ratio(output_grad, *answers, step, float(input_grad.norm()))


def _tail_ratio(tail, tokens, targets, wire, input_grad) -> float:
    plus, minus, step = probe_inputs(wire, input_grad)
    with torch.no_grad():
        losses = [float(tail(tokens, probe, targets)) for probe in (plus, minus)]
    return tail_ratio(*losses, step, float(input_grad.norm()))


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16"])
def test_the_ratio_tells_an_honest_gradient_from_a_sign_flip_a_scale_and_noise(wire_dtype):
    body, tail, tokens, targets, body_in, tail_in, tail_grad, body_grad = _route(wire_dtype)
    expected = {"honest": 1.0, "sign": -1.0, "x10": 0.1, "x0.1": 10.0, "noise": 0.5}
    for lie, transform in LIES.items():
        torch.manual_seed(1)
        ratios = (_body_ratio(body, tokens, body_in, tail_grad, transform(body_grad)),
                  _tail_ratio(tail, tokens, targets, tail_in, transform(tail_grad)))
        for ratio in ratios:
            tolerance = 0.01 if lie != "noise" else 0.15
            assert ratio == pytest.approx(expected[lie], rel=tolerance), (lie, ratios)
            assert in_band(ratio) == (lie == "honest"), (lie, ratio)


def test_the_band_refuses_a_wrong_sign_zero_and_non_finite_ratios():
    assert in_band(1.0) and in_band(1 / BAND) and in_band(BAND)
    for ratio in (-1.0, 0.0, float("nan"), float("inf"), 0.5, 2.0):
        assert not in_band(ratio), ratio


def test_a_worker_is_flagged_at_its_second_failure_among_its_recent_checks_and_once():
    judge = GradientJudge()
    assert not judge.judge(2, "liar", 0.6).in_band  # out of band, not decisively
    for _ in range(FAILURES - 2):
        assert judge.judge(2, "liar", 0.6).flagged is None
    assert judge.judge(2, "liar", 1.5).flagged is not None
    assert all(judge.judge(2, "liar", -1.0).flagged is None for _ in range(3))  # flagged once
    assert judge.flagged == {"liar"}


@pytest.mark.parametrize("ratio", [-1.0, 0.0, 0.3, 3.0, float("nan")])
def test_even_a_far_failure_needs_a_second_one(ratio):
    # An honest tail checked on every reply once measured r = -0.205 beside a 1000-fold gradient
    # spike: one failure, however far, is confirmed by the next reply's check before anyone is named.
    judge = GradientJudge()
    assert judge.judge(2, "w", ratio).flagged is None
    assert judge.judge(2, "w", 1.0).flagged is None  # cleared: an honest glitch
    evidence = judge.judge(2, "w", ratio).flagged
    assert evidence is not None and evidence.cusum == 2 and evidence.replies == 3


def test_a_failed_check_puts_the_worker_on_probation_its_next_replies_checked_credits_free_or_not():
    _, tail, tokens, targets, _, tail_in, tail_grad, _ = _route("fp32")
    checks = GradientChecks(0.05, TrainerStats(), flag=lambda evidence: None, rng=random.Random(0))
    worker = WorkerView("w", "a:1", 2)
    worker.granted_credits, worker.in_flight = 2, 2  # no credit free

    async def lying(view, probe_id, tokens, frame, targets):  # the probes answer as if the gradient were flipped
        with torch.no_grad():
            loss = float(tail(tokens, checks.probe_codec.decode(frame), targets))
        return SimpleNamespace(loss=-loss, weights_version=0, compute_s=0.0, full_precision=True)

    async def check():
        checks.launch(worker, worker, "m0", Probe(tail_in, tail_grad, None, tokens, targets, 0), lying)
        await checks.drain()
    asyncio.run(check())
    assert checks.judge.flagged == set() and checks.suspected("w")
    assert checks.due("w") and checks.checker(worker, [worker], 0.0) is worker

    async def elsewhere(view, probe_id, tokens, frame, targets):  # answered on other weights: no verdict
        return SimpleNamespace(loss=1.0, weights_version=1, compute_s=0.0, full_precision=True)

    async def unjudged():
        checks.launch(worker, worker, "m1", Probe(tail_in, tail_grad, None, tokens, targets, 0), elsewhere)
        await checks.drain()
    asyncio.run(unjudged())
    assert checks.due("w") and checks.checker(worker, [worker], 0.0) is worker  # the confirmation stays due
    assert checks.suspected("w")  # what its replies fed others is not held against them meanwhile

    async def honest(view, probe_id, tokens, frame, targets):
        with torch.no_grad():
            loss = float(tail(tokens, checks.probe_codec.decode(frame), targets))
        return SimpleNamespace(loss=loss, weights_version=0, compute_s=0.0, full_precision=True)

    async def cleared():
        checks.launch(worker, worker, "m2", Probe(tail_in, tail_grad, None, tokens, targets, 0), honest)
        await checks.drain()
    for passed in range(1, RECENT + 1):  # probation: its next RECENT replies judged are all checked
        asyncio.run(cleared())  # the check just sent passes
        if passed < RECENT:
            assert checks.suspected("w") and checks.due("w") and checks.checker(worker, [worker], 0.0) is worker
    assert not checks.suspected("w") and checks.judge.flagged == set()


def test_one_stray_check_never_flags_and_old_failures_age_out():
    judge = GradientJudge()
    for _ in range(5):
        assert judge.judge(1, "honest", 0.7).flagged is None  # a stray check, out of band but not decisively
        for _ in range(RECENT - 1):
            assert judge.judge(1, "honest", 1.0 + random.uniform(-0.05, 0.05)).flagged is None
    assert judge.flagged == set()
    smallest, largest = judge.extremes()["honest"]
    assert smallest == 0.7 and largest < BAND


def test_a_replay_off_the_training_answer_fails_and_two_failures_flag():
    honest = torch.randn(2, 8, 16)
    assert replay_distance(honest, honest.clone()) == 0.0
    noisy = honest + torch.randn_like(honest) * honest.square().mean().sqrt()
    assert replay_distance(noisy, honest) > 10 * TOLERANCE  # noise at the output's own scale: about 1
    assert replay_distance(3.0, 3.0 * (1 + TOLERANCE / 2)) < TOLERANCE  # a loss within numerics
    assert replay_measure(noisy, honest) > 10 and replay_measure(3.0, 3.0 * (1 + TOLERANCE / 2)) <= 1
    judge = GradientJudge()
    assert not judge.replayed(0, "noisy", replay_measure(noisy, honest), "output").in_band
    evidence = judge.replayed(0, "noisy", 2.0, "output").flagged
    assert evidence is not None and evidence.feature == "replay_check" and "replays" in evidence.describe()
    assert judge.farthest_replays()["noisy"] > 10 and "noisy" not in judge.extremes()


def test_a_persistent_bias_hides_in_the_replay_distance_and_stands_out_in_its_offset():
    """A twentieth of the output's RMS added to every token: on the distance's tolerance, but whole in
    the offset, where an honest bf16 answer's rounding (tiny's real head and body) averages away."""
    from lying_workers import BEHAVIOURS
    torch.manual_seed(0)
    head, body = build_stage(CONFIG.model, 0), build_stage(CONFIG.model, 1)
    tokens = torch.randint(0, CONFIG.model.vocab_size, (2, 32))
    with torch.no_grad():
        for stage, run in ((0, lambda: head(tokens)), (1, lambda: body(tokens, head(tokens)))):
            exact = run()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                rounded = run().to(torch.float32)
            biased = BEHAVIOURS["bias"](exact, None)
            assert abs(replay_distance(biased, exact) - TOLERANCE) < 0.02 * TOLERANCE  # the distance: a coin flip
            assert replay_offset(biased, exact) > 2 * OFFSET_TOLERANCE and replay_measure(biased, exact) > 2, stage
            assert replay_offset(rounded, exact) < OFFSET_TOLERANCE / 10 < replay_distance(rounded, exact), stage
            assert replay_measure(rounded, exact) < 0.25, stage


def test_a_workers_checks_fall_at_most_two_over_share_replies_apart_and_wait_for_credits_a_while():
    worker = WorkerView("w", "a:1", 1)
    worker.granted_credits = 2
    checks = GradientChecks(0.05, TrainerStats(), flag=lambda evidence: None, rng=random.Random(1))
    checked = [reply for reply in range(4000) if checks.due("w") and checks.checker(worker, [worker], 0.0)]
    gaps = [b - a for a, b in zip(checked, checked[1:])]
    assert max(gaps) <= round(2 / 0.05) - 1 and abs(len(checked) / 4000 - 0.05) < 0.01
    worker.in_flight = 2  # no credit free: the check stays due at the worker's next replies...
    while not checks.due("w"):
        pass
    assert checks.checker(worker, [worker], 0.0) is None and checks.due("w") and checks.due("w")
    worker.in_flight = 0
    assert checks.checker(worker, [worker], 0.0) is worker
    worker.in_flight = 2  # ... for as many replies as the longest gap at most: then it goes without them
    while not checks.due("w"):
        pass
    waits = 0
    while checks.checker(worker, [worker], 0.0) is None:
        waits += 1
        assert checks.due("w")
    assert waits == round(2 / 0.05) - 1


def test_a_rising_suspicion_elsewhere_checks_the_next_reply_at_once_once_per_rise():
    worker = WorkerView("w", "a:1", 1)
    worker.granted_credits, worker.in_flight = 2, 2  # no credit free
    checks = GradientChecks(0.05, TrainerStats(), flag=lambda evidence: None, rng=random.Random(1))
    while checks.due("w"):  # past its first check, if the draw made it the first reply
        checks.checker(worker, [worker], 0.0)
    checks.suspicion("w", raised=True)
    assert checks.due("w") and checks.checker(worker, [worker], 0.0) is worker  # at once, credits or not
    checks.suspicion("w", raised=True)  # still suspected: not checked again for it
    assert not checks.due("w")
    checks.suspicion("w", raised=False)
    checks.suspicion("w", raised=True)  # a new rise
    assert checks.due("w") and checks.checker(worker, [worker], 0.0) is worker


def test_a_liar_flagged_on_its_second_failure_carries_its_evidence():
    judge = GradientJudge()
    judge.judge(2, "honest", 1.0)
    assert judge.judge(2, "liar", 0.5).flagged is None
    evidence = judge.judge(2, "liar", 0.48).flagged
    assert evidence is not None and evidence.peer == "liar" and evidence.feature == "gradient_check"
    assert evidence.cusum == FAILURES and evidence.replies == 2 and "finite-difference" in evidence.describe()
    assert judge.flagged == {"liar"}


def test_the_worker_probes_its_own_gradient_when_it_has_two_credits_free_else_the_check_is_skipped():
    stats = TrainerStats()
    checks = GradientChecks(1.0, stats, flag=lambda evidence: None, rng=random.Random(0))
    worker, other = WorkerView("w", "a:1", 1), WorkerView("o", "a:2", 1)
    for view in (worker, other):
        view.granted_credits = 2
    assert checks.checker(worker, [worker, other], now=0.0) is worker
    worker.in_flight = 1  # one credit free is not enough for two probes; another replica's weights drifted
    assert checks.checker(worker, [worker, other], now=0.0) is None
    assert sample_value(stats.registry, "agora_trainer_gradient_checks_skipped_total", {"stage": "1"}) == 1


def test_a_zero_gradient_or_input_is_not_probed():
    # A worker sending zeros gives no direction to step along (and, with its input zero, no step):
    # the check is skipped, not a division by zero in the background task.
    assert not checkable(0.0, 1.0) and not checkable(0.1, 0.0) and not checkable(float("nan"), 1.0)
    assert checkable(1e-3, 2.0)


def _tail_answering(tail, checks: GradientChecks, version: int, full_precision: bool):
    """A tail's probe call, answered by the real stage on weights `version`, in full precision or not."""
    async def call(view, probe_id, tokens, frame, targets):
        with torch.no_grad():
            loss = float(tail(tokens, checks.probe_codec.decode(frame), targets))
        return SimpleNamespace(loss=loss, weights_version=version, compute_s=0.0, full_precision=full_precision)
    return call


def test_a_check_is_judged_only_when_both_probes_ran_on_the_gradients_own_weights_in_full_precision():
    # An averaging round between the gradient and its probes moves the weights without a step: the
    # probes' replies name other weights, and the check is counted skipped, not judged.
    _, tail, tokens, targets, _, tail_in, tail_grad, _ = _route("fp32")
    stats = TrainerStats()
    checks = GradientChecks(1.0, stats, flag=lambda evidence: None, rng=random.Random(0))
    worker = WorkerView("w", "a:1", 2)
    probe = Probe(tail_in, tail_grad, None, tokens, targets, weights_version=7)

    async def check(version: int, full_precision: bool = True):
        checks.launch(worker, worker, "m0", probe, _tail_answering(tail, checks, version, full_precision))
        await checks.drain()

    asyncio.run(check(8))
    asyncio.run(check(7, full_precision=False))  # a worker with bf16 weights: its probes are not precise enough
    assert checks.judge.extremes() == {}
    assert sample_value(stats.registry, "agora_trainer_gradient_checks_skipped_total", {"stage": "2"}) == 2
    asyncio.run(check(7))
    (smallest, largest), = checks.judge.extremes().values()
    assert abs(smallest - 1) < 0.01 and smallest == largest


def test_a_check_that_decided_nothing_is_due_again_at_the_next_reply_unless_nothing_would_change():
    _, tail, tokens, targets, _, tail_in, tail_grad, _ = _route("fp32")
    checks = GradientChecks(0.05, TrainerStats(), flag=lambda evidence: None, rng=random.Random(3))
    worker = WorkerView("w", "a:1", 2)
    worker.granted_credits = 4  # credits free: a due check is sent at once
    probe = Probe(tail_in, tail_grad, None, tokens, targets, weights_version=7)

    def sent_and_answered(version: int, full_precision: bool = True) -> None:
        while not checks.due("w"):
            pass
        assert checks.checker(worker, [worker], 0.0) is worker  # sent: the next one is drawn a gap away

        async def check():
            checks.launch(worker, worker, "m", probe, _tail_answering(tail, checks, version, full_precision))
            await checks.drain()
        asyncio.run(check())

    def replies_until_due() -> int:
        replies = 1
        while not checks.due("w"):
            replies += 1
        return replies

    sent_and_answered(8)  # a step or an averaging round came between: no verdict
    assert replies_until_due() == 1
    sent_and_answered(7, full_precision=False)  # the next reply would not be precise either
    assert replies_until_due() > 1  # the drawn gap runs on (this seed draws more than one)
    sent_and_answered(7)  # judged
    assert replies_until_due() > 1 and checks.judge.extremes()


@pytest.mark.parametrize("index", [1, 2])
def test_a_bf16_workers_honest_gradient_passes_its_check_in_full_precision_and_would_fail_without(index):
    # The real replica (no sockets) computing in bf16, as a GPU worker does: its probes under its own
    # autocast measure an honest gradient far from itself; in full precision within 1% of it.
    from agora.node.replica.compute import StageCompute
    from agora.node.replica.stash import ForwardStash
    from agora.pipeline.codec import encode_tokens
    from agora.pipeline.runtime import Runtime
    from agora.protos.stage_adapter import BackwardRequest, ForwardRequest

    torch.manual_seed(0)
    codec, vocab = WireCodec("fp32"), CONFIG.model.vocab_size
    compute = StageCompute(CONFIG, index, run_id="run", codec=codec, stash=ForwardStash(8, 60.0), synchronous=False,
                           runtime=Runtime(dtype="bf16"))
    tokens = torch.randint(0, vocab, (2, 32))
    targets = torch.randint(0, vocab, (2, 32)) if index == 2 else None
    with torch.no_grad():
        wire = build_stage(CONFIG.model, 0)(tokens)

    def request(microbatch_id, frame, evaluate=False, full_precision=False):
        return ForwardRequest(run_id="run", microbatch_id=microbatch_id, stage=index, tokens=encode_tokens(tokens, vocab),
                              wire=frame, targets=b"" if targets is None else encode_tokens(targets, vocab),
                              evaluate=evaluate, full_precision=full_precision)

    trained = compute.forward(request("m0", codec.encode(wire)))
    output_grad = None
    if index == 2:
        input_grad = codec.decode(trained.input_grad)
    else:
        output_grad = torch.randn_like(codec.decode(trained.wire))
        input_grad = codec.decode(compute.backward(BackwardRequest(run_id="run", microbatch_id="m0", stage=index,
                                                                   output_grad=codec.encode(output_grad))).input_grad)
    probe = Probe(wire, input_grad, output_grad, tokens, targets, weights_version=trained.weights_version)
    ratios = {}
    for full_precision in (False, True):
        checks = GradientChecks(1.0, TrainerStats(), flag=lambda evidence: None)

        async def call(view, probe_id, tokens, frame, targets, full_precision=full_precision):
            reply = compute.forward(request(probe_id, frame, evaluate=True, full_precision=full_precision))
            return SimpleNamespace(loss=reply.loss, wire=codec.decode(reply.wire) if reply.wire else None,
                                   weights_version=reply.weights_version, full_precision=True, compute_s=0.0)

        async def check():
            checks.launch(WorkerView("w", "a:1", index), WorkerView("w", "a:1", index), "m0", probe, call)
            await checks.drain()
        asyncio.run(check())
        (ratios[full_precision], _), = checks.judge.extremes().values()
    assert abs(ratios[True] - 1) < 0.01, ratios
    assert abs(ratios[False] - 1) > 10 * abs(ratios[True] - 1), ratios  # (the tail's: -0.14, out of band)
