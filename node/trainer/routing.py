"""Which worker gets the next microbatch of a stage: pure decisions over observed state.

A trainer keeps a `Roster` per run: what the DHT says about every worker (throughput EMA,
queue depth, phase) merged with what this trainer saw itself (its own in-flight calls, the
durations it measured, errors). `choose` picks the worker with the earliest expected finish
time; failing peers are banned with exponential backoff. Nothing here touches a socket or the
wall clock: the caller passes `now`, so scheduling is unit-tested without a network.

Expected finish time of one more microbatch on worker w:
    (queued_ahead(w) + 1) * seconds_per_microbatch(w)
where queued_ahead is the larger of the worker's announced queue depth and this trainer's own
in-flight calls to it, and seconds_per_microbatch prefers this trainer's measured EMA, then the
worker's announced throughput, then (for a newcomer with neither) the slowest known worker's
rate plus a warm-up penalty, so new workers get traffic without being flooded.

Balanced shares. The replicas of a stage each step on their own share of every global batch,
dividing by the expected share (microbatches / replicas), so an uneven split makes one replica
step too far and another too short. Given the microbatches of the current batch each worker of
the stage already has, `pick_worker` takes the worker with the smallest share among those whose
time per microbatch is within `BALANCE_SLACK` of the fastest's (then the earliest finish). Speed
is the announced compute throughput when every candidate has one: a round trip includes
queueing, and a replica that gets no calls keeps its last, perhaps congested, measurement. A
replica over twice as slow is left to the earliest-finish rule, which gives it what it can
finish in time. Measured on tiny, 2 replicas, held-out loss / train-local: in-process, equal
shares 1.040 and random shares 1.048; in the swarm without any averaging, 1.108 before
balancing, 1.063 and 1.079 in two runs after (seeds 0 and 1, bench/averaging.py).

A replica left without traffic keeps the speed it had when it was last measured, so one that
was slow for a moment (a load spike, an averaging round) could stay "slow" for good: starved,
stepping on nothing, drifting from its stage until its averages no longer reach it. So a
routable replica that got no microbatch of `PROBE_AFTER` global batches in a row gets the next
one of the stage (`WorkerView.idle_batches`, kept by the trainer), which measures it afresh.

Blame. A worker may refuse a frame for values another worker produced (node/replica/request_frames.py
`ExtremeInput`); `producer_of_refused` says which worker of the route that was, and the trainer
counts the failure against it (`Roster.blamed`: its call had returned) rather than the refuser.

Exclusion. A worker whose replies the trainer's verifier flagged (node/trainer/verification.py) is
excluded for the rest of the run: it is in no stage's list, so it is neither picked, counted as a
replica, nor told of completed batches, whatever its record says.

Credits (flow control, node/worker/flow.py). Every reply of a worker says how many calls this
trainer may have outstanding there (`credits`) and how many of its microbatches the worker keeps
between Forward and Backward (`in_flight_credits`); before the first reply, what the worker's
record announces for a newcomer, else `MIN_CREDITS`. A worker holding as many of this trainer's
calls as its credits, or paused (it answered busy with a pushback), is not picked: the call
waits at the trainer for a credit (`held_back`) instead of being refused at the worker. A busy
answer is back-pressure, never a failure: no ban, no failure count; the credits shrink to the
calls still outstanding there, or the worker is paused for its pushback when none is. The
trainer's depth stays within `in_flight_cap`: the smallest sum over a stage's replicas of what
each keeps for it. A reply also says how many callers the worker serves (`callers`): the trainer's
share of a stage's compute (`share_of_stage`), which its depth is sized to fill (node/trainer/inflight.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from agora.dht.records import TRAINING_PHASES

__all__ = ["BALANCE_SLACK", "PROBE_AFTER", "MIN_CREDITS", "WorkerView", "Roster", "expected_finish_time",
           "pick_worker", "producer_of_refused"]

_NEWCOMER_PENALTY = 1.5
_DEFAULT_SECONDS = 1.0
# Replicas whose time per microbatch is within this factor of the fastest's share batches equally.
BALANCE_SLACK = 2.0
# Global batches in a row without a microbatch before a routable replica is probed (module docstring).
PROBE_AFTER = 3
# Calls outstanding at a worker that has stated no credits (an older worker, a record without them).
MIN_CREDITS = 2
# A busy worker with none of this trainer's calls is paused for its pushback, this long if it sent
# none, and never longer than the second figure (a pushback is a hint, not a ban).
_DEFAULT_PAUSE_S, _MAX_PAUSE_S = 0.05, 1.0
# Weight of the newest call in the moving average of a worker's round trip outside compute and queue.
_ROUND_TRIP_SMOOTHING = 0.2


@dataclass
class WorkerView:
    peer_id: str
    endpoint: str
    stage: int
    phase: str = "member"
    announced_samples_per_s: float = 0.0
    announced_queue: int = 0
    measured_seconds: float | None = None  # this trainer's EMA of one microbatch's round trip
    in_flight: int = 0
    failures: int = 0
    banned_until: float = 0.0
    successes: int = 0
    idle_batches: int = 0  # global batches in a row in which this trainer sent it no microbatch
    # Flow control (module docstring): what the record announces for a newcomer, what the worker's
    # last reply granted this trainer (None: no reply yet), and a pause after a busy answer.
    announced_credits: int = 0
    announced_in_flight_credits: int = 0
    granted_credits: int | None = None
    granted_in_flight_credits: int | None = None
    paused_until: float = 0.0
    round_trip_s: float | None = None  # moving average of a call's time outside the worker's compute and queue
    callers: int = 0  # callers its last reply said it serves, this trainer included (0: not stated)

    @property
    def credits(self) -> int:
        """Calls this trainer may have outstanding at the worker now."""
        if self.granted_credits is not None:
            return max(1, self.granted_credits)
        return self.announced_credits or MIN_CREDITS

    @property
    def in_flight_credits(self) -> int:
        """Microbatches of this trainer the worker keeps between Forward and Backward (0: no bound)."""
        if self.granted_in_flight_credits is not None:
            return self.granted_in_flight_credits
        return self.announced_in_flight_credits

    def has_credit(self, now: float) -> bool:
        return self.in_flight < self.credits and self.paused_until <= now

    def seconds_per_microbatch(self, microbatch_size: int) -> float | None:
        if self.measured_seconds is not None:
            return self.measured_seconds
        if self.announced_samples_per_s > 0:
            return microbatch_size / self.announced_samples_per_s
        return None


def _microbatch_seconds(view: WorkerView, microbatch_size: int, fallback_seconds: float) -> float:
    seconds = view.seconds_per_microbatch(microbatch_size)
    return fallback_seconds * _NEWCOMER_PENALTY if seconds is None else seconds


def expected_finish_time(view: WorkerView, microbatch_size: int, fallback_seconds: float) -> float:
    return (max(view.announced_queue, view.in_flight) + 1) * _microbatch_seconds(view, microbatch_size,
                                                                                fallback_seconds)


def _routable(view: WorkerView, now: float, exclude: frozenset[str] = frozenset()) -> bool:
    return view.phase in TRAINING_PHASES and view.banned_until <= now and view.peer_id not in exclude


def pick_worker(candidates: list[WorkerView], now: float, microbatch_size: int,
                exclude: frozenset[str] = frozenset(), shares: Mapping[str, int] | None = None) -> WorkerView | None:
    """The routable, unbanned candidate with a credit free and the earliest expected finish; ties by peer id.

    With `shares` (microbatches of the current global batch per peer id), the smallest share among
    the candidates within `BALANCE_SLACK` of the fastest (see the module docstring).
    """
    usable = [v for v in candidates if _routable(v, now, exclude) and v.has_credit(now)]
    if not usable:
        return None
    known = [s for v in usable if (s := v.seconds_per_microbatch(microbatch_size)) is not None]
    fallback = max(known) if known else _DEFAULT_SECONDS
    finish = {v.peer_id: expected_finish_time(v, microbatch_size, fallback) for v in usable}
    earliest = min(usable, key=lambda v: (finish[v.peer_id], v.peer_id))
    if shares is None:
        return earliest
    starved = [v for v in usable if v.idle_batches >= PROBE_AFTER and shares.get(v.peer_id, 0) == 0]
    if starved:  # measure it again (module docstring); one microbatch of this batch
        return min(starved, key=lambda v: (-v.idle_batches, v.peer_id))
    # Comparable speed, not the queue of the moment: equal shares even out the queues themselves.
    # The workers' announced compute throughput when every one has announced it (round trips
    # include queueing, and a replica that gets no calls keeps its last, maybe congested, one).
    if all(v.announced_samples_per_s > 0 for v in usable):
        seconds = {v.peer_id: microbatch_size / v.announced_samples_per_s for v in usable}
    else:
        seconds = {v.peer_id: _microbatch_seconds(v, microbatch_size, fallback) for v in usable}
    fastest = min(seconds.values())
    if seconds[earliest.peer_id] > BALANCE_SLACK * fastest:
        # The fast replicas are queued: a slower one finishes first, as without balancing. It also
        # keeps its measured time current, so a replica that was slow for a while is not starved.
        return earliest
    comparable = [v for v in usable if seconds[v.peer_id] <= BALANCE_SLACK * fastest]
    return min(comparable, key=lambda v: (shares.get(v.peer_id, 0), finish[v.peer_id], v.peer_id))


def producer_of_refused(route_length: int, stage: int, *, backward: bool, field: str) -> int | None:
    """The route index of the worker that produced the frame the worker at `stage` refused: a Forward's
    `wire` is the output of the stage before, a Backward's `output_grad` the input gradient of the stage
    after. None when the refusal names a frame that call did not carry from another worker (a head's
    Forward has no wire; a Forward has no output_grad): the refuser's claim is then its own failure."""
    producer, carried = (stage + 1, "output_grad") if backward else (stage - 1, "wire")
    return producer if field == carried and 0 <= producer < route_length else None


@dataclass
class Roster:
    """A trainer's view of the swarm, refreshed from DHT records and its own observations."""

    microbatch_size: int
    ema_decay: float = 0.8
    ban_base_s: float = 2.0
    ban_max_s: float = 120.0
    workers: dict[str, WorkerView] = field(default_factory=dict)
    # Peers this trainer no longer routes to for the rest of the run (whatever their records say):
    # their replies were found to be lies (node/trainer/verification.py).
    excluded: set[str] = field(default_factory=set)
    # The workers by stage, None until asked for again: every call routes through `of_stage` once per
    # stage, and a scan of every stage's workers grew a trainer's routing work with the whole swarm
    # (7 stages x 100 replicas: 700 views per call, 4,900 more for the depth's credit figures). Only
    # `refresh` and `exclude` change who is on a stage, and each drops it.
    _by_stage: dict[int, list[WorkerView]] | None = field(default=None, init=False, repr=False, compare=False)

    def refresh(self, announced: list[WorkerView]) -> None:
        """Replace the DHT-derived fields; keep local observations of workers still present."""
        fresh = {}
        for view in announced:
            known = self.workers.get(view.peer_id)
            if known is not None and known.endpoint == view.endpoint:
                known.phase, known.stage = view.phase, view.stage
                known.announced_samples_per_s = view.announced_samples_per_s
                known.announced_queue = view.announced_queue
                known.announced_credits = view.announced_credits
                known.announced_in_flight_credits = view.announced_in_flight_credits
                view = known
            fresh[view.peer_id] = view
        self.workers = fresh
        self._by_stage = None

    def of_stage(self, stage: int) -> list[WorkerView]:
        """The workers of `stage` this trainer routes to (excluded peers are not among them)."""
        if self._by_stage is None:
            self._by_stage = {}
            for view in self.workers.values():
                if view.peer_id not in self.excluded:
                    self._by_stage.setdefault(view.stage, []).append(view)
        return list(self._by_stage.get(stage, ()))

    def exclude(self, peer_id: str) -> None:
        """Never route to this peer again in this run."""
        self.excluded.add(peer_id)
        self._by_stage = None

    def _sharing(self, stage: int) -> list[WorkerView]:
        """The replicas of `stage` sharing its work now: routable, and their last call did not fail."""
        return [v for v in self.of_stage(stage) if v.phase in TRAINING_PHASES and v.failures == 0]

    def replicas(self, stage: int) -> int:
        """How many replicas of `stage` share its work now (at least 1)."""
        return max(1, len(self._sharing(stage)))

    def share_of_stage(self, stage: int) -> float:
        """The replicas' worth of `stage`'s compute this trainer gets: a worker serves its callers about
        equally, so 1 / callers of each replica sharing the work (a whole one where its replies state
        no callers yet). A stage none of whose replicas shares the work now (all failing) counts as one
        whole replica, as in `replicas`: the depth is not cut by a blip."""
        sharing = self._sharing(stage)
        return sum(1.0 / max(1, v.callers) for v in sharing) if sharing else 1.0

    def stage_shares(self, stages: int) -> list[float]:
        """`share_of_stage` for each of the first `stages` stages."""
        return [self.share_of_stage(stage) for stage in range(stages)]

    def batch_done(self, stage: int, shares: Mapping[str, int]) -> None:
        """A global batch passed `stage` with these microbatches per replica: count who got none."""
        for view in self.of_stage(stage):
            view.idle_batches = 0 if shares.get(view.peer_id, 0) else view.idle_batches + 1

    def choose(self, stage: int, now: float, exclude: frozenset[str] = frozenset(),
               shares: Mapping[str, int] | None = None) -> WorkerView | None:
        return pick_worker(self.of_stage(stage), now, self.microbatch_size, exclude, shares)

    def held_back(self, stage: int, now: float, exclude: frozenset[str] = frozenset()) -> bool:
        """Whether `stage` has routable workers that only lack a credit (or are paused after a busy
        answer): the call waits for one to free, rather than for the swarm to change."""
        return any(_routable(v, now, exclude) and not v.has_credit(now) for v in self.of_stage(stage))

    def next_pause_end(self, stage: int, now: float) -> float | None:
        """When the first paused worker of `stage` may be called again (None: none is paused)."""
        ends = [v.paused_until for v in self.of_stage(stage) if v.paused_until > now]
        return min(ends, default=None)

    def in_flight_cap(self, stages: int) -> int | None:
        """The most microbatches this trainer may have between Forward and Backward: per stage the sum
        of what its routable replicas keep for it, the smallest over the stages that keep any. None:
        no stage states a bound."""
        caps = []
        for stage in range(stages):
            keeps = [v.in_flight_credits for v in self.of_stage(stage) if v.phase in TRAINING_PHASES]
            if keeps and all(keeps):
                caps.append(sum(keeps))
        return min(caps, default=None)

    def credits_of_stage(self, stage: int) -> int:
        """Calls this trainer may have outstanding on `stage`, over its routable replicas."""
        return sum(v.credits for v in self.of_stage(stage) if v.phase in TRAINING_PHASES)

    def stage_credits(self, stages: int) -> list[int]:
        """`credits_of_stage` for each of the first `stages` stages."""
        return [self.credits_of_stage(stage) for stage in range(stages)]

    def started(self, peer_id: str) -> None:
        if peer_id in self.workers:
            self.workers[peer_id].in_flight += 1

    def succeeded(self, peer_id: str, seconds: float, *, compute_s: float = 0.0, queued_s: float = 0.0,
                  credits: int = 0, in_flight_credits: int = 0, callers: int = 0) -> None:
        """A call returned after `seconds`, of which the worker spent `compute_s` and `queued_s`; its
        reply granted `credits` and `in_flight_credits` (0 credits: it states none) and said it serves
        `callers` (0: not stated, the last statement stands)."""
        view = self.workers.get(peer_id)
        if view is None:
            return
        view.in_flight = max(0, view.in_flight - 1)
        view.successes += 1
        view.failures = 0
        view.measured_seconds = seconds if view.measured_seconds is None else \
            self.ema_decay * view.measured_seconds + (1 - self.ema_decay) * seconds
        outside = max(0.0, seconds - compute_s - queued_s)
        view.round_trip_s = outside if view.round_trip_s is None else \
            view.round_trip_s + _ROUND_TRIP_SMOOTHING * (outside - view.round_trip_s)
        if credits > 0:
            view.granted_credits, view.granted_in_flight_credits = credits, in_flight_credits
        if callers > 0:
            view.callers = callers

    def released(self, peer_id: str) -> None:
        """A call picked for this worker was never sent (cancelled while it waited)."""
        view = self.workers.get(peer_id)
        if view is not None:
            view.in_flight = max(0, view.in_flight - 1)

    def busy(self, peer_id: str, now: float, pushback_s: float | None) -> None:
        """The worker refused a call for being full (RESOURCE_EXHAUSTED): back-pressure, not a failure.
        With calls of this trainer still there, wait for one of them (its reply brings fresh credits);
        with none, pause it for the worker's pushback (or a short default)."""
        self.released(peer_id)
        view = self.workers.get(peer_id)
        if view is None:
            return
        if view.in_flight > 0:
            view.granted_credits = view.in_flight
        else:
            pause = pushback_s if pushback_s is not None and pushback_s > 0 else _DEFAULT_PAUSE_S
            view.paused_until = max(view.paused_until, now + min(pause, _MAX_PAUSE_S))

    def failed(self, peer_id: str, now: float) -> float:
        """Record a failed call (the worker is dead, wrong, or refused the request); returns the ban length."""
        self.released(peer_id)
        return self.blamed(peer_id, now)

    def blamed(self, peer_id: str, now: float) -> float:
        """Count a failure against a worker whose call has returned already (its output was refused
        downstream, node/trainer/blame.py); returns the ban length, as `failed`."""
        view = self.workers.get(peer_id)
        if view is None:
            return 0.0
        view.failures += 1
        ban = min(self.ban_base_s * 2 ** (view.failures - 1), self.ban_max_s)
        view.banned_until = max(view.banned_until, now + ban)
        return ban
