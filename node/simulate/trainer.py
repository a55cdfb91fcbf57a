"""A simulated trainer: units, microbatches, routing and the in-flight depth, in simulated time.

It runs as node/trainer/trainer.py does, calling the same decisions:
- Units from a `SimLeaseBoard` (dht/leases.py's `resolve`, node/trainer/units.py's
  `next_candidates`), at most `1 + ceil(depth cap / microbatches)` global batches open at once and
  as many claimed ahead, topped up behind as they are handed out.
- Every microbatch goes Forward through stages 0..S-2, the tail's one call, then Backward from
  S-2 down to 0 on the replicas its Forward took; each call's replica is `Roster.choose`
  (node/trainer/routing.py: earliest expected finish, balanced shares, credits), and the roster
  hears every call's round trip, compute and queueing (`Roster.succeeded`) as the real one does.
- The depth starts at `initial_depth` within the credits the workers' records announce, and after
  every microbatch becomes `resized_depth` (node/trainer/inflight.py) over a `DepthEstimate` fed its
  unqueued latency and compute; a call's wire time beyond its link's floor (`WireFloor`) is queueing,
  as the trainer counts it.
- A stage's replicas are told a global batch is done the moment its last microbatch has passed
  that stage (one round trip; each replica steps on its executor, in line behind the calls it holds,
  which takes `step_ms`), and a call
  to a replica first waits for the report sent to it last (node/trainer/batch_reports.py, `reported`), so the next
  batch meets stepped weights. Once every stage has taken its report the unit is committed (one
  DHT store).
The trainer's own work per microbatch (`cpu_ms`) is paid once per microbatch, before its first call,
one microbatch at a time (a trainer is one asyncio loop).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import simpy

from agora.node.simulate.network import NodeLink, path_rtt_s, transmit
from agora.node.simulate.workers import SimWorker
from agora.node.trainer.inflight import DepthEstimate, WireFloor, initial_depth, resized_depth
from agora.node.trainer.routing import Roster, WorkerView

__all__ = ["SimTrainer", "DepthLimit", "CallCosts"]

# How long a call that found no routable replica at all waits before it looks again.
_RETRY_S = 1.0


class DepthLimit:
    """The in-flight semaphore whose limit can change while it is held (inflight.py's InFlightLimit)."""

    def __init__(self, env: simpy.Environment, limit: int):
        self.env, self.limit, self.active = env, limit, 0
        self._waiting: list[simpy.Event] = []

    def acquire(self):
        while self.active >= self.limit:
            event = self.env.event()
            self._waiting.append(event)
            yield event
        self.active += 1

    def release(self) -> None:
        self.active -= 1
        self._wake()

    def set(self, limit: int) -> None:
        self.limit = limit
        self._wake()

    def _wake(self) -> None:
        waiting, self._waiting = self._waiting, []
        for event in waiting:
            event.succeed()


@dataclass(frozen=True)
class CallCosts:
    """What a call costs besides compute: frames each way (bytes) and the per-call overhead."""

    tokens: int
    forward_bytes: float  # a Forward's wire, and the tail's reply (the gradient) per microbatch
    backward_bytes: float
    overhead_s: float

    def frames(self, stage: int, stages: int, backward: bool) -> tuple[float, float]:
        """(request, reply) bytes of a call; the head's Forward carries token ids, its Backward's reply
        nothing the trainer relays."""
        ids = 4.0 * self.tokens
        if backward:
            return self.backward_bytes, (ids if stage == 0 else self.backward_bytes)
        request = ids if stage == 0 else self.forward_bytes
        reply = self.backward_bytes if stage == stages - 1 else self.forward_bytes
        return request, reply


@dataclass(eq=False)
class SimTrainer:
    env: simpy.Environment
    peer_id: str
    index: int
    link: NodeLink
    swarm: "object"  # the SimSwarm: its workers, version, rounds, board, cores
    stages: int
    microbatches: int
    max_in_flight: int
    adaptive: bool
    cpu_s: float
    costs: CallCosts
    credits: int
    roster: Roster = field(init=False)
    depth: DepthEstimate = field(init=False)
    wire_floor: WireFloor = field(init=False)
    limit: DepthLimit = field(init=False)
    tokens_done: list = field(default_factory=list)  # (time, tokens) per microbatch through the pipeline
    committed: list = field(default_factory=list)  # when each of its global batches was committed
    latencies: list = field(default_factory=list)
    _seen_version: int = -1

    def __post_init__(self):
        self.roster = Roster(microbatch_size=self.costs.tokens)
        self.depth = DepthEstimate(self.stages)
        self.wire_floor = WireFloor()
        self.limit = DepthLimit(self.env, initial_depth(self.max_in_flight, adaptive=self.adaptive))
        self._waiting = [deque() for _ in range(self.stages)]  # per stage, calls waiting for a credit
        self._woken = [False] * self.stages  # the first in line was let through to look again
        self.loop = simpy.Resource(self.env, capacity=1)
        self._reports: dict[str, simpy.Process] = {}  # peer -> the completed-batch report sent it last
        self._stage_reports: dict[int, list] = {}  # unit -> its reports so far
        self._passed_count: dict[int, list[int]] = {}  # unit -> microbatches done at each stage

    # ------------------------------------------------------------------ the roster
    def refresh(self) -> None:
        """What the DHT would say now (the workers' records), merged into the roster."""
        self._seen_version = self.swarm.version
        self.roster.refresh([WorkerView(
            peer_id=w.peer_id, endpoint=w.peer_id, stage=w.stage, phase=str(w.phase),
            announced_samples_per_s=self.costs.tokens / w.per_job_s, announced_queue=len(w.compute.queue),
            announced_credits=self.credits, announced_in_flight_credits=self.credits)
            for w in self.swarm.workers.values() if w.alive])

    def _pick(self, stage: int, shares: dict):
        """The replica `Roster.choose` gives; while none has a credit free, wait in line for a call to
        that stage to return (one waiter per return, first come first served), or for the swarm to change."""
        while True:
            if self._seen_version != self.swarm.version:
                self.refresh()
            if not self._waiting[stage] or self._woken[stage]:
                self._woken[stage] = False
                view = self.roster.choose(stage, self.env.now, shares=shares)
                if view is not None:
                    self.roster.started(view.peer_id)
                    return self.swarm.workers[view.peer_id]
            turn = self.env.event()
            self._waiting[stage].append(turn)
            if self.roster.held_back(stage, self.env.now):
                yield turn
            else:  # no replica to wait for: the swarm must change
                yield self.env.any_of([turn, self.env.timeout(_RETRY_S)])
                if not turn.triggered:
                    self._waiting[stage].remove(turn)

    def _returned_at(self, stage: int) -> None:
        """A call to `stage` returned: a credit there is free, the first in line may look again."""
        if self._waiting[stage]:
            self._woken[stage] = True
            self._waiting[stage].popleft().succeed()

    # ------------------------------------------------------------------ calls
    def _call(self, worker: SimWorker, job_s: float, stage: int, backward: bool, record: dict):
        request, reply = self.costs.frames(stage, self.stages, backward)
        began = self.env.now
        pending = self._reports.get(worker.peer_id)
        if pending is not None and not pending.triggered:
            yield pending
        yield from transmit(self.env, self.link, worker.link, request)
        yield from self.swarm.call_cpu(stage)  # the worker's gRPC threads, before its executor sees the call
        arrived = self.env.now
        worker.flow.heard_from(self.peer_id, 0.0)
        with worker.compute.request() as turn:
            yield turn
            queued = yield from self.swarm.compute(job_s, since=arrived)
            worker.busy_s += self.swarm.measured(job_s)
        yield from transmit(self.env, worker.link, self.link, reply)
        yield self.env.timeout(self.costs.overhead_s)
        seconds = self.env.now - began
        self.roster.succeeded(worker.peer_id, seconds, compute_s=job_s, queued_s=queued,
                              credits=self.credits, in_flight_credits=self.credits,
                              callers=worker.flow.active_callers())
        on_wire = self.wire_floor.beyond((worker.peer_id, backward), seconds - job_s - queued)
        record["compute"][stage] += job_s
        record["queued"] += queued + on_wire
        self._returned_at(stage)

    def _microbatch(self, unit: int, shares: list[dict]):
        yield from self.limit.acquire()
        began = self.env.now
        record = {"compute": [0.0] * self.stages, "queued": 0.0}
        with self.loop.request() as turn:  # one event loop: the trainer's own work is serial
            yield turn
            yield from self.swarm.compute(self.cpu_s, since=self.env.now)
        route = []
        for stage in range(self.stages):
            waiting_since = self.env.now
            worker = yield from self._pick(stage, shares[stage])
            record["queued"] += self.env.now - waiting_since  # a credit wait is queueing too, as the trainer counts it
            shares[stage][worker.peer_id] = shares[stage].get(worker.peer_id, 0) + 1
            worker.got_microbatches += 1
            route.append(worker)
            yield from self._call(worker, worker.job_s[0], stage, False, record)
        self._passed(unit, self.stages - 1)
        for stage in range(self.stages - 2, -1, -1):
            self.roster.started(route[stage].peer_id)
            yield from self._call(route[stage], route[stage].job_s[1], stage, True, record)
            self._passed(unit, stage)
        self.limit.release()
        self.tokens_done.append((self.env.now, self.costs.tokens))
        wall = self.env.now - began
        self.latencies.append(max(0.0, wall - record["queued"]))
        self.depth.observe(wall, record["compute"], record["queued"])
        depth = resized_depth(self.depth, adaptive=self.adaptive, max_in_flight=self.max_in_flight,
                              credit_cap=self.roster.in_flight_cap(self.stages),
                              stage_credits=self.roster.stage_credits(self.stages),
                              stage_shares=self.roster.stage_shares(self.stages))
        if depth is not None:
            self.limit.set(depth)
        self.swarm.board.renew(self.peer_id, unit)

    # ------------------------------------------------------------------ units
    def _passed(self, unit: int, stage: int) -> None:
        """A microbatch of `unit` is done at `stage`; after its last one the stage is told."""
        passed = self._passed_count.setdefault(unit, [0] * self.stages)
        passed[stage] += 1
        if passed[stage] == self.microbatches:
            told = [w for w in self.swarm.workers.values() if w.alive and w.stage == stage]
            reports = [self.env.process(self._report(worker, len(told))) for worker in told]
            for worker, report in zip(told, reports):
                self._reports[worker.peer_id] = report
            self._stage_reports.setdefault(unit, []).extend(reports)

    def _report(self, worker: SimWorker, replicas: int):
        """One completed-batch report: there, the replica's step, and back."""
        rtt = path_rtt_s(self.link, worker.link)
        yield self.env.timeout(rtt / 2)
        with worker.compute.request() as turn:  # a Step is a job on the replica's compute thread, FIFO with its calls
            yield turn
            step_s = self.swarm.step_s(worker)
            if step_s > 0:
                yield from self.swarm.compute(step_s, since=self.env.now)
        self.swarm.rounds.stepped(worker, self.microbatches * self.costs.tokens // max(1, replicas))
        yield self.env.timeout(rtt / 2)

    def _unit(self, unit: int):
        self.refresh()
        shares: list[dict] = [{} for _ in range(self.stages)]
        yield self.env.all_of([self.env.process(self._microbatch(unit, shares)) for _ in range(self.microbatches)])
        yield self.env.all_of(self._stage_reports.pop(unit, []))
        self._passed_count.pop(unit, None)
        for stage in range(self.stages):
            self.roster.batch_done(stage, shares[stage])
        yield from self.swarm.board.commit(self.peer_id, unit)
        self.committed.append(self.env.now)

    def run(self):
        self.refresh()
        self.limit.set(initial_depth(self.max_in_flight, adaptive=self.adaptive,
                                     credit_cap=self.roster.in_flight_cap(self.stages),
                                     stage_credits=self.roster.stage_credits(self.stages)))
        stripe = (self.index, self.swarm.trainer_count) if self.swarm.trainer_count > 1 else None
        window = 1 + math.ceil(self.max_in_flight / self.microbatches)
        pending: set = set()
        ready: deque = deque()  # units claimed ahead (node/trainer/units.py's `LeasedUnits`)
        claiming: list = []  # the claim round in flight behind, if any

        def claim_ahead():
            ready.extend((yield from self.swarm.board.claim(self.peer_id, stripe, window - len(ready))))
            claiming.clear()

        while True:
            while len(pending) < window:
                if not ready and claiming:
                    yield claiming[0]
                if not ready:
                    ready.extend((yield from self.swarm.board.claim(self.peer_id, stripe, 1 + window)))
                if not ready:
                    break
                pending.add(self.env.process(self._unit(ready.popleft())))
                if len(ready) < window and not claiming:
                    claiming.append(self.env.process(claim_ahead()))
            if not pending:
                yield self.env.timeout(1.0)
                continue
            yield self.env.any_of(list(pending))
            pending = {p for p in pending if not p.triggered}
