"""`StageService`: the agora.v1.Stage calls of a StageWorker, admitted, run and answered.

Design choices:
- Apart from the worker (node/worker/worker.py: lifecycle, phase, the compute thread, Info), so
  what one call goes through reads in one place, as node/inference/service.py does for inference.
  The service holds what admission needs (the queue slots, the callers' credits, the unit gate);
  what it needs of its worker is `ServedStage`, a Protocol, so this module never imports the worker.
- Admission is bounded, and happens before anything is allocated for a request (node/replica/bounds.py):
  caller, run/stage addressing, the shapes its frames declare (rows <= train.microbatch_size or
  `max_rows`, sequence <= train.seq_len, wire width = model.wire_dim; INVALID_ARGUMENT naming the
  field and both values), then a queue slot. `load` counts Forward/Backward requests admitted but
  not finished (queued or running); at `max_queue` (by default the stash's capacity: the in-flight
  depth the memory plan sized), or at `max_queue_per_caller` for one caller identity, the worker
  answers RESOURCE_EXHAUSTED at once instead of queueing without bound, with the time a slot is
  expected to free (`grpc-retry-pushback-ms`). Callers rarely get there: every Forward/Backward
  reply carries the caller's credits (node/worker/flow.py), its share of a queue sized to keep the
  compute thread busy across the callers' round trips, and a trainer keeps within them. A request
  leaves the count when its compute job finishes (or is cancelled before it starts), not when its
  caller gives up: a job already on the thread still occupies it. A stream is admitted on its first
  part and read under the byte budget of the geometry, within `stream_timeout_s`; one gRPC message
  is capped by the same budget, and `max_concurrent_rpcs` caps the calls served at once, so what a
  worker holds for its callers is bounded in sum; health checks and reflection are served from a
  pool of their own (`max_probe_calls`, node/rpc/call_slots.py), so Watch streams held open never
  take a trainer's call. Step and Abort are admitted the same way into a pool of their own
  (`max_control_queue`): a barrier or the Abort of a failed route must get through a worker full of
  that same trainer's work. Info never reaches the compute thread.
- A peer's mistake maps to a status with a clear message: InvalidRequest -> INVALID_ARGUMENT (with
  `agora-refused-input: wire|output_grad` in its trailing metadata when the values the previous
  stage's worker produced are at fault: the trainer then blames that worker; counted as
  `extreme_wire` / `extreme_output_grad`),
  PreconditionFailed (including an unknown/evicted microbatch) -> FAILED_PRECONDITION, a
  completed-batch report outside the replica's window -> OUT_OF_RANGE (the trainer keeps reporting), a
  non-finite result from finite weights (the input's fault: extreme values) -> INVALID_ARGUMENT,
  from weights that are no longer finite (this worker's fault) -> INTERNAL; gRPC itself answers
  RESOURCE_EXHAUSTED for a message over the geometry's budget (or `max_message_bytes`), the stream
  reassembler for a stream over it, naming it; an unexpected exception in compute is logged with
  its traceback and answered INTERNAL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Protocol, TypeVar

import grpc

from agora.dht.records import Phase
from agora.node.rpc.auth_check import Caller, RefusalCounts, current_caller
from agora.node.rpc.tracing import annotate_job
from agora.node.replica.bounds import (
    OutOfBounds,
    RequestGeometry,
    Slot,
    SlotPool,
    SlotRefused,
    default_per_caller,
)
from agora.node.replica.compute import StageCompute
from agora.node.worker.flow import FlowControl
from agora.node.worker.work_gate import WorkGate
from agora.node.replica.request_frames import (
    ComputeError,
    DuplicateMicrobatch,
    ExtremeInput,
    InvalidRequest,
    NotOwner,
    PreconditionFailed,
    ReportOutsideWindow,
    RequestRejected,
)
from agora.node.worker.options import WorkerOptions
from agora.monitor.worker_metrics import WorkerMetrics
from agora.pipeline.codec import peek_header
from agora.protos.stage_adapter import (
    PUSHBACK_METADATA,
    REFUSED_INPUT_METADATA,
    AbortReply,
    AbortRequest,
    BackwardReply,
    BackwardRequest,
    ForwardReply,
    ForwardRequest,
    InfoReply,
    InfoRequest,
    StageRefusal,
    StepReply,
    StepRequest,
)

__all__ = ["JobTimes", "ServedStage", "StageService"]

T = TypeVar("T")


@dataclass
class _Admission:
    """A Forward/Backward admitted into a queue slot (a `StreamAdmission` for the stage adapter)."""

    caller: Caller
    slot: Slot
    max_bytes: int  # payload bytes a streamed request may carry
    budget: str  # how max_bytes follows from the geometry, for the refusal

    def close(self) -> None:
        self.slot.close()


class ServedStage(Protocol):
    """What a StageService needs of the worker it serves (a StageWorker): its stage and bounds, its
    replica and phase, its compute thread, and its Info."""

    stage_index: int
    options: WorkerOptions
    geometry: RequestGeometry
    refusals: RefusalCounts

    @property
    def compute(self) -> StageCompute: ...

    @property
    def phase(self) -> Phase: ...

    def submit_compute(self, fn: Callable[[StageCompute], T], slot: Slot | None = None) -> Future: ...

    def info(self, owner: str | None = None) -> InfoReply: ...


@dataclass
class JobTimes:
    """The compute thread's Forward and Backward jobs in all, and apart its Step and Abort jobs: their
    wall time, and the thread's CPU time in them (`time.thread_time`; torch's intra-op threads beside it are not in it: a worker
    with one thread has none). Where other processes share the host's cores the wall time holds the
    job's waits for a core and the CPU time does not: what a model of a shared host needs as a job's
    demand. Written by the compute thread alone."""

    jobs: int = 0
    compute_s: float = 0.0
    cpu_s: float = 0.0
    # Step and Abort jobs (a completed-batch report's optimizer step, mostly), on the same thread.
    control_jobs: int = 0
    control_s: float = 0.0
    control_cpu_s: float = 0.0
    control_queued_s: float = 0.0  # from admission to the thread: in line behind the calls before it

    def add(self, compute_s: float, cpu_s: float) -> None:
        self.jobs += 1
        self.compute_s += compute_s
        self.cpu_s += max(0.0, cpu_s)

    def add_control(self, seconds: float, cpu_s: float, queued_s: float = 0.0) -> None:
        self.control_jobs += 1
        self.control_s += seconds
        self.control_cpu_s += max(0.0, cpu_s)
        self.control_queued_s += max(0.0, queued_s)

    def snapshot(self) -> dict:
        return {"jobs": self.jobs, "compute_s": round(self.compute_s, 6), "compute_cpu_s": round(self.cpu_s, 6),
                "control_jobs": self.control_jobs, "control_s": round(self.control_s, 6),
                "control_cpu_s": round(self.control_cpu_s, 6), "control_queued_s": round(self.control_queued_s, 6)}


class StageService:
    """The agora.v1.Stage handlers (see protos/stage_adapter.StageHandler): each call's admission
    (module docstring), its run on the worker's compute thread, and the status its failure maps to.
    It holds the worker's queue slots and its callers' credits."""

    def __init__(self, worker: ServedStage, *, clock: Callable[[], float], logger: logging.Logger,
                 metrics: Optional[WorkerMetrics], gate: Optional[WorkGate]):
        self._worker = worker
        self._stage = worker.stage_index
        self._options = options = worker.options
        self._geometry = worker.geometry
        self._refusals = worker.refusals
        self._logger = logger
        self._metrics = metrics
        self._gate = gate
        self.compute_errors = 0  # calls failed on this replica's own non-finite result
        self.job_times = JobTimes()
        self.slots = SlotPool(f"stage {self._stage} worker", options.queue_capacity, options.queue_per_caller,
                              option="worker.max_queue_per_caller")
        # Credits for each caller (node/worker/flow.py); the tail keeps no forward stash.
        self.flow = FlowControl(options.queue_capacity, None if self._geometry.is_tail else options.stash_capacity,
                                clock=clock)
        control = options.control_queue
        self.control_slots = SlotPool(f"stage {self._stage} worker's Step/Abort queue", control,
                                       default_per_caller(control), option="three quarters of max_control_queue")

    async def admit_stream(self, head: ForwardRequest | BackwardRequest, context: Any) -> _Admission:
        return await self._admit(head, partial=True)

    async def forward(self, request: ForwardRequest, context: Any, admission: _Admission | None = None) -> ForwardReply:
        return await self._serve_admitted(context, request, admission, self._worker.compute.forward)

    async def backward(self, request: BackwardRequest, context: Any,
                       admission: _Admission | None = None) -> BackwardReply:
        return await self._serve_admitted(context, request, admission, self._worker.compute.backward)

    async def _control(self, context: Any, run_id: str, stage: int, fn: Callable[[Caller], Any]) -> Any:
        """Step and Abort: admitted like the rest, into their own bounded pool (module docstring)."""
        caller = self._caller()
        self._check_addressing(run_id, stage)
        slot = self._slot(self.control_slots, caller)
        try:
            return await self._run(context, slot, lambda _: fn(caller), None)
        finally:
            slot.close()

    async def step(self, request: StepRequest, context: Any) -> StepReply:
        if request.completed_batch is not None and self._gate is not None:  # a unit's report: its holder's only
            self._check_addressing(request.run_id, request.stage)
            await self._gate.check_unit(self._caller(), request.completed_batch)
        return await self._control(context, request.run_id, request.stage,
                                   lambda caller: self._worker.compute.step(request, caller.owner))

    async def abort(self, request: AbortRequest, context: Any) -> AbortReply:
        if self._gate is not None:
            self._gate.aborted(current_caller(), request.microbatch_id)
        return await self._control(context, request.run_id, request.stage,
                                   lambda caller: self._worker.compute.abort(request, caller.owner))

    async def info(self, request: InfoRequest, context: Any) -> InfoReply:
        caller = current_caller()
        return self._worker.info(None if caller is None else caller.owner)

    def _refused(self, code: grpc.StatusCode, message: str, reason: str | None = None) -> StageRefusal:
        if reason is not None:
            self._refusals.add(reason)
        return StageRefusal(code, message)

    def _caller(self) -> Caller:
        caller = current_caller()
        if caller is None:  # CallerCheck runs ahead of every handler; fail closed if it did not
            raise self._refused(grpc.StatusCode.INTERNAL, "no caller identity for this call")
        return caller

    def _check_addressing(self, run_id: str, stage: int) -> None:
        """Refuse misaddressed calls on the loop, before they take a queue slot; every training call
        comes through here, so a serve-only worker refuses them here too."""
        if self._options.serve_only:
            raise self._refused(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this stage {self._stage} worker serves inference only (join --serve-only): it takes "
                                "no Forward, Backward, Step or Abort", "serve_only")
        try:
            self._worker.compute.check_addressing(run_id, stage)
        except RequestRejected as error:
            raise self._refused(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None

    def _check_shapes(self, request: Any, *, partial: bool) -> None:
        try:
            if isinstance(request, ForwardRequest):
                self._geometry.check_forward(request, partial=partial)
            else:
                self._geometry.check_backward(request, partial=partial)
        except OutOfBounds as error:
            raise self._refused(grpc.StatusCode.INVALID_ARGUMENT, str(error), "out_of_bounds") from None

    def _slot(self, pool: SlotPool, caller: Caller) -> Slot:
        try:
            return pool.acquire(caller.owner)
        except SlotRefused as error:
            # A full worker is routine load; one caller at its share is worth counting. Either way the
            # refusal says when a slot should free: the next job for a full pool, the caller's earliest
            # own job (at most the others' jobs ahead of it) when it holds its share.
            ahead = 1 if error.reason == "full" else pool.in_use - pool.held_by(caller.owner) + 1
            pushback_ms = max(1, round(1e3 * self.flow.pushback_s(ahead)))
            refusal = self._refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error),
                                    "caller_limit" if error.reason == "caller_limit" else None)
            refusal.trailing_metadata = ((PUSHBACK_METADATA, str(pushback_ms)),)
            raise refusal from None

    async def _admit(self, request: ForwardRequest | BackwardRequest, *, partial: bool) -> "_Admission":
        """Caller, addressing, declared shapes, the unit's holder, then a queue slot: cheapest first,
        the slot last so that a refused request never holds one. `partial`: a stream's first part."""
        caller = self._caller()
        self._check_addressing(request.run_id, request.stage)
        if self._worker.phase == Phase.WEIGHT_SYNC:  # trainers do not route here; one with a stale view is told why
            raise self._refused(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this stage {self._stage} replica is in weight sync: it has not got the stage's "
                                "state yet and takes no Forward or Backward; route to a member", "weight_sync")
        self._check_shapes(request, partial=partial)
        forward = isinstance(request, ForwardRequest)
        if self._gate is not None:
            await self._gate.admit(caller, request)
        budget = self._geometry.forward_budget() if forward else self._geometry.backward_budget()
        slot = self._slot(self.slots, caller)
        self.flow.heard_from(caller.owner, request.round_trip_s)
        return _Admission(caller, slot, min(budget, self._options.max_stream_bytes),
                          self._geometry.describe_budget("Forward" if forward else "Backward"))

    async def _serve_admitted(self, context: Any, request: ForwardRequest | BackwardRequest,
                              admission: "_Admission | None", compute: Callable[..., T]) -> T:
        """Run an admitted Forward/Backward (a unary one is admitted here) in its slot."""
        if admission is None:
            admission = await self._admit(request, partial=False)
            try:
                reply = await self._run(context, admission.slot, partial(compute, owner=admission.caller.owner),
                                        request)
            finally:
                admission.close()
        else:
            self._check_shapes(request, partial=False)  # a stream admitted on its first part is whole now
            reply = await self._run(context, admission.slot, partial(compute, owner=admission.caller.owner), request)
        annotate_job(reply.queued_s, reply.compute_s)  # on the call's span, where it is traced
        if self._metrics is not None and isinstance(request, ForwardRequest) and not request.evaluate:
            self._metrics.served(admission.caller.owner, _job_tokens(request))  # what a trainer's receipts may claim
        return self._credited(admission.caller.owner, reply)

    def _credited(self, owner: str, reply: T) -> T:
        """The reply with the caller's credits now (node/worker/flow.py), its job's compute time counted,
        and how many callers share this worker (the caller's share of its compute)."""
        self.flow.observe_compute(reply.compute_s)
        credits = self.flow.grant(owner)
        return dataclasses.replace(reply, credits=credits.calls, in_flight_credits=credits.in_flight,
                                   callers=self.flow.active_callers())

    async def _run(self, context: Any, slot: Slot, fn: Callable[[Any], T], request: Any) -> T:
        admitted = time.perf_counter()

        def timed(request: Any) -> T:
            started, cpu_started = time.perf_counter(), time.thread_time()
            reply = fn(request)
            if hasattr(reply, "compute_s"):  # Forward/Backward replies report where the time went
                reply = dataclasses.replace(reply, queued_s=started - admitted,
                                            compute_s=time.perf_counter() - started)
                cpu_s = time.thread_time() - cpu_started
                self.job_times.add(reply.compute_s, cpu_s)
                if self._metrics is not None:
                    self._metrics.observe_job(type(request).__name__.removesuffix("Request"), _job_tokens(request),
                                              reply.queued_s, reply.compute_s, cpu_s)
            else:  # a Step or an Abort: the thread's time in it, beside the compute's
                self.job_times.add_control(time.perf_counter() - started, time.thread_time() - cpu_started,
                                           started - admitted)
            return reply

        # the slot is freed when the job ends, not when the caller gives up
        future = self._worker.submit_compute(lambda _compute: timed(request), slot)
        return await self._answer(context, future)

    async def _answer(self, context: Any, future: Future) -> Any:
        try:
            return await asyncio.wrap_future(future)
        except ExtremeInput as error:  # the previous stage's values: the caller learns which frame
            self._refusals.add(f"extreme_{error.field}")
            self._logger.info("stage %d refused a request's %s: %s", self._stage, error.field, error,
                              extra={"milestone": "extreme_input_refused",
                                     "fields": {"stage": self._stage, "field": error.field}})
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error), ((REFUSED_INPUT_METADATA, error.field),))
        except InvalidRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except ReportOutsideWindow as error:  # the trainer keeps reporting: the replica may re-anchor
            self._refusals.add("report_outside_window")
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(error))
        except PreconditionFailed as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except NotOwner as error:
            self._refusals.add("not_owner")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))
        except DuplicateMicrobatch as error:
            self._refusals.add("duplicate_microbatch")
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(error))
        except ComputeError as error:
            self.compute_errors += 1
            self._logger.warning("stage %d compute error: %s", self._stage, error)
            await context.abort(grpc.StatusCode.INTERNAL, str(error))
        except Exception as error:  # our bug, not the peer's: keep the traceback here, keep serving
            self._logger.exception("stage %d: unexpected failure in compute", self._stage)
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"stage {self._stage} failed: {type(error).__name__}: {error}")


def _job_tokens(request: ForwardRequest | BackwardRequest) -> int:
    """Tokens a job computed, from the shape its frame declares (checked at admission)."""
    frame, kind = (request.tokens, "token") if isinstance(request, ForwardRequest) else (request.output_grad, "float")
    header = peek_header(frame, kind)
    return 0 if header is None else math.prod(header.shape[:2])
