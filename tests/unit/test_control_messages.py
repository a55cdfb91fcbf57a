"""Control messages checked against the worker's state (issue 11), without sockets.

Each hostile input gets the status class the worker maps to a gRPC code (InvalidRequest ->
INVALID_ARGUMENT, PreconditionFailed -> FAILED_PRECONDITION, NotOwner -> PERMISSION_DENIED), a
message naming the field, the value and what is allowed, and changes nothing: step count, counted
reports, accumulated gradients and stash are compared before and after.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch

from agora.node.replica.compute import StageCompute
from agora.node.replica.request_frames import (ExtremeInput, InvalidRequest, NotOwner, PreconditionFailed,
                                                ReportOutsideWindow)
from agora.node.replica.epoch import (ReportCredits, ReportDecision, ReportWindow, check_step_fields, judge_report,
                                      prune_counted, stage_step)
from agora.node.replica.stash import ForwardStash
from agora.pipeline.codec import WireCodec, encode_tokens
from agora.pipeline.config import PRESETS
from agora.protos.stage_adapter import AbortRequest, BackwardRequest, ForwardRequest, StepRequest

pytestmark = pytest.mark.timeout(60)

CONFIG = PRESETS["tiny"].with_stages(3)
CODEC = WireCodec("fp32", max_bytes=2**24)
MICRO = CONFIG.train.microbatches  # 4 on tiny
SMALL = ReportWindow(ahead=8, behind=4, catch_up=3, max_replicas=16)


def make(index: int, *, synchronous: bool = False, window: ReportWindow = SMALL, capacity: int = 8) -> StageCompute:
    return StageCompute(CONFIG, index, run_id="run", codec=CODEC, stash=ForwardStash(capacity, 60.0),
                        synchronous=synchronous, local_batch=None, report_window=window)


def tokens_of(seed: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))


def forward(compute: StageCompute, microbatch_id: str, owner: str = "honest", seed: int = 0):
    request = ForwardRequest(run_id="run", microbatch_id=microbatch_id, stage=compute.index,
                             tokens=encode_tokens(tokens_of(seed), CONFIG.model.vocab_size))
    return CODEC.decode(compute.forward(request, owner).wire)


def backward(compute: StageCompute, microbatch_id: str, grad: torch.Tensor, owner: str = "honest"):
    return compute.backward(BackwardRequest(run_id="run", microbatch_id=microbatch_id, stage=compute.index,
                                            output_grad=CODEC.encode(grad)), owner)


def report(compute: StageCompute, batch: int, microbatches: int = MICRO, replicas: int = 1, owner: str = "honest"):
    return compute.step(StepRequest(run_id="run", stage=compute.index, microbatches=microbatches,
                                    completed_batch=batch, replicas=replicas), owner)


def snapshot(compute: StageCompute) -> tuple:
    grads = tuple(None if p.grad is None else p.grad.clone() for p in compute.optimizer.parameters)
    weights = tuple(p.detach().clone() for p in compute.optimizer.parameters)
    return (compute.optimizer.steps, dict(compute._counted_batches), sorted(compute.applied),
            compute.stash.owners(), grads, weights)


def assert_unchanged(before: tuple, after: tuple) -> None:
    assert before[:4] == after[:4]
    for a, b in zip(before[4] + before[5], after[4] + after[5]):
        assert (a is None and b is None) or torch.equal(a, b)


def refused(compute: StageCompute, error: type, needles: tuple[str, ...], call) -> str:
    before = snapshot(compute)
    with pytest.raises(error) as caught:
        call()
    assert type(caught.value) is error, caught.value
    for needle in needles:
        assert needle in str(caught.value), (needle, str(caught.value))
    assert_unchanged(before, snapshot(compute))
    return str(caught.value)


# ---------------------------------------------------------------------------------------------- pure rules


def test_the_report_window_rules():
    window = ReportWindow(ahead=10, behind=5, catch_up=3)
    # A replica that has counted nothing yet takes the first report's batch as the stage's epoch.
    assert judge_report(10**9, 0, joined=False, window=window).adopt == 10**9
    assert judge_report(2, 0, joined=False, window=window).adopt is None  # close enough: no jump
    # After that: within [s - behind, s + ahead], catching up beyond catch_up; refused outside.
    assert judge_report(53, 50, joined=True, window=window) == judge_report(45, 50, joined=True, window=window)
    assert judge_report(53, 50, joined=True, window=window).refusal is None
    # It missed reports: it catches up, on the reporter's credit (no stage count to catch up to here).
    assert judge_report(54, 50, joined=True, window=window, credit=4) == ReportDecision(adopt=54, spent=4)
    assert judge_report(60, 50, joined=True, window=window, credit=10).adopt == 60
    assert judge_report(60, 50, joined=True, window=window, credit=2) == ReportDecision(adopt=52, spent=2)
    assert judge_report(54, 50, joined=True, window=window) == ReportDecision()  # no credit: one step
    ahead = judge_report(61, 50, joined=True, window=window).refusal
    assert "completed_batch 61 is 11 batches ahead of this replica's step count 50" in ahead and "[45, 60]" in ahead
    stale = judge_report(44, 50, joined=True, window=window).refusal
    assert "completed_batch 44 is stale" in stale and "[45, 60]" in stale
    counted = OrderedDict((b, b) for b in (40, 44, 45, 52))
    prune_counted(counted, 50, window)
    assert list(counted) == [45, 52]
    assert check_step_fields(microbatches=4, replicas=2, configured_microbatches=4, window=window) is None
    assert check_step_fields(microbatches=4, replicas=None, configured_microbatches=4, window=window) is None
    assert "microbatches must be 1..4 (this run's train.microbatches), got 5" in check_step_fields(
        microbatches=5, replicas=1, configured_microbatches=4, window=window)
    assert "replicas must be 1..1024" in check_step_fields(microbatches=1, replicas=2**32 - 1,
                                                           configured_microbatches=4, window=window)
    with pytest.raises(ValueError, match="ahead >= catch_up"):
        ReportWindow(ahead=2, catch_up=3)


def test_the_stage_s_announced_count_bounds_a_first_report_and_re_anchors_a_replica_far_from_it():
    window = ReportWindow(ahead=10, behind=5, catch_up=3)
    # A fresh replica whose stage announces step 1000 takes a first report near it, not a far one:
    # the stage's count is free, what lies beyond it costs the reporter's credit.
    assert judge_report(1004, 0, joined=False, window=window, stage_step=1000) == ReportDecision(adopt=1000)
    assert judge_report(1004, 0, joined=False, window=window, stage_step=1000, credit=9) == \
        ReportDecision(adopt=1004, spent=4)
    far = judge_report(10**9, 0, joined=False, window=window, stage_step=1000).refusal
    assert "far from the step count 1000 this stage's other replicas announce" in far and "[995, 1010]" in far
    # A replica cut off for a while (far behind its stage) or set far ahead by a bad first report
    # counts a report near its stage's count and takes it, in either direction.
    assert judge_report(1002, 50, joined=True, window=window, stage_step=1000).adopt == 1000
    assert judge_report(998, 50, joined=True, window=window, stage_step=1000).adopt == 998
    assert judge_report(1002, 10**9, joined=True, window=window, stage_step=1000).adopt == 1002
    # Near its stage, the replica's own window rules alone; a report far from both is refused.
    assert judge_report(1020, 1000, joined=True, window=window, stage_step=1000).refusal is not None
    assert judge_report(5000, 50, joined=True, window=window, stage_step=1000).refusal is not None
    assert stage_step([]) is None and stage_step([7]) == 7 and stage_step([9, 3, 5, 100]) == 5


def test_a_replica_set_far_ahead_by_a_bad_first_report_comes_back_to_its_stage():
    compute = make(0)
    report(compute, 10**6)  # a hostile trainer got there first, before any replica was announced
    assert compute.optimizer.steps == 10**6 + 1
    with pytest.raises(ReportOutsideWindow):
        report(compute, 40)  # the honest trainers' batches are "stale" to it now
    compute.stage_step = 38  # the join daemon read the stage's other replicas
    report(compute, 40)
    assert compute.optimizer.steps == 41
    report(compute, 41)
    assert compute.optimizer.steps == 42


def test_no_batch_ever_forces_a_second_step_in_any_order():
    """Reports of batches 0..199, each sent three times in a shuffled order with late stragglers:
    a replica steps once per batch it counts, and a batch it refused as stale or counted before
    never steps it again (before: a report older than the last 4096 counted forced a step)."""
    compute = make(0)
    rng = random.Random(0)
    sends = [b for b in range(200) for _ in range(3)]
    # Mostly in order with local shuffles (several trainers), plus a few very late repeats.
    sends = [b for i in range(0, len(sends), 12) for b in rng.sample(sends[i:i + 12], len(sends[i:i + 12]))]
    stragglers = [rng.randrange(0, 150) for _ in range(40)]
    stepped: set[int] = set()
    for batch in sends + stragglers:
        before = compute.optimizer.steps
        try:
            report(compute, batch)
        except ReportOutsideWindow as error:
            assert "stale" in str(error) or "ahead" in str(error)
            assert compute.optimizer.steps == before
            continue
        if compute.optimizer.steps != before:
            assert batch not in stepped, f"batch {batch} stepped twice"
            stepped.add(batch)
        assert len(compute._counted_batches) <= SMALL.ahead + SMALL.behind + 1
    assert len(stepped) >= 190 and compute.optimizer.steps >= 199


def test_a_trainer_earns_one_step_of_credit_per_report_counted_and_keeps_at_most_the_window():
    credits = ReportCredits(cap=3, max_trainers=2)
    for _ in range(5):
        credits.counted("a", spent=0)
    assert credits.of("a") == 3 and credits.of("nobody") == 0
    credits.counted("a", spent=3)  # a jump of three spends it all; the report itself earns one
    assert credits.of("a") == 1
    credits.counted("b", spent=0)
    credits.counted("c", spent=0)  # a third trainer: the least recently heard from is forgotten
    assert (credits.of("a"), credits.of("b"), credits.of("c")) == (0, 1, 1)


def test_780_reports_sent_to_every_replica_of_a_stage_do_not_end_a_200k_step_schedule():
    """A trainer reports, to each of a stage's three replicas in turn, a batch as far ahead as the
    window lets it, 780 times; the join daemon gives each replica its others' median between rounds.
    Each report moved every replica 256 steps, and the median with them: 780 reports were the whole
    200,000-step schedule. Now the count moves by at most what the reports earn as credit."""
    window = ReportWindow()  # the defaults the worker runs with
    replicas = [make(0, window=window) for _ in range(3)]
    for replica in replicas:
        report(replica, 1000, owner="honest")  # the stage is at step 1000 and every replica follows it
    for _ in range(780):
        for index, replica in enumerate(replicas):
            report(replica, replica.optimizer.steps + window.ahead, owner="mallory")
        steps = [replica.optimizer.steps for replica in replicas]
        for index, replica in enumerate(replicas):
            replica.stage_step = stage_step(steps[:index] + steps[index + 1:])
    moved = [replica.optimizer.steps - 1001 for replica in replicas]
    assert all(780 <= step <= 2 * 780 + window.ahead for step in moved), moved
    assert max(moved) < 200_000
    # The stage still counts an honest report where it is.
    at = stage_step(replica.optimizer.steps for replica in replicas)
    assert report(replicas[0], at + 1, owner="honest").step >= at


# ---------------------------------------------------------------------------------------------- StageCompute


def test_a_report_far_ahead_is_refused_and_a_joining_replica_still_adopts_the_epoch():
    compute = make(0, window=ReportWindow())  # the defaults the worker runs with
    assert report(compute, 5000).step == 5001  # joining mid-run: the first report sets the epoch
    out = forward(compute, "mine")
    backward(compute, "mine", torch.ones_like(out))
    message = refused(compute, ReportOutsideWindow, ("completed_batch 9007199254740000", "[3977, 5257]"),
                      lambda: report(compute, 2**53 - 992))
    assert "ahead of this replica's step count 5001" in message
    refused(compute, ReportOutsideWindow, ("completed_batch 5258 is 257 batches ahead",),
            lambda: report(compute, 5258))
    refused(compute, ReportOutsideWindow, ("completed_batch 3976 is stale",), lambda: report(compute, 3976))
    refused(compute, InvalidRequest, ("completed_batch must be below 2**53",), lambda: report(compute, 2**64 - 1))
    reply = report(compute, 5001)  # the honest next report: one step on what was accumulated
    assert (reply.step, reply.accumulated) == (5002, 1)
    assert report(compute, 5001) == reply  # a retry is answered from the record


def test_step_fields_that_would_scale_the_gradient_are_bounded_by_the_run():
    compute = make(2)
    report(compute, 0)
    refused(compute, InvalidRequest, ("microbatches must be 1..4", "got 5"), lambda: report(compute, 1, microbatches=5))
    refused(compute, InvalidRequest, ("microbatches must be 1..4", "got 0"), lambda: report(compute, 1, microbatches=0))
    refused(compute, InvalidRequest, ("replicas must be 1..16", "got 4294967295"),
            lambda: report(compute, 1, replicas=2**32 - 1))
    refused(compute, InvalidRequest, ("replicas must be 1..16", "got 0"), lambda: report(compute, 1, replicas=0))
    assert report(compute, 1, microbatches=MICRO, replicas=16).step == 2


def test_a_synchronous_barrier_must_name_its_step_and_the_run_s_microbatches():
    tail = make(2, synchronous=True)
    wire = torch.randn(2, 16, CONFIG.model.wire_dim, generator=torch.Generator().manual_seed(3)) * 0.1
    tail.forward(ForwardRequest(run_id="run", microbatch_id="m", stage=2,
                                tokens=encode_tokens(tokens_of(1), CONFIG.model.vocab_size), wire=CODEC.encode(wire),
                                targets=encode_tokens(tokens_of(2), CONFIG.model.vocab_size)), "honest")
    barrier = lambda owner="honest", **fields: tail.step(StepRequest(run_id="run", stage=2, **fields),  # noqa: E731
                                                          owner)
    refused(tail, InvalidRequest, ("step: a synchronous Step barrier must name the step it closes",
                                   "this worker is at step 0"), lambda: barrier(microbatches=MICRO))
    refused(tail, InvalidRequest, ("microbatches must be 1..4", "got 4294967295"),
            lambda: barrier(microbatches=2**32 - 1, step=0))
    refused(tail, PreconditionFailed, ("Step barrier for step 1000", "at step 0"),
            lambda: barrier(microbatches=MICRO, step=1000))
    refused(tail, PreconditionFailed, ("synchronous mode",), lambda: report(tail, 0))
    # Another trainer cannot close the honest trainer's batch, not even at the right step.
    refused(tail, NotOwner, ("belong to another trainer", "only a trainer with work in it may close"),
            lambda: barrier("hostile", microbatches=MICRO, step=0))
    assert barrier(microbatches=MICRO, step=0).accumulated == 1
    assert barrier("hostile", microbatches=MICRO, step=0).step == 1  # a retried barrier: its reply, to anyone
    refused(tail, PreconditionFailed, ("no microbatch has passed this stage since the last step",),
            lambda: barrier(microbatches=MICRO, step=1))


def test_a_huge_output_gradient_on_the_head_is_refused_before_it_touches_grad():
    head = make(0)
    out = forward(head, "mb")
    huge = torch.full_like(out, 3e38)  # finite, so the codec takes it; the embedding's gradient overflows
    message = refused(head, ExtremeInput, ("output_grad: stage 0's parameter gradient is not finite",
                                             "nothing accumulated", "the request's values overflowed it"),
                      lambda: backward(head, "mb", huge))
    assert head.stash.keys_of("honest") == ["mb"], message  # still there: the owner may send a sane one
    backward(head, "mb", torch.ones_like(out))
    assert head.accumulated_microbatches == 1
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in head.optimizer.parameters)


def test_an_abort_of_another_trainer_s_microbatch_is_refused_at_every_stage_of_its_life():
    head = make(0)
    out = forward(head, "theirs")
    needle = ("microbatch 'theirs' belongs to another trainer",)
    abort = lambda owner: head.abort(AbortRequest(run_id="run", microbatch_id="theirs", stage=0), owner)  # noqa: E731
    refused(head, NotOwner, needle, lambda: abort("hostile"))  # stashed
    backward(head, "theirs", torch.ones_like(out))
    refused(head, NotOwner, needle, lambda: abort("hostile"))  # accumulated
    report(head, 0)
    refused(head, NotOwner, needle, lambda: abort("hostile"))  # stepped
    assert abort("honest").outcome == "stepped"
    assert head.abort(AbortRequest(run_id="run", microbatch_id="never", stage=0), "hostile").outcome == "unknown"


# ---------------------------------------------------------------------------------------------- stash fairness


def test_one_owner_s_flood_evicts_its_own_entries_never_another_s():
    stash = ForwardStash(8, 60.0)
    for i in range(3):
        stash.put(f"a{i}", i, owner="a")
    for i in range(100):
        evicted = stash.put(f"b{i}", i, owner="b")
        assert not any(key.startswith("a") for key in evicted)
    assert stash.keys_of("a") == ["a0", "a1", "a2"]
    assert stash.keys_of("b") == [f"b{i}" for i in range(95, 100)]  # its newest, in the room left
    # Two owners at their fair share: each new entry of one costs that one its oldest.
    stash.put("a3", 3, owner="a")  # a (4) < b (5): b, the largest holder, gives way
    assert stash.owners() == {"a": 4, "b": 4}
    assert stash.put("a4", 4, owner="a") == ["a0"]
    # A single owner keeps the old contract: its stalest entry goes.
    alone = ForwardStash(2, 60.0)
    assert [alone.put(k, k) for k in "xyz"] == [[], [], ["x"]]
    # More owners than slots: only then does an entry of another owner go (the oldest).
    crowded = ForwardStash(2, 60.0)
    assert [crowded.put(k, k, owner=k) for k in "pqr"] == [[], [], ["p"]]


def test_a_hostile_trainer_s_forwards_do_not_evict_an_honest_pending_backward():
    head = make(0, capacity=8)
    out = forward(head, "honest-1")
    for i in range(40):  # a flood of Forwards under ids of its own
        forward(head, f"hostile-{i}", owner="hostile", seed=i)
    assert head.stash.owners() == {"honest": 1, "hostile": 7}
    backward(head, "honest-1", torch.ones_like(out))
    assert head.accumulated_microbatches == 1
