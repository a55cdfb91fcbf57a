"""The worker's inference service: Prefill, Decode and CloseSession of agora.v1.Stage.

Registered on the worker's own grpc.aio server beside the training handlers
(`add_stage_service(..., inference=...)`), behind the same interceptor chain: the caller's
credential and role are checked per call (auth/grpc_policy.py: a client, trainer or operator),
and so is the run fingerprint.

Admission, on the event loop and before anything is allocated, cheapest first as for training
(node/replica/bounds.py): the caller, run and stage addressing, the shapes the frames declare
(rows, positions per call at most the worker's tokens per session, the wire's width), then a
queue slot from a pool of the service's own (`InferenceOptions.max_queue`, at most three
quarters of it per caller): serving never takes training's slots, nor training serving's.
Admitted calls run on the stage's compute thread (node/inference/engine.py says why) and answer:

| engine error | status |
|---|---|
| InvalidRequest (bad frames, session id, a Prefill not at position 0) | INVALID_ARGUMENT |
| UnknownSession (not held: evicted, expired, never opened) | NOT_FOUND naming the session: replay it |
| SessionBehind (a Decode after positions not held) | FAILED_PRECONDITION: replay it |
| SessionRefused, SessionTooLong (over the session's or the model's bound) | OUT_OF_RANGE naming the bound |
| SessionsFull (the caches would pass the worker's budget for them) | RESOURCE_EXHAUSTED, counted (`kv_cache_budget`) |
| NotSessionOwner | PERMISSION_DENIED |
| anything else (our bug) | INTERNAL, logged with its traceback |
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable, Optional

import grpc

from agora.node.inference.engine import InferenceEngine, SessionBehind
from agora.node.inference.options import InferenceOptions
from agora.node.inference.sessions import NotSessionOwner, SessionRefused, SessionsFull, SessionTable, UnknownSession
from agora.node.rpc.auth_check import Caller, RefusalCounts, current_caller
from agora.node.replica.bounds import OutOfBounds, RequestGeometry, Slot, SlotPool, SlotRefused
from agora.node.worker.options import default_per_caller
from agora.node.replica.compute import StageCompute
from agora.node.replica.request_frames import RequestRejected
from agora.pipeline.codec import WireCodec
from agora.pipeline.config import RunConfig
from agora.pipeline.inference import SessionTooLong
from agora.protos.stage_adapter import CloseSessionReply, CloseSessionRequest, InferReply, InferRequest, StageRefusal

__all__ = ["InferenceOptions", "InferenceService"]

logger = logging.getLogger("agora.node.inference")

# Submits fn(compute) to the stage's compute thread; `slot` is freed when the job ends.
SubmitCompute = Callable[[Callable[[StageCompute], Any], Optional[Slot]], Future]


class InferenceService:
    """The InferenceHandler of protos/stage_adapter.py for one stage worker."""

    def __init__(self, config: RunConfig, stage: int, *, run_id: str, options: InferenceOptions,
                 geometry: RequestGeometry, codec: WireCodec, submit: SubmitCompute, refusals: RefusalCounts,
                 clock: Callable[[], float] = time.monotonic):
        self.options = options.validate(config)
        self.run_id = run_id
        self.stage = stage
        self.geometry = geometry.for_inference(options.session_tokens(config))
        self.sessions = SessionTable(options.max_sessions, options.session_tokens(config), options.session_ttl_s,
                                     where=f"stage {stage}", clock=clock)
        self.engine = InferenceEngine(self.sessions, codec, kv_budget=partial(options.kv_cache_bytes, config))
        self._submit = submit
        self._refusals = refusals
        self._slots = SlotPool(f"stage {stage} worker's inference queue", options.max_queue,
                               default_per_caller(options.max_queue), option="three quarters of --max-inference-queue")

    @property
    def load(self) -> int:
        return self._slots.in_use

    def _refuse(self, code: grpc.StatusCode, message: str, reason: Optional[str] = None) -> StageRefusal:
        if reason is not None:
            self._refusals.add(reason)
        return StageRefusal(code, message)

    def _admit(self, run_id: str, stage: int, request: Optional[InferRequest] = None) -> tuple[Caller, Slot]:
        caller = current_caller()
        if caller is None:  # CallerCheck runs ahead of every handler; fail closed if it did not
            raise self._refuse(grpc.StatusCode.INTERNAL, "no caller identity for this call")
        if run_id != self.run_id:
            raise self._refuse(grpc.StatusCode.INVALID_ARGUMENT,
                               f"run id {run_id!r} does not match this worker's run {self.run_id!r}")
        if stage != self.stage:
            raise self._refuse(grpc.StatusCode.INVALID_ARGUMENT,
                               f"request for stage {stage} reached a worker of stage {self.stage}")
        if request is not None:
            try:
                self.geometry.check_inference(request)
            except OutOfBounds as error:
                raise self._refuse(grpc.StatusCode.INVALID_ARGUMENT, str(error), "out_of_bounds") from None
        try:
            return caller, self._slots.acquire(caller.owner)
        except SlotRefused as error:
            raise self._refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error),
                               "caller_limit" if error.reason == "caller_limit" else None) from None

    async def _serve(self, context: Any, slot: Slot, job: Callable[[StageCompute], Any]) -> Any:
        admitted = time.perf_counter()

        def timed(compute: StageCompute) -> Any:
            started = time.perf_counter()
            reply = job(compute)
            if isinstance(reply, InferReply):
                reply = dataclasses.replace(reply, queued_s=started - admitted, compute_s=time.perf_counter() - started)
            return reply

        try:
            future = self._submit(timed, slot)
        finally:
            slot.close()  # a no-op once handed to the job; frees it if submitting failed
        try:
            return await asyncio.wrap_future(future)
        except UnknownSession as error:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        except SessionBehind as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except (SessionRefused, SessionTooLong) as error:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(error))
        except SessionsFull as error:
            self._refusals.add("kv_cache_budget")
            logger.info("stage %d refused a session's call: %s", self.stage, error,
                        extra={"milestone": "kv_cache_budget_refused",
                               "fields": {"stage": self.stage, "needed": error.needed, "budget": error.budget}})
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except NotSessionOwner as error:
            self._refusals.add("not_owner")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))
        except RequestRejected as error:  # InvalidRequest and the addressing checks
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except Exception as error:  # our bug, not the peer's: keep the traceback here, keep serving
            logger.exception("stage %d: unexpected failure in inference", self.stage)
            await context.abort(grpc.StatusCode.INTERNAL, f"stage {self.stage} failed: {type(error).__name__}: {error}")

    async def prefill(self, request: InferRequest, context: Any) -> InferReply:
        caller, slot = self._admit(request.run_id, request.stage, request)
        return await self._serve(context, slot, lambda compute: self.engine.prefill(compute, request, caller.owner))

    async def decode(self, request: InferRequest, context: Any) -> InferReply:
        caller, slot = self._admit(request.run_id, request.stage, request)
        return await self._serve(context, slot, lambda compute: self.engine.decode(compute, request, caller.owner))

    async def close_session(self, request: CloseSessionRequest, context: Any) -> CloseSessionReply:
        caller, slot = self._admit(request.run_id, request.stage)
        return await self._serve(context, slot, lambda compute: self.engine.close(compute, request, caller.owner))
