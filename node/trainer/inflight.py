"""How many microbatches a trainer keeps in flight: enough to fill the pipe, no more.

A microbatch alone takes `latency` to go through the pipeline: every stage's compute plus every
call's round trip and the trainer's own work between calls (queueing excluded: that is what too
many in flight causes, and counting it would make the depth feed on itself). Queueing is what the
workers say they queued, what the trainer waited for their credits, and a call's time on the wire
beyond the least it ever took to that worker (`WireFloor`): a frame waiting behind the trainer's
own other frames on its uplink (or the worker's) is queueing the workers never see. Counted as
latency, an uplink-bound trainer's depth grows into its own send queue, each microbatch more
waits there, and the depth grows again, to its cap. The busiest stage
is kept busy when a new microbatch reaches it as soon as it finishes the last, i.e. with

    depth = ceil(latency / bottleneck)

microbatches in flight, `bottleneck` being the longest of the stages' periods: a stage's compute
per microbatch (forward and backward) over the replicas' worth of it this trainer gets. A worker
serves its callers about equally and says in every reply how many it serves, so a stage's share is
the sum over its replicas of 1 / callers (node/trainer/routing.py, `share_of_stage`): one trainer
on R replicas keeps all R busy, T trainers on R replicas R / T each. Sized to one replica, T
trainers would keep T replicas busy, whatever R (one trainer on four replicas: a quarter of the
stage); sized to the whole stage each, T trainers would queue T times what fills it at the
workers, the microbatches growing staler for nothing. On loopback the round trips are a few
milliseconds and the depth is about the number of stages (times the share); over 80 ms links it
grows with the round trips, and a fixed depth there leaves every worker idle most of the time.

That many exactly keeps the bottleneck busy only if every microbatch is on time; one that runs late
(a slower replica, a frame behind others, a busy core) leaves it idle, so the estimate asks for
`HEADROOM` times it, as TCP's BBR keeps twice its bandwidth-delay product in flight. At 1.0 a
simulated 7-stage pipeline of 10 replicas and 10 trainers kept its busiest stage 78% busy; at 1.5,
99% (2.0: 100%, with a third more in flight). Before a call's wait on the wire counted as
queueing, that wait padded the latency and gave the depth its headroom by accident, and without
bound: it grew with the depth.

More in flight than that buys nothing (the bottleneck is already busy) and costs convergence: a
microbatch started before a worker steps finishes on newer weights, and the staleness is about
depth / microbatches-per-batch optimizer steps. So the depth is also capped (`cap`), which the
trainer derives from `--max-staleness` (global batches).

`fill_depth` is the pure rule (unit-tested); `DepthEstimate` keeps the moving averages the
trainer feeds it from every training microbatch; `WireFloor` tells a call's wire queueing from its
link's own time; `InFlightLimit` is the resizable semaphore. The simulator (node/simulate) calls the
same three.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.routing import MIN_CREDITS

__all__ = ["fill_depth", "in_flight_limit", "adaptive_depth", "depth_cap", "initial_depth", "resized_depth",
           "DepthEstimate", "WireFloor", "InFlightLimit", "SMOOTHING", "HEADROOM"]

# Weight of the newest microbatch in the moving averages: ~10 microbatches of memory.
SMOOTHING = 0.1
# The depth over the bare fill depth the estimate asks for (module docstring).
HEADROOM = 1.5
# Links remembered at most (workers that left are forgotten first).
_WIRE_LINKS = 1024


def fill_depth(latency_s: float, stage_compute_s: Sequence[float], *, cap: int, floor: int = 1,
               shares: Sequence[float] = ()) -> int:
    """Microbatches in flight that keep the busiest stage busy (see the module docstring), in
    [floor, cap]. `latency_s`: one microbatch's time through the pipeline, queueing excluded;
    `stage_compute_s`: each stage's compute per microbatch; `shares`: the replicas' worth of each
    stage this trainer gets (one each where not given)."""
    if cap < 1 or floor < 1:
        raise ValueError(f"cap and floor must be at least 1, got cap={cap} floor={floor}")
    if any(not share > 0 for share in shares):
        raise ValueError(f"a stage's share must be positive, got {list(shares)}")
    floor = min(floor, cap)
    shares = list(shares) + [1.0] * (len(stage_compute_s) - len(shares))
    bottleneck = max((compute / share for compute, share in zip(stage_compute_s, shares)), default=0.0)
    if not bottleneck > 0 or not latency_s > 0:
        return floor
    return max(floor, min(cap, math.ceil(latency_s / bottleneck - 1e-9)))


@dataclass
class DepthEstimate:
    """Moving averages of a microbatch's unqueued latency and of each stage's compute."""

    stages: int
    latency_s: float = 0.0
    stage_compute_s: list[float] = field(default_factory=list)
    samples: int = 0

    def observe(self, wall_s: float, compute_by_stage: Sequence[float], queued_s: float) -> None:
        """One training microbatch: its wall time, each stage's compute on it, its total queueing."""
        latency = max(0.0, wall_s - queued_s)
        if self.samples == 0:
            self.latency_s, self.stage_compute_s = latency, list(compute_by_stage)
        else:
            self.latency_s += SMOOTHING * (latency - self.latency_s)
            self.stage_compute_s = [old + SMOOTHING * (new - old)
                                    for old, new in zip(self.stage_compute_s, compute_by_stage)]
        self.samples += 1

    def depth(self, *, cap: int, floor: int = 1, shares: Sequence[float] = ()) -> int | None:
        """The fill depth from what was observed, for these shares of the stages, with `HEADROOM`;
        None before the first microbatch."""
        if self.samples == 0:
            return None
        return fill_depth(self.latency_s * HEADROOM, self.stage_compute_s, cap=cap, floor=floor, shares=shares)


class WireFloor:
    """A call's time on the wire beyond the least its link ever took: its queueing there.

    A call's wire time is its round trip less the worker's compute and queue: the frames' transfer
    and propagation, and their waits behind other frames on the way. The least a link (one worker,
    one method: a Backward's frames are not a Forward's) ever took is that link's own time; what a
    call took beyond it, it waited.

    The least ever, not of a recent window: an uplink-bound trainer's uplink is never idle again once
    its pipeline is full, so every call of a window would have queued and the floor would climb with
    the queue it is there to measure (with no headroom, a 128-call window let a simulated trainer's
    depth creep from 6 to 12 in 20 s, and on). That is also why the first depth is one microbatch
    (`initial_depth`): the first calls on the first links go alone. The costs, both towards a
    shallower depth: a link that got slower for good counts the difference as queueing until its
    worker is forgotten (`links`, least recently used first); with jitter on the path the floor is
    the luckiest call and the others count their jitter as queueing.

    A link's first call cannot be compared with anything of its own, and a trainer spreading over a
    stage's replicas calls most of them first while its uplink queues (at 25 replicas a stage, its
    floors held the queue and a simulated trainer took 10 s of queueing for latency): its first call
    is taken to have queued what calls on known links queue now (`queued_s`, their moving average;
    they share the trainer's uplink)."""

    def __init__(self, links: int = _WIRE_LINKS):
        if links < 1:
            raise ValueError(f"links must be at least 1, got {links}")
        self.links = links
        self._floor: OrderedDict[Hashable, float] = OrderedDict()
        self.queued_s = 0.0  # moving average of what calls on known links queued: the uplink's queue now

    def beyond(self, link: Hashable, wire_s: float) -> float:
        """Record one call's `wire_s` on `link`; the seconds of it beyond the link's floor."""
        wire_s = max(0.0, wire_s)
        floor = self._floor.pop(link, None)
        if floor is None:
            if len(self._floor) >= self.links:
                self._floor.popitem(last=False)
            # A link's first call waited as long as the calls on known links wait now (they share the
            # trainer's uplink); with nothing queued, it is the link's own time.
            beyond = min(wire_s, self.queued_s)
            self._floor[link] = wire_s - beyond
            return beyond
        self._floor[link] = min(floor, wire_s)
        beyond = wire_s - self._floor[link]
        self.queued_s += SMOOTHING * (beyond - self.queued_s)
        return beyond


class InFlightLimit:
    """A semaphore whose limit can change while it is held (lowering it lets holders finish).

    Leaving never waits: a holder cancelled on its way out (a unit's microbatches stopped) still
    frees its place; with a lock to take on the way out, that place was lost for good, and enough
    such losses would leave every later microbatch waiting for ever."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self.active = 0
        self._waiters: deque[asyncio.Future] = deque()

    async def set(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self._wake()

    async def __aenter__(self) -> "InFlightLimit":
        while self.active >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        self.active += 1
        return self

    async def __aexit__(self, *exc) -> None:
        self.active -= 1
        self._wake()

    def _wake(self) -> None:
        """Every waiter looks again, in the order they came (those that find no room wait again)."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


def in_flight_limit(options: TrainerOptions, microbatches: int) -> int:
    """The most microbatches in flight: the fixed depth, half a global batch in synchronous mode, else
    the staleness cap (`max_staleness` global batches)."""
    if options.max_in_flight is not None:
        return options.max_in_flight
    if options.synchronous:
        return max(1, microbatches // 2)
    return max(1, round(options.max_staleness * microbatches))


def adaptive_depth(options: TrainerOptions) -> bool:
    """Whether the depth follows the measured pipeline (`fill_depth`)."""
    return options.max_in_flight is None and not options.synchronous


def depth_cap(max_in_flight: int, credit_cap: int | None, stage_credits: list[int]) -> int:
    """The most microbatches in flight now: the configured cap (staleness, or a fixed depth), within what
    the workers keep for this trainer between Forward and Backward (their in-flight credits, `credit_cap`),
    and within the calls they let it have outstanding over all stages: a microbatch in flight holds one
    such call or waits here for one, so a deeper pipeline would only wait here, growing staler."""
    cap = max_in_flight if credit_cap is None else min(max_in_flight, credit_cap)
    calls = sum(stage_credits)
    return max(1, min(cap, calls)) if calls else max(1, cap)


def initial_depth(max_in_flight: int, *, adaptive: bool, credit_cap: int | None = None,
                  stage_credits: Sequence[int] = ()) -> int:
    """The depth before the first microbatch is measured: one microbatch when adaptive, else the fixed
    cap within `depth_cap` of what the workers' records announce for a trainer new to them (a stage
    with no worker known yet counts as granting `MIN_CREDITS` calls).

    One, so that the first microbatch goes alone: its calls are the unqueued ones every link's
    `WireFloor` starts from, and its latency is the pipeline's own. Any deeper and the first calls
    queue behind each other on the trainer's uplink, the floors take that queue for the links' own
    time, and an uplink-bound trainer's depth climbs into its own send queue (a simulated one went to
    17 where 6 fill it, headroom aside). It costs one microbatch's latency at the start, once. Deeper than a worker
    keeps for this trainer, besides, its stash would evict forward inputs whose Backwards then fail,
    a burst of failures that bans a stage's only worker (a fixed depth is capped for that reason)."""
    if adaptive:
        return 1
    known = [credits or MIN_CREDITS for credits in stage_credits]
    return depth_cap(max_in_flight, credit_cap, known)


def resized_depth(estimate: DepthEstimate, *, adaptive: bool, max_in_flight: int, credit_cap: int | None,
                  stage_credits: list[int], stage_shares: Sequence[float] = ()) -> int | None:
    """The depth after a microbatch was observed: the fill depth for this trainer's `stage_shares`
    (`Roster.stage_shares`) within `depth_cap` when adaptive, else the cap itself; None before
    anything was observed."""
    cap = depth_cap(max_in_flight, credit_cap, stage_credits)
    return estimate.depth(cap=cap, shares=stage_shares) if adaptive else cap
