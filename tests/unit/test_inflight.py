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
    assert estimate.depth(cap=8) == 3  # 2 fill it, and half as many again of headroom
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


def test_the_first_depth_is_one_microbatch_when_adaptive_else_the_fixed_cap():
    """Adaptive: the first microbatch goes alone, whatever the cap and the credits (its calls set the
    links' floors); a fixed depth starts at itself."""
    from agora.node.trainer.inflight import initial_depth

    assert initial_depth(16, adaptive=True) == 1
    assert initial_depth(256, adaptive=True, credit_cap=64, stage_credits=[40, 40, 40]) == 1
    assert initial_depth(16, adaptive=False) == 16


def test_a_fixed_first_depth_keeps_within_what_the_workers_announce():
    """The report's shape: a fixed depth of 256 is four times what a worker's stash keeps for a trainer."""
    from agora.node.trainer.inflight import initial_depth
    from agora.node.trainer.routing import MIN_CREDITS

    assert initial_depth(256, adaptive=False, credit_cap=64, stage_credits=[40, 40, 40]) == 64
    # Calls outstanding over the stages bound it too: a newcomer's 4 calls a stage hold 12 microbatches.
    assert initial_depth(256, adaptive=False, credit_cap=64, stage_credits=[4, 4, 4]) == 12
    # A stage with no worker known yet counts a worker that states no credits.
    assert initial_depth(256, adaptive=False, credit_cap=None, stage_credits=[0, 0, 0]) == 3 * MIN_CREDITS
    assert initial_depth(256, adaptive=False, credit_cap=None, stage_credits=[0, 20, 20]) == 40 + MIN_CREDITS
    assert initial_depth(16, adaptive=False, credit_cap=6, stage_credits=[8, 8]) == 6
    assert initial_depth(16, adaptive=False, credit_cap=None, stage_credits=[]) == 16


def test_wire_time_beyond_a_links_least_is_queueing():
    from agora.node.trainer.inflight import WireFloor

    floor = WireFloor()
    assert floor.beyond(("b", "Forward"), 0.040) == 0.0  # a link's first call, nothing queued: its floor
    assert floor.beyond(("a", "Forward"), 0.100) == 0.0
    assert floor.beyond(("a", "Backward"), 0.300) == 0.0  # another method: another link
    assert floor.beyond(("a", "Forward"), 0.350) == pytest.approx(0.250)
    assert floor.beyond(("a", "Forward"), 0.080) == 0.0  # a lower one is the floor from now on
    assert floor.beyond(("a", "Forward"), 0.100) == pytest.approx(0.020)
    assert floor.beyond(("a", "Forward"), -0.001) == 0.0  # a clock's rounding is no negative wire time
    # However long the queue lasts, the floor stays: 10,000 queued calls do not make it theirs.
    for _ in range(10_000):
        assert floor.beyond(("b", "Forward"), 0.540) == pytest.approx(0.500)


def test_a_link_first_called_while_the_uplink_queues_starts_below_that_queue():
    """Calls on known links queue ~0.4 s behind the trainer's other frames: a worker first called now
    (a replica the trainer had not used yet) took 0.45 s, of which its link is 0.05 s, not 0.45 s (its
    floor would have hidden that queue from every later call on it)."""
    from agora.node.trainer.inflight import WireFloor

    floor = WireFloor()
    floor.beyond("known", 0.1)
    for _ in range(60):  # the queue builds and stays: its moving average follows it
        floor.beyond("known", 0.5)
    assert floor.queued_s == pytest.approx(0.4, rel=0.01)
    assert floor.beyond("new", 0.45) == pytest.approx(0.4, rel=0.01)
    assert floor.beyond("new", 0.05) == pytest.approx(0.0, abs=0.005)
    # A first call shorter than the queue now is all queue but its floor is no less than nothing.
    assert floor.beyond("newer", 0.2) == pytest.approx(0.2) and floor.beyond("newer", 0.2) == pytest.approx(0.2)


def test_wire_floors_forget_the_least_recently_called_links_past_their_bound():
    from agora.node.trainer.inflight import WireFloor

    floor = WireFloor(links=2)
    floor.beyond("a", 0.1)
    floor.beyond("b", 0.1)
    floor.beyond("b", 0.1)  # b was called last: a is the one to forget
    floor.beyond("c", 0.1)
    assert floor.beyond("b", 0.3) == pytest.approx(0.2)
    assert floor.queued_s == pytest.approx(0.02)
    assert floor.beyond("a", 0.3) == pytest.approx(0.02)  # forgotten: its next call starts it again
    with pytest.raises(ValueError):
        WireFloor(links=0)


def test_resized_depth_follows_the_estimate_within_the_credits():
    from agora.node.trainer.inflight import DepthEstimate, resized_depth

    estimate = DepthEstimate(stages=2)
    assert resized_depth(estimate, adaptive=True, max_in_flight=32, credit_cap=None, stage_credits=[]) is None
    estimate.observe(1.0, [0.1, 0.05], 0.0)  # fill depth 10, 15 with the headroom
    assert resized_depth(estimate, adaptive=True, max_in_flight=32, credit_cap=None, stage_credits=[]) == 15
    assert resized_depth(estimate, adaptive=True, max_in_flight=32, credit_cap=6, stage_credits=[]) == 6
    assert resized_depth(estimate, adaptive=False, max_in_flight=32, credit_cap=None, stage_credits=[4, 4]) == 8
    # Two replicas of the bottleneck stage, this trainer alone on them: twice as deep.
    assert resized_depth(estimate, adaptive=True, max_in_flight=64, credit_cap=None, stage_credits=[],
                         stage_shares=[2.0, 1.0]) == 30
