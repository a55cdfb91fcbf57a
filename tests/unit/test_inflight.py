"""The adaptive depth (node/trainer/inflight.py): the fill rule, its moving averages, the resizable limit."""

import asyncio

import pytest

from agora.node.trainer.inflight import DepthEstimate, InFlightLimit, fill_depth


def test_depth_hides_the_latency_behind_the_busiest_stage():
    # Loopback: 3 stages of ~20 ms and ~15 ms of round trips: about one microbatch per stage.
    assert fill_depth(0.075, [0.020, 0.020, 0.016], cap=16) == 4
    # 80 ms links: five calls of ~80 ms on top of the same compute.
    assert fill_depth(0.075 + 5 * 0.080, [0.020, 0.020, 0.016], cap=64) == 24
    # A slow stage is the one to keep busy: fewer in flight suffice.
    assert fill_depth(0.5, [0.1, 0.25, 0.05], cap=64) == 2


def test_depth_fills_this_trainers_share_of_each_stage():
    # 560 ms through 3 stages of 50 ms: 12 keep one replica busy.
    alone = fill_depth(0.56, [0.05, 0.05, 0.05], cap=256)
    assert alone == 12
    # One trainer on 4 replicas a stage keeps all four busy, not one of them.
    assert fill_depth(0.56, [0.05, 0.05, 0.05], cap=256, shares=[4, 4, 4]) == 45
    # Two trainers on those 4 replicas (each worker serves 2 callers): half each.
    assert fill_depth(0.56, [0.05, 0.05, 0.05], cap=256, shares=[2, 2, 2]) == 23
    # Four trainers on one replica: a quarter each, so together they fill it once, not four times.
    assert fill_depth(0.56, [0.05, 0.05, 0.05], cap=256, shares=[0.25] * 3) == 3
    # The stage with the longest period is the one to fill: a slow stage with enough replicas is not it.
    assert fill_depth(0.56, [0.2, 0.05, 0.05], cap=256, shares=[4, 1, 1]) == 12
    # Shares not given count one each; the cap still holds.
    assert fill_depth(0.56, [0.05, 0.05, 0.05], cap=256, shares=[4]) == 12
    assert fill_depth(0.56, [0.05, 0.05, 0.05], cap=16, shares=[4, 4, 4]) == 16
    with pytest.raises(ValueError):
        fill_depth(0.56, [0.05], cap=16, shares=[0.0])


def test_depth_is_capped_floored_and_sane_without_measurements():
    assert fill_depth(10.0, [0.01], cap=8) == 8
    assert fill_depth(0.001, [0.5], cap=8) == 1
    assert fill_depth(0.001, [0.5], cap=8, floor=3) == 3
    assert fill_depth(1.0, [], cap=8, floor=2) == 2 and fill_depth(0.0, [0.1], cap=8) == 1
    assert fill_depth(0.4, [0.1], cap=8) == 4  # an exact multiple is not rounded up by float noise
    with pytest.raises(ValueError):
        fill_depth(1.0, [0.1], cap=0)


def test_estimate_excludes_queueing_and_follows_changes():
    estimate = DepthEstimate(stages=2)
    assert estimate.depth(cap=8) is None
    estimate.observe(wall_s=0.5, compute_by_stage=[0.1, 0.1], queued_s=0.3)  # 0.2 s unqueued
    assert estimate.depth(cap=8) == 2
    for _ in range(100):  # the links got slower
        estimate.observe(wall_s=1.0, compute_by_stage=[0.1, 0.1], queued_s=0.0)
    assert estimate.latency_s == pytest.approx(1.0, rel=1e-3) and estimate.depth(cap=8) == 8


async def _settle() -> None:
    """Let every ready task run (no timers involved: the limit is woken only by its own calls)."""
    for _ in range(50):
        await asyncio.sleep(0)


def test_limit_can_shrink_and_grow_while_held():
    async def scenario():
        limit = InFlightLimit(2)
        entered = []

        async def hold(name, release):
            async with limit:
                entered.append(name)
                await release.wait()

        first, second, third = asyncio.Event(), asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(hold("a", first)), asyncio.create_task(hold("b", second))]
        await _settle()
        await limit.set(1)  # lowered while two are in: both finish, nobody new enters until one is left
        tasks.append(asyncio.create_task(hold("c", third)))
        await _settle()
        first.set()
        await _settle()
        assert entered == ["a", "b"] and limit.active == 1
        second.set()
        await _settle()
        assert entered == ["a", "b", "c"]
        await limit.set(3)
        third.set()
        await asyncio.gather(*tasks)
        assert limit.active == 0 and limit.limit == 3

    asyncio.run(scenario())


def test_a_holder_cancelled_while_others_wait_frees_its_place():
    """A unit's microbatches stopped mid-flight (cancelled) give their places back at once, even while
    other microbatches wait at the limit: none is lost, and the waiters enter in the order they came."""
    async def scenario():
        limit = InFlightLimit(1)
        entered = []

        async def hold(name, release):
            async with limit:
                entered.append(name)
                await release.wait()

        never, later = asyncio.Event(), asyncio.Event()
        holder = asyncio.create_task(hold("a", never))
        await _settle()
        waiters = [asyncio.create_task(hold(name, later)) for name in ("b", "c")]
        await _settle()
        holder.cancel()
        waiters[1].cancel()  # a waiter cancelled too: it takes no place
        await _settle()
        assert entered == ["a", "b"] and limit.active == 1
        later.set()
        await asyncio.gather(waiters[0])
        assert limit.active == 0 and entered == ["a", "b"]

    asyncio.run(scenario())


def test_initial_depth_is_half_a_batch_within_the_cap_when_adaptive():
    from agora.node.trainer.inflight import initial_depth

    assert initial_depth(16, 8, adaptive=True) == 4
    assert initial_depth(2, 8, adaptive=True) == 2
    assert initial_depth(16, 1, adaptive=True) == 1
    assert initial_depth(16, 8, adaptive=False) == 16


def test_initial_depth_keeps_within_what_the_workers_announce():
    """The report's shape: half of 256 microbatches is twice what a worker's stash keeps for a trainer."""
    from agora.node.trainer.inflight import initial_depth
    from agora.node.trainer.routing import MIN_CREDITS

    assert initial_depth(256, 256, adaptive=True, credit_cap=64, stage_credits=[40, 40, 40]) == 64
    # Calls outstanding over the stages bound it too: a newcomer's 4 calls a stage hold 12 microbatches.
    assert initial_depth(256, 256, adaptive=True, credit_cap=64, stage_credits=[4, 4, 4]) == 12
    # A stage with no worker known yet counts a worker that states no credits.
    assert initial_depth(256, 256, adaptive=True, credit_cap=None, stage_credits=[0, 0, 0]) == 3 * MIN_CREDITS
    assert initial_depth(256, 256, adaptive=True, credit_cap=None, stage_credits=[0, 20, 20]) == 40 + MIN_CREDITS
    # A fixed depth too, as `resized_depth` caps it after the first microbatch.
    assert initial_depth(16, 8, adaptive=False, credit_cap=6, stage_credits=[8, 8]) == 6
    assert initial_depth(16, 8, adaptive=False, credit_cap=None, stage_credits=[]) == 16


def test_resized_depth_follows_the_estimate_within_the_credits():
    from agora.node.trainer.inflight import DepthEstimate, resized_depth

    estimate = DepthEstimate(stages=2)
    assert resized_depth(estimate, adaptive=True, max_in_flight=32, credit_cap=None, stage_credits=[]) is None
    estimate.observe(1.0, [0.1, 0.05], 0.0)  # fill depth 10
    assert resized_depth(estimate, adaptive=True, max_in_flight=32, credit_cap=None, stage_credits=[]) == 10
    assert resized_depth(estimate, adaptive=True, max_in_flight=32, credit_cap=6, stage_credits=[]) == 6
    assert resized_depth(estimate, adaptive=False, max_in_flight=32, credit_cap=None, stage_credits=[4, 4]) == 8
    # Two replicas of the bottleneck stage, this trainer alone on them: twice as deep.
    assert resized_depth(estimate, adaptive=True, max_in_flight=32, credit_cap=None, stage_credits=[],
                         stage_shares=[2.0, 1.0]) == 20
