"""Flow control between one worker and its callers: credits sized from what the worker measures.

A trainer keeps many microbatches in flight (the report cuts a global batch into hundreds), and
several trainers share a worker. Without flow control the worker can only refuse what it cannot
hold (RESOURCE_EXHAUSTED), and a caller learns its limit by being refused. Here every Forward and
Backward reply tells its caller two numbers (`Credits`), and a caller that keeps to them is never
refused for being busy:

- `calls`: the Forward/Backward calls this caller may have outstanding here (queued or running).
  A credit spends a round trip outside the worker between two jobs (the reply travels to the
  caller, its next request travels back), so to keep the compute thread busy the calls
  outstanding must cover that round trip: `ceil(2 * round_trip / compute) + 4` (the
  bandwidth-delay product of this stage with a headroom of 2, and four more: one job running, one
  queued behind it, and one reply and one request between caller and worker, so the thread does not
  idle between jobs even at zero delay on a loaded host). The headroom is there
  because both terms vary from call to call (a job's compute, and the caller's turnaround, which
  on a loaded host is its own scheduling as much as the wire): a grant one BDP exactly idled the
  stages of a 3-stage loopback demo about a tenth of the time, while a grant too large only costs a
  few jobs queued. The round trip is the caller's own measurement of its calls
  here outside compute and queue (it sends it with each request); the compute time is this
  worker's moving average per job. A caller that reports nothing (0) gets the minimum, 4, until
  it does.
- `in_flight`: how many of this caller's microbatches this worker keeps between their Forward
  and their Backward: its equal share of the forward stash (0 on the tail, which keeps none). A
  trainer keeps its depth within the sum over a stage's replicas, so the stash never has to
  evict someone's pending work.

Several callers share one queue, sized once for the stage: the largest demand among the active
callers (those heard from within `active_s`), plus one per further caller for the phase noise
between them, at most the worker's `capacity` (the memory plan's in-flight depth). It is shared
max-min fairly (water-filling): a caller that needs less than an equal share keeps what it needs
and the rest is split among the others, so the credits add up to the queue. The sum, not each
caller, must cover the round trip: when four trainers feed one worker, each needs a quarter of
the queue to keep it busy, and granting each a whole one would only lengthen the queue (every
call waits behind the others' work, and the microbatches grow staler for nothing).

Credits are advice the worker's hard limits back: the slot pool (node/replica/bounds.py) still
refuses beyond `capacity` or beyond a caller's three quarters of it, and those refusals carry
when a slot is expected to free (`pushback_s`, sent as gRPC's `grpc-retry-pushback-ms`). A caller
acting on an older, larger grant is therefore served, not refused, and the grant it gets back
shrinks it to its share.

Pure and clock-injected: unit-tested without sockets (tests/integration/test_flow_control.py). The worker
updates it on its event loop, and a metrics scrape reads it from its own thread: one lock.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

__all__ = ["Credits", "FlowControl", "demand_for", "water_fill", "MIN_CREDITS", "HEADROOM", "MAX_ROUND_TRIP_S"]

# One job running, one queued, one reply and one request on their way: the least that keeps a
# compute thread busy at zero delay (module docstring).
MIN_CREDITS = 4
# Round trips' worth of jobs granted on top (module docstring): the product's variance headroom.
HEADROOM = 2.0
# A reported round trip above this is taken as this (a caller cannot claim the whole queue by
# reporting a huge one; its share is capped anyway).
MAX_ROUND_TRIP_S = 10.0
# Weight of the newest job in the compute time's moving average (about 10 jobs of memory).
_SMOOTHING = 0.1


@dataclass(frozen=True)
class Credits:
    """What one caller may hold at a worker now (see the module docstring)."""

    calls: int
    in_flight: int  # 0: no bound from this worker (the tail keeps no forward stash)


def demand_for(round_trip_s: float, compute_s: float | None) -> int:
    """Calls outstanding that keep a worker of `compute_s` per job busy across `round_trip_s`."""
    if compute_s is None or not compute_s > 0 or not round_trip_s > 0:
        return MIN_CREDITS
    return MIN_CREDITS + math.ceil(HEADROOM * min(round_trip_s, MAX_ROUND_TRIP_S) / compute_s - 1e-9)


def water_fill(total: int, demands: Mapping[str, int]) -> dict[str, int]:
    """Max-min fair integer shares of `total` for `demands`: nobody gets more than it asks, and
    whoever asks more than an equal share gets an equal share of what the others left. Every
    caller gets at least 1, even when that goes over `total` (the slot pool's hard bound then
    decides). Ties in what is left over go by name, so the answer is deterministic."""
    shares = {name: 0 for name in demands}
    left, open_ = max(0, total), sorted(demands, key=lambda name: (demands[name], name))
    while open_ and left > 0:
        equal = left // len(open_)
        if equal == 0:  # fewer slots than callers: one each to the first, by demand then name
            for name in open_[:left]:
                shares[name] += 1
            break
        satisfied = [name for name in open_ if demands[name] - shares[name] <= equal]
        if not satisfied:
            for name in open_:
                shares[name] += equal
            left -= equal * len(open_)
            continue
        for name in satisfied:
            left -= demands[name] - shares[name]
            shares[name] = demands[name]
        open_ = [name for name in open_ if name not in satisfied]
    return {name: max(1, share) for name, share in shares.items()}


@dataclass
class _Caller:
    round_trip_s: float
    seen_at: float


class FlowControl:
    """One worker's credits for its callers (see the module docstring).

    `capacity`: the most Forward/Backward calls it holds at once (its slot pool); `stash_capacity`:
    forward inputs it keeps for their Backward (None: the tail, which keeps none)."""

    def __init__(self, capacity: int, stash_capacity: int | None, *, active_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if stash_capacity is not None and stash_capacity < 1:
            raise ValueError(f"stash_capacity must be at least 1, got {stash_capacity}")
        if not active_s > 0:
            raise ValueError(f"active_s must be positive, got {active_s}")
        self.capacity = capacity
        self.stash_capacity = stash_capacity
        self.active_s = active_s
        self._clock = clock
        self._callers: dict[str, _Caller] = {}
        self._lock = threading.Lock()
        self.compute_s: float | None = None  # moving average of one job's compute

    # ------------------------------------------------------------------ what the worker observes

    def observe_compute(self, seconds: float) -> None:
        """One Forward/Backward job's time on the compute thread."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        self.compute_s = seconds if self.compute_s is None else self.compute_s + _SMOOTHING * (seconds - self.compute_s)

    def heard_from(self, owner: str, round_trip_s: float) -> None:
        """A request of `owner` was admitted, carrying its measured round trip (0: none yet)."""
        if not math.isfinite(round_trip_s) or round_trip_s < 0:
            round_trip_s = 0.0
        with self._lock:
            known = self._callers.get(owner)
            if known is not None and round_trip_s == 0:
                round_trip_s = known.round_trip_s  # a call that carries none keeps the last one it told
            self._callers[owner] = _Caller(min(round_trip_s, MAX_ROUND_TRIP_S), self._clock())

    # ------------------------------------------------------------------ what it grants

    def _active(self) -> dict[str, _Caller]:
        """The callers heard from within `active_s` (the others forgotten); under the lock."""
        horizon = self._clock() - self.active_s
        for owner in [owner for owner, caller in self._callers.items() if caller.seen_at < horizon]:
            del self._callers[owner]
        return self._callers

    def _demands(self, owner: str | None) -> dict[str, int]:
        demands = {name: demand_for(caller.round_trip_s, self.compute_s) for name, caller in self._active().items()}
        if owner is not None and owner not in demands:
            demands[owner] = MIN_CREDITS  # a caller not heard from yet (Info first): the minimum
        return demands

    def queue_target(self, demands: Mapping[str, int] | None = None) -> int:
        """The calls the worker holds across its callers: the largest demand, one more per further
        caller, at most `capacity`."""
        if demands is None:
            with self._lock:
                demands = self._demands(None)
        if not demands:
            return min(self.capacity, MIN_CREDITS)
        return min(self.capacity, max(demands.values()) + len(demands) - 1)

    def grant(self, owner: str | None) -> Credits:
        """What `owner` may hold now; None: what a caller new to this worker would get (its record)."""
        with self._lock:
            demands = self._demands(owner if owner is not None else "")
        calls = water_fill(self.queue_target(demands), demands)[owner if owner is not None else ""]
        return Credits(calls=calls, in_flight=self._in_flight_share(len(demands)))

    def _in_flight_share(self, callers: int) -> int:
        if self.stash_capacity is None:
            return 0
        return max(1, self.stash_capacity // max(1, callers))

    def active_callers(self) -> int:
        with self._lock:
            return len(self._active())

    def pushback_s(self, ahead: int) -> float:
        """When a slot is expected to free for a refused caller with `ahead` jobs before one of its own
        (or anyone's, for a full worker) finishes: that many jobs' compute, between 1 ms and 1 s."""
        per_job = self.compute_s if self.compute_s is not None else 0.01
        return min(1.0, max(0.001, max(1, ahead) * per_job))
