"""`StageClient`: what a trainer uses to call one stage worker.

Design choices:
- Speaks tensors on one side and the Stage service's dataclasses on the other (through
  protos/stage_adapter, never generated classes). Inputs may also be already-encoded frames
  (`bytes`), so a trainer can pass a stage's output to the next stage without re-encoding.
- Every reply is validated here (shape, size, finiteness) before the trainer sees it, so a worker
  sending garbage is caught at the hop it happened (`BadReply`), not two stages later. Validated in
  place (`WireCodec.check`): the trainer relays a stage's output frame to the next stage unchanged,
  so building a tensor of every reply (a copy and a pass over it, per hop) was work for nothing;
  `ForwardResult.wire` and `.input_grad` decode on demand for callers that want tensors.
- Errors are typed by what the trainer should do, and each carries the gRPC status code:
  `WorkerBusy` (RESOURCE_EXHAUSTED: back-pressure, wait and call again, no penalty; it carries the
  worker's pushback, gRPC's `grpc-retry-pushback-ms`), `RequestRefused` (the worker
  judged the request or its state wrong: rerun the microbatch), `InputRefused` (a RequestRefused
  whose trailing metadata names the frame the previous stage's worker produced: that worker's
  fault, not this one's), `UnitNotHeld` (a RequestRefused naming a unit this trainer sent work of
  without holding it, as the worker read the lease queue: the trainer's own problem, not the
  worker's), `WorkerUnreachable` (transport, deadline: reroute and back off),
  `BadReply` (ban-worthy; `ExtremeReply` for values beyond the stage's bound).
  `StageCallError` is their base.
- With `scales` (the trainer's, one `WireScale` per stage and frame kind: pipeline/wire_scale.py)
  a reply's output wire and input gradient are also held to their stage's recent scale, measured
  in the pass that checks them, before the trainer relays them: values far beyond what the
  stage's workers send are an `ExtremeReply`, so they never reach the next worker.
- Every call has a deadline (`timeout_s`, per call or the client default).
- Payloads that may not fit one message (either way: a head's reply is ~4*wire_dim times its
  token input) go through the streaming variants, cut into `stream_chunk_bytes` parts.
- The channel is created lazily, on the event loop of the first call, by a channel factory
  (node/rpc/tls.py): mutual TLS with this node's credential and the target name the worker's
  credential must carry (from `peer_id` and `stage`, i.e. the worker's DHT record), or plaintext
  under --insecure. When the factory's credential generation changes (a renewal), new calls go
  on a new channel and the old one is closed after `timeout_s`, so no call in flight is dropped.
- With `metrics` (monitor/trainer_metrics.RpcClientMetrics) the payload bytes of every call are
  counted each way.
- Every call carries this run's fingerprint (`agora-run-fingerprint` metadata); a worker of
  another run configuration refuses it, naming the differing field. A call made under a sampled
  span also carries its trace context (`traceparent`, node/rpc/tracing.py).
- Flow control (node/worker/flow.py): Forward and Backward send the caller's measured round trip to
  the worker, and their results carry the credits the worker granted in reply.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Optional

import grpc
import torch

from agora.auth.grpc_policy import FINGERPRINT_METADATA
from agora.monitor.trainer_metrics import RpcClientMetrics
from agora.node.rpc.server import channel_options
from agora.node.rpc.tls import ChannelFactory, InsecureChannels, worker_server_name
from agora.node.rpc.tracing import with_trace_context
from agora.pipeline.codec import WireCodec, WireFormatError, encode_tokens, float_frame_bytes
from agora.pipeline.config import ModelConfig
from agora.pipeline.fingerprint import RunFingerprint
from agora.pipeline.wire_scale import WireScale
from agora.protos.receipt_adapter import ReceiptDelivery, ReceiptKept, ReceiptStub
from agora.protos.stage_adapter import (
    PRODUCED_FIELDS,
    PUSHBACK_METADATA,
    REFUSED_INPUT_METADATA,
    UNIT_NOT_HELD_METADATA,
    AbortReply,
    AbortRequest,
    BackwardRequest,
    ForwardRequest,
    InfoReply,
    PayloadTooLarge,
    StageStub,
    StepReply,
    StepRequest,
    payload_bytes,
)

__all__ = [
    "StageCallError",
    "WorkerBusy",
    "RequestRefused",
    "UnitNotHeld",
    "OutsideWindow",
    "WorkerUnreachable",
    "BadReply",
    "ExtremeReply",
    "InputRefused",
    "ReplyScales",
    "error_for",
    "ForwardResult",
    "BackwardResult",
    "StageClient",
]

# Headroom for the protobuf framing and scalar fields around the bytes payload.
_ENVELOPE_BYTES = 64 * 2**10


class StageCallError(Exception):
    """A failed call to a stage worker; `code` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, details: str, *, address: str, method: str):
        super().__init__(f"{method} on {address}: {code.name}: {details}")
        self.code = code
        self.details = details
        self.address = address
        self.method = method


class WorkerBusy(StageCallError):
    """RESOURCE_EXHAUSTED: the worker is full, or this caller holds its share there (back-pressure:
    call again once a slot frees, on this replica or another). `pushback_s`: when the worker expects
    one to (None: it did not say)."""

    def __init__(self, code: grpc.StatusCode, details: str, *, address: str, method: str,
                 pushback_s: float | None = None):
        super().__init__(code, details, address=address, method=method)
        self.pushback_s = pushback_s


class RequestRefused(StageCallError):
    """The worker judged the request (or its state for it) wrong: rerun the microbatch."""


class OutsideWindow(StageCallError):
    """OUT_OF_RANGE: a completed-batch report outside the replica's window (node/replica/epoch.py). The
    replica lags or runs ahead of its stage; it is told of later batches still (it re-anchors to its
    stage's count when the stage's other replicas announce one)."""


class InputRefused(RequestRefused):
    """INVALID_ARGUMENT over values the previous stage's worker produced: `field` is the request's frame
    that holds them ("wire": the output of the stage before; "output_grad": the input gradient of the
    stage after), as the worker's trailing metadata names it."""

    def __init__(self, code: grpc.StatusCode, details: str, *, address: str, method: str, field: str):
        super().__init__(code, details, address=address, method=method)
        self.field = field


class UnitNotHeld(RequestRefused):
    """PERMISSION_DENIED: this trainer sent work of `unit` that it does not hold, as the worker read the
    lease queue. No fault of the worker's: the trainer lost the unit to another (a race the lease
    queue settles after the fact), or the worker read the queue before this trainer's claim landed."""

    def __init__(self, code: grpc.StatusCode, details: str, *, address: str, method: str, unit: int):
        super().__init__(code, details, address=address, method=method)
        self.unit = unit


class WorkerUnreachable(StageCallError):
    """Transport failure, deadline or shutdown: reroute, and back off from this worker."""


class BadReply(StageCallError):
    """The call succeeded but the reply does not decode or has the wrong shape (DATA_LOSS)."""


class ExtremeReply(BadReply):
    """The reply decodes, but its values lie far beyond what the stage's workers sent lately (`kind`:
    "output" or "input_grad")."""

    def __init__(self, code: grpc.StatusCode, details: str, *, address: str, method: str, kind: str):
        super().__init__(code, details, address=address, method=method)
        self.kind = kind


class ReplyScales:
    """One `WireScale` per (stage, frame kind), shared by a trainer's clients (module docstring)."""

    def __init__(self, factor: float, warmup: int):
        self.factor, self.warmup = factor, warmup
        self._scales: dict[tuple[int, str], WireScale] = {}

    def of(self, stage: int, kind: str) -> WireScale:
        scale = self._scales.get((stage, kind))
        if scale is None:
            scale = self._scales[(stage, kind)] = WireScale(self.factor, self.warmup)
        return scale

    def summary(self) -> dict[str, dict[str, float]]:
        """Per "stage/kind": replies accepted and refused, the scale, and the largest accepted over it."""
        return {f"{stage}/{kind}": {"accepted": scale.accepted, "refused": scale.refused, "scale": scale.scale,
                                    "peak_ratio": round(scale.peak_ratio, 3)}
                for (stage, kind), scale in sorted(self._scales.items())}


_ERROR_BY_CODE = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: WorkerBusy,
    grpc.StatusCode.INVALID_ARGUMENT: RequestRefused,
    grpc.StatusCode.FAILED_PRECONDITION: RequestRefused,
    grpc.StatusCode.NOT_FOUND: RequestRefused,
    grpc.StatusCode.OUT_OF_RANGE: OutsideWindow,
    grpc.StatusCode.PERMISSION_DENIED: RequestRefused,
    grpc.StatusCode.UNAUTHENTICATED: RequestRefused,
    grpc.StatusCode.ALREADY_EXISTS: RequestRefused,
    grpc.StatusCode.UNAVAILABLE: WorkerUnreachable,
    grpc.StatusCode.DEADLINE_EXCEEDED: WorkerUnreachable,
    grpc.StatusCode.CANCELLED: WorkerUnreachable,
    grpc.StatusCode.DATA_LOSS: BadReply,
}


def error_for(code: grpc.StatusCode, details: str, *, address: str, method: str,
              trailing_metadata: Any = ()) -> StageCallError:
    """The typed error for a status code (INTERNAL, UNKNOWN, ... stay the base class); a busy one
    with the pushback its trailing metadata carries."""
    cls = _ERROR_BY_CODE.get(code, StageCallError)
    refused_input = _metadata_value(trailing_metadata, REFUSED_INPUT_METADATA)
    if code == grpc.StatusCode.INVALID_ARGUMENT and refused_input in PRODUCED_FIELDS:
        return InputRefused(code, details, address=address, method=method, field=refused_input)
    if cls is WorkerBusy:
        return WorkerBusy(code, details, address=address, method=method, pushback_s=pushback_s(trailing_metadata))
    unit = _metadata_value(trailing_metadata, UNIT_NOT_HELD_METADATA)
    if code == grpc.StatusCode.PERMISSION_DENIED and unit is not None and unit.isdigit() and len(unit) <= 16:
        return UnitNotHeld(code, details, address=address, method=method, unit=int(unit))
    return cls(code, details, address=address, method=method)


def _metadata_value(trailing_metadata: Any, key: str) -> str | None:
    for name, value in trailing_metadata or ():
        if name == key:
            return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
    return None


def pushback_s(trailing_metadata: Any) -> float | None:
    """Seconds of a `grpc-retry-pushback-ms` entry (None: absent, or not a whole non-negative number)."""
    text = _metadata_value(trailing_metadata, PUSHBACK_METADATA)
    return int(text) / 1e3 if text is not None and text.isdigit() and len(text) <= 9 else None


def _tensor(codec: WireCodec, frame: bytes) -> torch.Tensor | None:
    return codec.decode(frame) if frame else None  # checked when the reply arrived


@dataclass(frozen=True)
class ForwardResult:
    loss: float | None  # tail only
    step: int  # the worker's optimizer step when it ran
    # The encoded output (checked), to pass on unchanged: a view of the reply as grpc received it.
    wire_frame: bytes | memoryview = b""
    grad_frame: bytes | memoryview = b""  # tail: the encoded dL/d(input wire)
    queued_s: float = 0.0  # the worker's own account: waiting for, and on, its compute thread
    compute_s: float = 0.0
    codec: WireCodec = WireCodec()
    repeat: bool = False  # tail: the worker had applied this work already (not accumulated again)
    credits: int = 0  # calls this trainer may have outstanding at the worker now (0: not stated)
    in_flight_credits: int = 0  # microbatches of this trainer it keeps for their Backward (0: no bound)
    weights_version: int = 0  # the worker's weights it ran on (bumped by every write to them)
    full_precision: bool = False  # asked for full precision (held-out) and computed in it
    callers: int = 0  # callers the worker serves now, this trainer included (0: not stated)

    @property
    def wire(self) -> torch.Tensor | None:
        """Head/body output, float32 (batch, seq, wire_dim), decoded now."""
        return _tensor(self.codec, self.wire_frame)

    @property
    def input_grad(self) -> torch.Tensor | None:
        """Tail: dL/d(input wire), decoded now; None on the head / a single stage."""
        return _tensor(self.codec, self.grad_frame)


@dataclass(frozen=True)
class BackwardResult:
    step: int
    grad_frame: bytes | memoryview = b""  # empty on the head
    queued_s: float = 0.0
    compute_s: float = 0.0
    codec: WireCodec = WireCodec()
    repeat: bool = False  # the worker had applied this work already (not accumulated again)
    credits: int = 0
    in_flight_credits: int = 0
    weights_version: int = 0  # the weights its gradient was computed on
    callers: int = 0

    @property
    def input_grad(self) -> torch.Tensor | None:
        return _tensor(self.codec, self.grad_frame)


class StageClient:
    """Calls one worker of stage `stage`. Construct anywhere; use inside one event loop.

    `fingerprint`: this run's (sent with every call). `channels`: how to connect (default
    plaintext); a TLS factory needs `peer_id`, the worker's peer id from its DHT record."""

    def __init__(self, address: str, *, run_id: str, stage: int, model: ModelConfig,
                 fingerprint: RunFingerprint, peer_id: Optional[str] = None,
                 channels: Optional[ChannelFactory] = None,
                 codec: WireCodec | None = None, timeout_s: float = 30.0,
                 max_message_bytes: int = 16 * 2**20, max_stream_bytes: int = 512 * 2**20,
                 stream_chunk_bytes: int = 2**20, metrics: Optional[RpcClientMetrics] = None, relay: bool = True,
                 scales: Optional[ReplyScales] = None):
        """`relay=False`: the generated classes and a decoded tensor of every reply, as this client did
        before relaying frames (kept as the reference bench/trainer_relay.py measures against).
        `scales`: hold replies' values to their stage's recent scale (module docstring)."""
        if stream_chunk_bytes + _ENVELOPE_BYTES > max_message_bytes:
            raise ValueError("stream_chunk_bytes plus framing must fit in max_message_bytes")
        self.channels = channels if channels is not None else InsecureChannels()
        if self.channels.secure and not peer_id:
            raise ValueError("a TLS StageClient needs the worker's peer id (its DHT record) for the target name")
        self.address = address
        self.run_id = run_id
        self.stage = stage
        self.peer_id = peer_id
        self.model = model
        self.fingerprint = fingerprint
        self._metadata = ((FINGERPRINT_METADATA, fingerprint.text()),)
        self.codec = codec or WireCodec("fp32", max_bytes=max_stream_bytes)
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self.max_stream_bytes = max_stream_bytes
        self.stream_chunk_bytes = stream_chunk_bytes
        self.relay = relay
        self._channel: grpc.aio.Channel | None = None
        self._stub: StageStub | None = None
        self._generation: int | None = None
        self._retiring: set[asyncio.Task] = set()  # old channels closing after their grace period
        self.channels_opened = 0
        self._metrics = metrics
        self._scales = scales

    # ------------------------------------------------------------------ plumbing

    def _calls(self) -> StageStub:
        generation = self.channels.generation()
        if self._stub is None or generation != self._generation:
            if self._channel is not None:
                self._retire(self._channel)
            target = worker_server_name(self.stage, self.peer_id) if self.peer_id else None
            self._channel = self.channels.open(self.address, target_name=target,
                                               options=channel_options(self.max_message_bytes))
            self._stub = StageStub(self._channel, relay=self.relay)
            self._generation = generation
            self.channels_opened += 1
        return self._stub

    def _retire(self, channel: grpc.aio.Channel) -> None:
        """Close a channel of an earlier credential once its calls are done (at most `timeout_s`:
        every call has that deadline), without holding up new calls."""
        task = asyncio.ensure_future(channel.close(grace=self.timeout_s))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def close(self) -> None:
        retiring, self._retiring = list(self._retiring), set()
        if retiring:
            await asyncio.gather(*retiring, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def __aenter__(self) -> "StageClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until the channel connects; WorkerUnreachable after the deadline."""
        self._calls()
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s or self.timeout_s)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            raise WorkerUnreachable(grpc.StatusCode.UNAVAILABLE, "channel not ready before the deadline",
                                    address=self.address, method="connect") from None

    async def _invoke(self, method: str, call, timeout_s: float | None, request: Any = None) -> Any:
        try:
            reply = await call(timeout=timeout_s if timeout_s is not None else self.timeout_s,
                               metadata=with_trace_context(self._metadata))
            if self._metrics is not None and request is not None:
                self._metrics.exchanged(method, payload_bytes(request), payload_bytes(reply))
            return reply
        except grpc.aio.AioRpcError as error:
            raise error_for(error.code(), error.details() or "", address=self.address, method=method,
                            trailing_metadata=error.trailing_metadata()) from None
        except PayloadTooLarge as error:
            raise BadReply(grpc.StatusCode.DATA_LOSS, str(error), address=self.address, method=method) from None

    def _streamed(self, payload: int) -> bool:
        return payload + _ENVELOPE_BYTES > self.max_message_bytes

    def _decode(self, frame: bytes, shape: tuple[int | None, ...], method: str) -> torch.Tensor:
        try:
            return self.codec.decode(frame, expected_shape=shape)
        except WireFormatError as error:
            raise BadReply(grpc.StatusCode.DATA_LOSS, f"reply does not decode: {error}",
                           address=self.address, method=method) from None

    def _check(self, frame: bytes | memoryview, shape: tuple[int | None, ...], method: str,
               kind: str) -> bytes | memoryview:
        """`frame`, checked as `_decode` checks it and held to its stage's scale, left as it is."""
        if not self.relay:
            largest = float(self._decode(frame, shape, method).abs().max())
        else:
            try:
                largest = self.codec.inspect(frame, expected_shape=shape).largest_magnitude
            except WireFormatError as error:
                raise BadReply(grpc.StatusCode.DATA_LOSS, f"reply does not decode: {error}",
                               address=self.address, method=method) from None
        if self._scales is not None:
            scale = self._scales.of(self.stage, kind)
            bound = scale.admit(largest)
            if bound is not None:
                raise ExtremeReply(grpc.StatusCode.DATA_LOSS,
                                   f"reply's {kind} has values up to {largest:.3g}, beyond {bound:.3g} ({scale.factor:g} "
                                   f"times the median of stage {self.stage}'s recent replies)",
                                   address=self.address, method=method, kind=kind)
        return frame

    @staticmethod
    def _as_frame(value: bytes | bytearray | memoryview) -> bytes | memoryview:
        # A frame relayed from another stage's reply is a view of that reply: passed on as it is.
        return bytes(value) if isinstance(value, bytearray) else value

    def _frame(self, value: torch.Tensor | bytes | memoryview | None) -> bytes | memoryview:
        if value is None:
            return b""
        return self._as_frame(value) if isinstance(value, (bytes, bytearray, memoryview)) else self.codec.encode(value)

    def _token_frame(self, value: torch.Tensor | bytes | memoryview | None) -> bytes | memoryview:
        if value is None:
            return b""
        if isinstance(value, (bytes, bytearray, memoryview)):
            return self._as_frame(value)
        return encode_tokens(value, self.model.vocab_size)

    # ------------------------------------------------------------------ calls

    async def forward(self, microbatch_id: str, tokens: torch.Tensor | bytes,
                      wire: torch.Tensor | bytes | None = None, targets: torch.Tensor | bytes | None = None,
                      *, evaluate: bool = False, work_key: str = "", round_trip_s: float = 0.0,
                      full_precision: bool = False, timeout_s: float | None = None) -> ForwardResult:
        """Forward on this stage. Tail: `targets` required; the result has the loss and input gradient
        (`evaluate`: the held-out loss only, nothing stashed or accumulated anywhere). `work_key`:
        the unit and index trained on, the same for every attempt (applied once per worker).
        `round_trip_s`: this trainer's measured round trip to the worker outside its compute and queue.
        `full_precision` (held-out): computed in float32, the reply in fp32 (a gradient check's probes)."""
        request = ForwardRequest(run_id=self.run_id, microbatch_id=microbatch_id, stage=self.stage,
                                 tokens=self._token_frame(tokens), wire=self._frame(wire),
                                 targets=self._token_frame(targets), evaluate=evaluate, work_key=work_key,
                                 round_trip_s=round_trip_s, full_precision=full_precision)
        shape = (None, None, self.model.wire_dim)
        if isinstance(tokens, torch.Tensor):
            shape = (*tokens.shape, self.model.wire_dim)
            # The reply (output or input gradient) is at most one fp32 (batch, seq, wire_dim) frame.
            reply_bytes = float_frame_bytes(shape, "fp32")
        else:  # a token frame holds at least one byte per token: a cheap upper bound
            reply_bytes = len(request.tokens) * 4 * self.model.wire_dim
        stub = self._calls()
        if self._streamed(max(payload_bytes(request), reply_bytes)):
            call = lambda **options: stub.forward_stream(  # noqa: E731
                request, chunk_bytes=self.stream_chunk_bytes, max_reply_bytes=self.max_stream_bytes, **options)
        else:
            call = lambda **options: stub.forward(request, **options)  # noqa: E731
        reply = await self._invoke("Forward", call, timeout_s, request)
        if not reply.wire and reply.loss is None:
            raise BadReply(grpc.StatusCode.DATA_LOSS, "reply carries neither an output wire nor a loss",
                           address=self.address, method="Forward")
        wire_out = self._check(reply.wire, shape, "Forward", "output") if reply.wire else b""
        grad = self._check(reply.input_grad, shape, "Forward", "input_grad") if reply.input_grad else b""
        return ForwardResult(loss=reply.loss, step=reply.step, wire_frame=wire_out, grad_frame=grad,
                             queued_s=reply.queued_s, compute_s=reply.compute_s, codec=self.codec, repeat=reply.repeat,
                             credits=reply.credits, in_flight_credits=reply.in_flight_credits,
                             weights_version=reply.weights_version, full_precision=reply.full_precision,
                             callers=reply.callers)

    async def backward(self, microbatch_id: str, output_grad: torch.Tensor | bytes,
                       *, round_trip_s: float = 0.0, timeout_s: float | None = None) -> BackwardResult:
        """Backward on this stage (head or body), pinned to the worker that ran the forward."""
        request = BackwardRequest(run_id=self.run_id, microbatch_id=microbatch_id, stage=self.stage,
                                  output_grad=self._frame(output_grad), round_trip_s=round_trip_s)
        shape = (None, None, self.model.wire_dim)
        if isinstance(output_grad, torch.Tensor):
            shape = tuple(output_grad.shape)
        stub = self._calls()
        if self._streamed(payload_bytes(request)):
            call = lambda **options: stub.backward_stream(  # noqa: E731
                request, chunk_bytes=self.stream_chunk_bytes, max_reply_bytes=self.max_stream_bytes, **options)
        else:
            call = lambda **options: stub.backward(request, **options)  # noqa: E731
        reply = await self._invoke("Backward", call, timeout_s, request)
        grad = self._check(reply.input_grad, shape, "Backward", "input_grad") if reply.input_grad else b""
        return BackwardResult(step=reply.step, grad_frame=grad, queued_s=reply.queued_s, compute_s=reply.compute_s,
                              codec=self.codec, repeat=reply.repeat, credits=reply.credits,
                              in_flight_credits=reply.in_flight_credits, weights_version=reply.weights_version,
                              callers=reply.callers)

    async def step(self, microbatches: int, *, step: int | None = None,
                   timeout_s: float | None = None) -> StepReply:
        """Synchronous-mode barrier; `step` (the step being completed) makes a retry idempotent."""
        request = StepRequest(run_id=self.run_id, stage=self.stage, microbatches=microbatches, step=step)
        stub = self._calls()
        return await self._invoke("Step", lambda **options: stub.step(request, **options), timeout_s)

    async def batch_done(self, batch: int, microbatches: int, replicas: int, *,
                         timeout_s: float | None = None) -> StepReply:
        """Asynchronous mode: global batch `batch` (of `microbatches`, over `replicas` replicas of this
        stage) is done here; the worker steps once on what it accumulated."""
        request = StepRequest(run_id=self.run_id, stage=self.stage, microbatches=microbatches,
                              completed_batch=batch, replicas=replicas)
        stub = self._calls()
        return await self._invoke("Step", lambda **options: stub.step(request, **options), timeout_s)

    async def abort(self, microbatch_id: str, *, timeout_s: float | None = None) -> AbortReply:
        """Tell the worker this microbatch was abandoned (drop its input, take back its gradient)."""
        request = AbortRequest(run_id=self.run_id, microbatch_id=microbatch_id, stage=self.stage)
        stub = self._calls()
        return await self._invoke("Abort", lambda **options: stub.abort(request, **options), timeout_s)

    async def info(self, *, timeout_s: float | None = None) -> InfoReply:
        stub = self._calls()
        return await self._invoke("Info", lambda **options: stub.info(**options), timeout_s)

    async def deliver_receipt(self, receipt: str, *, timeout_s: float | None = None) -> ReceiptKept:
        """Hand the worker its signed receipt (JSON, auth/receipts.py); it verifies and keeps it."""
        self._calls()  # the channel, as every call opens it
        stub = ReceiptStub(self._channel)
        return await self._invoke("DeliverReceipt", lambda **options: stub.deliver(ReceiptDelivery(receipt), **options),
                                  timeout_s)
