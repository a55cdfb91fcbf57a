"""How many microbatches a trainer keeps in flight: enough to fill the pipe, no more.

A microbatch alone takes `latency` to go through the pipeline: every stage's compute plus every
call's round trip and the trainer's own work between calls (queueing excluded: that is what too
many in flight causes, and counting it would make the depth feed on itself). The busiest stage
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

More in flight than that buys nothing (the bottleneck is already busy) and costs convergence: a
microbatch started before a worker steps finishes on newer weights, and the staleness is about
depth / microbatches-per-batch optimizer steps. So the depth is also capped (`cap`), which the
trainer derives from `--max-staleness` (global batches).

`fill_depth` is the pure rule (unit-tested); `DepthEstimate` keeps the moving averages the
trainer feeds it from every training microbatch; `InFlightLimit` is the resizable semaphore.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.routing import MIN_CREDITS

__all__ = ["fill_depth", "in_flight_limit", "adaptive_depth", "depth_cap", "initial_depth", "resized_depth",
           "DepthEstimate", "InFlightLimit", "SMOOTHING"]

# Weight of the newest microbatch in the moving averages: ~10 microbatches of memory.
SMOOTHING = 0.1


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
        """The fill depth from what was observed, for these shares of the stages; None before the
        first microbatch."""
        if self.samples == 0:
            return None
        return fill_depth(self.latency_s, self.stage_compute_s, cap=cap, floor=floor, shares=shares)


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


def initial_depth(max_in_flight: int, microbatches: int, *, adaptive: bool, credit_cap: int | None = None,
                  stage_credits: Sequence[int] = ()) -> int:
    """The depth before the first microbatch is measured: half a global batch when adaptive, else the
    fixed cap; either way within `depth_cap` of what the workers' records announce for a trainer new to
    them. A stage with no worker known yet counts as granting `MIN_CREDITS` calls.

    Nothing is measured before the first microbatch ends, and by then the first depth's worth is in
    flight: deeper than a worker keeps for this trainer, its stash evicts forward inputs whose
    Backwards then fail, a burst of failures that bans a stage's only worker (backoff up to
    `Roster.ban_max_s`) and stalls the run. Half of a 256-microbatch batch is twice a default stash (64)."""
    known = [credits or MIN_CREDITS for credits in stage_credits]
    cap = depth_cap(max_in_flight, credit_cap, known)
    return min(cap, max(1, microbatches // 2)) if adaptive else cap


def resized_depth(estimate: DepthEstimate, *, adaptive: bool, max_in_flight: int, credit_cap: int | None,
                  stage_credits: list[int], stage_shares: Sequence[float] = ()) -> int | None:
    """The depth after a microbatch was observed: the fill depth for this trainer's `stage_shares`
    (`Roster.stage_shares`) within `depth_cap` when adaptive, else the cap itself; None before
    anything was observed."""
    cap = depth_cap(max_in_flight, credit_cap, stage_credits)
    return estimate.depth(cap=cap, shares=stage_shares) if adaptive else cap
