"""The one place that touches the generated `agora.v1.Stage` classes.

Everything else in the codebase speaks the frozen dataclasses below; this module converts them
to and from protobuf messages, registers a handler object as the gRPC service, and wraps the
generated stub for clients. Design choices:

- The dataclasses mirror the messages field for field (same names), so conversion is one generic
  function driven by `dataclasses.fields`; a field whose dataclass default is None is a proto3
  `optional` and maps to "unset".
- Tensors stay opaque codec frames (`bytes`); decoding them is the worker's and client's job.
- Streaming variants carry the same message cut into parts: the first part holds every scalar
  field, each part appends a piece to the bytes fields (`split_parts` / `PartAssembler`). The
  receiver bounds the reassembled total (`PayloadTooLarge`), so a peer cannot make it buffer
  without limit; it drains (without keeping) a bounded remainder before answering
  RESOURCE_EXHAUSTED, because grpc.aio clients misreport an abort that lands while they are
  still writing. Handlers never see whether a call was streamed.
- Admission happens on a stream's FIRST part: the handler's `admit_stream` sees the scalar fields
  and whatever payload came with them, and answers with a `StreamAdmission` (the byte budget for
  this request, the queue slot it holds) or refuses with a `StageRefusal`; only then are the other
  parts read, under that budget rather than the registration-wide `max_stream_bytes`, which only
  bounds what is drained; the rest must arrive within `stream_timeout_s` of the first part, so a
  trickling client cannot hold an admitted stream's slot. A handler raising `StageRefusal`
  anywhere gets its status sent (after draining, for a stream still being written). Draining is
  bounded in bytes and in time.
- Inference (Prefill, Decode, CloseSession) is served by a handler of its own (`InferenceHandler`,
  the worker's inference service), passed to `add_stage_service` beside the training handler, so
  the two concerns stay in separate modules on one server; without one, those methods answer
  UNIMPLEMENTED.
- Requests are parsed by a tolerant deserializer: grpc's own answers a message that does not
  parse (bad wire format, invalid UTF-8 in a string) with UNKNOWN and logs it as the servicer's
  exception, so here it reaches the servicer as a `Malformed` marker (protos/serving.py) and is answered
  INVALID_ARGUMENT naming the message type (a streamed one after draining, as above).

Imports nothing of ours except the generated modules beside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Protocol

import grpc

from agora.protos import stage_pb2, stage_pb2_grpc
from agora.protos.serving import MalformedMessage, checked, drain, tolerant_parser
from agora.protos.stage_relay_adapter import decode_message, encode_message

__all__ = [
    "SERVICE_NAME",
    "PUSHBACK_METADATA",
    "REFUSED_INPUT_METADATA",
    "UNIT_NOT_HELD_METADATA",
    "PRODUCED_FIELDS",
    "ForwardRequest",
    "ForwardReply",
    "BackwardRequest",
    "BackwardReply",
    "StepRequest",
    "StepReply",
    "AbortRequest",
    "AbortReply",
    "InfoRequest",
    "InfoReply",
    "InferRequest",
    "InferReply",
    "CloseSessionRequest",
    "CloseSessionReply",
    "PayloadTooLarge",
    "IncompleteStream",
    "StageRefusal",
    "StreamAdmission",
    "MalformedMessage",
    "PartAssembler",
    "StageHandler",
    "InferenceHandler",
    "StageStub",
    "to_message",
    "from_message",
    "split_parts",
    "payload_bytes",
    "add_stage_service",
]

SERVICE_NAME: str = stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name  # "agora.v1.Stage"
# gRPC's server pushback (gRFC A6): in a refusal's trailing metadata, milliseconds until the caller
# should try again (a busy worker's estimate of when a slot frees).
PUSHBACK_METADATA = "grpc-retry-pushback-ms"
# In an INVALID_ARGUMENT's trailing metadata: the request's frame whose values, computed by the
# previous stage's worker and relayed by the caller, the worker refused ("wire", "output_grad").
REFUSED_INPUT_METADATA = "agora-refused-input"
# In a PERMISSION_DENIED's trailing metadata: the unit whose work or report the caller sent without
# holding it, as the worker read the lease queue (node/worker/unit_holders.py).
UNIT_NOT_HELD_METADATA = "agora-unit-not-held"
PRODUCED_FIELDS = ("wire", "output_grad")  # its values: the request's frames another stage's worker computed


@dataclass(frozen=True)
class ForwardRequest:
    run_id: str
    microbatch_id: str
    stage: int
    tokens: bytes
    wire: bytes = b""  # empty for the head
    targets: bytes = b""  # the tail only
    evaluate: bool = False  # held-out loss: no stash, no gradients
    work_key: str = ""  # the unit and index this microbatch trains on; applied once per worker
    round_trip_s: float = 0.0  # the caller's round trip to this worker outside compute and queue; 0: unknown
    full_precision: bool = False  # held-out: computed in float32, the reply in fp32 (finite-difference probes)


@dataclass(frozen=True)
class ForwardReply:
    wire: bytes = b""  # head/body output
    loss: float | None = None  # tail only
    input_grad: bytes = b""  # tail: dL/d(input wire); empty on a single-stage pipeline
    step: int = 0
    queued_s: float = 0.0  # waiting for the compute thread
    compute_s: float = 0.0  # on the compute thread
    repeat: bool = False  # tail: its work key was applied here already, the gradient not added again
    credits: int = 0  # calls this caller may have outstanding here now (flow control; 0: not stated)
    in_flight_credits: int = 0  # microbatches of this caller kept here for their Backward (0: no bound)
    weights_version: int = 0  # the weights it ran on: bumped by every write to them
    full_precision: bool = False  # asked for full precision and computed in it
    callers: int = 0  # callers this worker serves now, this one included (each gets about 1/callers; 0: not stated)


@dataclass(frozen=True)
class BackwardRequest:
    run_id: str
    microbatch_id: str
    stage: int
    output_grad: bytes
    round_trip_s: float = 0.0


@dataclass(frozen=True)
class BackwardReply:
    input_grad: bytes = b""  # empty on the head
    step: int = 0
    queued_s: float = 0.0
    compute_s: float = 0.0
    repeat: bool = False  # its work key was applied here already, the gradient not added again
    credits: int = 0
    in_flight_credits: int = 0
    weights_version: int = 0  # the weights its gradient was computed on
    callers: int = 0


@dataclass(frozen=True)
class StepRequest:
    run_id: str
    stage: int
    microbatches: int
    step: int | None = None  # the step this barrier completes; None steps unconditionally
    completed_batch: int | None = None  # asynchronous mode: this global batch is done on this stage
    replicas: int = 0  # with completed_batch: the stage's replicas the trainer routes to


@dataclass(frozen=True)
class StepReply:
    step: int
    grad_norm: float
    lr: float
    skipped: bool
    accumulated: int


@dataclass(frozen=True)
class AbortRequest:
    run_id: str
    microbatch_id: str
    stage: int


@dataclass(frozen=True)
class AbortReply:
    reverted: bool
    outcome: str  # "reverted" | "dropped" | "unknown" | "stepped"


@dataclass(frozen=True)
class InfoRequest:
    pass


@dataclass(frozen=True)
class InfoReply:
    run_id: str
    stage: int
    n_stages: int
    step: int
    phase: str
    load: int
    capacity: int
    stashed: int
    synchronous: bool
    throughput: float = 0.0  # tokens/s of compute, moving average
    sessions: int = 0  # inference sessions open
    session_capacity: int = 0
    credits: int = 0  # what the caller of Info would be given now (flow control)
    in_flight_credits: int = 0


@dataclass(frozen=True)
class InferRequest:
    run_id: str
    stage: int
    session_id: str
    tokens: bytes
    position: int = 0  # positions this call follows (0 for Prefill)
    wire: bytes = b""  # empty for the head
    max_tokens: int = 0  # Prefill: positions the session will hold at most; 0: the worker's limit
    score: bool = False  # tail: also score the new positions (InferReply.token_logprobs)
    top_logprobs: int = 0  # tail, when scoring: the k likeliest next tokens at each new position


@dataclass(frozen=True)
class InferReply:
    wire: bytes = b""  # head/body output for the new positions
    logits: bytes = b""  # tail: the last position's logits
    length: int = 0  # positions the session holds on this worker now
    step: int = 0  # the worker's optimizer step now, and when the session opened
    session_step: int = 0
    queued_s: float = 0.0
    compute_s: float = 0.0
    token_logprobs: bytes = b""  # tail, scoring: fp32 (rows, n), the next new position's token's
    top_logprobs: bytes = b""  # tail, scoring with k > 0: fp32 (rows, n, k), likeliest first
    top_ids: bytes = b""  # and their ids, token frame (rows, n, k)


@dataclass(frozen=True)
class CloseSessionRequest:
    run_id: str
    stage: int
    session_id: str


@dataclass(frozen=True)
class CloseSessionReply:
    closed: bool


# Read-only pairing of each dataclass with its generated message class.
_MESSAGE_OF: Mapping[type, type] = MappingProxyType({
    ForwardRequest: stage_pb2.ForwardRequest,
    ForwardReply: stage_pb2.ForwardReply,
    BackwardRequest: stage_pb2.BackwardRequest,
    BackwardReply: stage_pb2.BackwardReply,
    StepRequest: stage_pb2.StepRequest,
    StepReply: stage_pb2.StepReply,
    AbortRequest: stage_pb2.AbortRequest,
    AbortReply: stage_pb2.AbortReply,
    InfoRequest: stage_pb2.InfoRequest,
    InfoReply: stage_pb2.InfoReply,
    InferRequest: stage_pb2.InferRequest,
    InferReply: stage_pb2.InferReply,
    CloseSessionRequest: stage_pb2.CloseSessionRequest,
    CloseSessionReply: stage_pb2.CloseSessionReply,
})
_DATACLASS_OF: Mapping[type, type] = MappingProxyType({message: data for data, message in _MESSAGE_OF.items()})


class PayloadTooLarge(ValueError):
    """A streamed payload exceeded the receiver's bound."""


class IncompleteStream(ValueError):
    """A stream ended before carrying a single part."""


class StageRefusal(Exception):
    """Raised by a handler to refuse a call with `code` and `message` (the adapter drains a stream
    the client is still writing before the status goes out, see protos/serving.py);
    `trailing_metadata` goes with the status (a busy refusal's `grpc-retry-pushback-ms`)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing_metadata: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailing_metadata = trailing_metadata


class StreamAdmission(Protocol):
    """What a handler grants a stream on its first part; the adapter closes it when the call ends."""

    max_bytes: int  # payload bytes the reassembled request may carry
    budget: str  # how max_bytes was derived, for the refusal of a stream over it

    def close(self) -> None: ...  # idempotent: the adapter may call it more than once


def _bytes_fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.type in (bytes, "bytes")]


def to_message(value: Any) -> Any:
    """The generated message for one of this module's dataclasses (None fields left unset)."""
    message_cls = _MESSAGE_OF[type(value)]
    return message_cls(**{f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                          if getattr(value, f.name) is not None})


def from_message(message: Any) -> Any:
    """The dataclass for a generated message; unset optional fields become None."""
    cls = _DATACLASS_OF[type(message)]
    descriptor = message.DESCRIPTOR.fields_by_name
    values = {}
    for f in dataclasses.fields(cls):
        if descriptor[f.name].has_presence and not message.HasField(f.name):
            values[f.name] = None
        else:
            values[f.name] = getattr(message, f.name)
    return cls(**values)


def payload_bytes(value: Any) -> int:
    """Bytes carried by a dataclass's bytes fields: what decides unary vs streaming."""
    return sum(len(getattr(value, name)) for name in _bytes_fields(type(value)))


def split_parts(value: Any, chunk_bytes: int) -> list[Any]:
    """Cut a dataclass into messages carrying at most `chunk_bytes` of payload each.

    The first part carries every scalar field; bytes fields are packed greedily in field order.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    message_cls = _MESSAGE_OF[type(value)]
    blob_names = _bytes_fields(type(value))
    scalars = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
               if f.name not in blob_names and getattr(value, f.name) is not None}
    parts: list[dict[str, Any]] = [dict(scalars)]
    room = chunk_bytes
    for name in blob_names:
        data = memoryview(getattr(value, name))
        while len(data):
            if room == 0:
                parts.append({})
                room = chunk_bytes
            piece, data = data[:room], data[room:]
            parts[-1][name] = bytes(piece)
            room -= len(piece)
    return [message_cls(**fields) for fields in parts]


class PartAssembler:
    """Rebuilds a dataclass from streamed parts, refusing more than `max_bytes` of payload
    (`budget`: how that bound was derived, for the message)."""

    def __init__(self, message_cls: type, max_bytes: int, budget: str = ""):
        self._cls = _DATACLASS_OF[message_cls]
        self._max_bytes = max_bytes
        self._budget = budget
        self._first: Any = None
        self._pieces: dict[str, list[bytes]] = {name: [] for name in _bytes_fields(self._cls)}
        self._total = 0

    def add(self, message: Any) -> None:
        message = checked(message)
        if self._first is None:
            self._first = message
        for name, pieces in self._pieces.items():
            piece = getattr(message, name)
            if piece:
                self._total += len(piece)
                if self._total > self._max_bytes:
                    raise PayloadTooLarge(
                        f"streamed {self._cls.__name__} exceeds the {self._max_bytes}-byte limit"
                        + (f" ({self._budget})" if self._budget else ""))
                pieces.append(piece)

    def result(self) -> Any:
        if self._first is None:
            raise IncompleteStream(f"stream carried no {self._cls.__name__} part")
        head = from_message(self._first)
        return dataclasses.replace(head, **{name: b"".join(p) for name, p in self._pieces.items()})


async def _assemble(parts: AsyncIterable[Any], message_cls: type, max_bytes: int) -> Any:
    assembler = PartAssembler(message_cls, max_bytes)
    async for part in parts:
        assembler.add(part)
    return assembler.result()


class StageHandler(Protocol):
    """What a worker implements; `context` is the grpc.aio.ServicerContext (to abort with a status).

    A unary Forward/Backward comes with `admission=None` (the handler admits it); a streamed one
    was admitted by `admit_stream` on its first part, and comes with what that returned. Any
    method may raise `StageRefusal`."""

    def admit_stream(self, head: ForwardRequest | BackwardRequest, context: Any) -> Awaitable[StreamAdmission]: ...
    def forward(self, request: ForwardRequest, context: Any,
                admission: StreamAdmission | None = None) -> Awaitable[ForwardReply]: ...
    def backward(self, request: BackwardRequest, context: Any,
                 admission: StreamAdmission | None = None) -> Awaitable[BackwardReply]: ...
    def step(self, request: StepRequest, context: Any) -> Awaitable[StepReply]: ...
    def abort(self, request: AbortRequest, context: Any) -> Awaitable[AbortReply]: ...
    def info(self, request: InfoRequest, context: Any) -> Awaitable[InfoReply]: ...


class InferenceHandler(Protocol):
    """What a worker's inference service implements (same conventions as `StageHandler`)."""

    def prefill(self, request: InferRequest, context: Any) -> Awaitable[InferReply]: ...
    def decode(self, request: InferRequest, context: Any) -> Awaitable[InferReply]: ...
    def close_session(self, request: CloseSessionRequest, context: Any) -> Awaitable[CloseSessionReply]: ...


class _Servicer(stage_pb2_grpc.StageServicer):
    def __init__(self, handler: StageHandler, max_stream_bytes: int, chunk_bytes: int, stream_timeout_s: float,
                 inference: InferenceHandler | None = None):
        self._handler = handler
        self._inference = inference
        self._max_stream_bytes = max_stream_bytes
        self._chunk_bytes = chunk_bytes
        self._stream_timeout_s = stream_timeout_s

    async def _unary(self, call: Callable[[Any, Any], Awaitable[Any]], request: Any, context: Any) -> Any:
        try:
            value = from_message(checked(request))
        except MalformedMessage as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        try:
            reply = await call(value, context)
        except StageRefusal as refusal:
            await context.abort(refusal.code, refusal.message, refusal.trailing_metadata)
        return to_message(reply)

    async def Forward(self, request, context):
        return await self._unary(self._handler.forward, request, context)

    async def Backward(self, request, context):
        return await self._unary(self._handler.backward, request, context)

    async def Step(self, request, context):
        return await self._unary(self._handler.step, request, context)

    async def Abort(self, request, context):
        return await self._unary(self._handler.abort, request, context)

    async def Info(self, request, context):
        return await self._unary(self._handler.info, request, context)

    async def _inferring(self, name: str, request, context):
        if self._inference is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker does not serve inference")
        return await self._unary(getattr(self._inference, name), request, context)

    async def Prefill(self, request, context):
        return await self._inferring("prefill", request, context)

    async def Decode(self, request, context):
        return await self._inferring("decode", request, context)

    async def CloseSession(self, request, context):
        return await self._inferring("close_session", request, context)

    async def _streamed(self, parts, context, message_cls, call) -> AsyncIterator[Any]:
        admission: StreamAdmission | None = None
        try:
            try:
                try:
                    first = await parts.__anext__()
                except StopAsyncIteration:
                    raise IncompleteStream(f"stream carried no {_DATACLASS_OF[message_cls].__name__} part") from None
                # The first part: admit (or refuse) before reading the rest.
                admission = await self._handler.admit_stream(from_message(checked(first)), context)
                assembler = PartAssembler(message_cls, admission.max_bytes, admission.budget)
                assembler.add(first)

                async def rest() -> None:
                    async for part in parts:
                        assembler.add(part)
                try:
                    await asyncio.wait_for(rest(), self._stream_timeout_s)
                except asyncio.TimeoutError:
                    # A trickling client must not hold its queue slot: no draining either (the read
                    # was cancelled; the client may see INTERNAL, grpc/grpc#36066).
                    admission.close()
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"streamed {_DATACLASS_OF[message_cls].__name__} did not complete within "
                                        f"{self._stream_timeout_s:g} s of its first part")
                request = assembler.result()
            except PayloadTooLarge as error:
                await self._refuse_stream(parts, context, admission, grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
            except MalformedMessage as error:
                await self._refuse_stream(parts, context, admission, grpc.StatusCode.INVALID_ARGUMENT, str(error))
            except StageRefusal as refusal:
                await self._refuse_stream(parts, context, admission, refusal.code, refusal.message,
                                          refusal.trailing_metadata)
            except IncompleteStream as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            try:
                reply = await call(request, context, admission)
            except StageRefusal as refusal:
                await context.abort(refusal.code, refusal.message, refusal.trailing_metadata)
        finally:
            if admission is not None:
                admission.close()
        for part in split_parts(reply, self._chunk_bytes):
            yield part

    async def _refuse_stream(self, parts, context, admission: StreamAdmission | None, code: grpc.StatusCode,
                             message: str, trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        if admission is not None:
            admission.close()  # its queue slot is free while the rest of the stream is drained
        await drain(parts, max_bytes=self._max_stream_bytes)
        await context.abort(code, message, trailing_metadata)

    def ForwardStream(self, request_iterator, context):
        return self._streamed(request_iterator, context, stage_pb2.ForwardRequest, self._handler.forward)

    def BackwardStream(self, request_iterator, context):
        return self._streamed(request_iterator, context, stage_pb2.BackwardRequest, self._handler.backward)


# Methods another adapter serves (name -> (client streaming, server streaming)): this loop skips them.
_SERVED_ELSEWHERE: Mapping[str, tuple[bool, bool]] = MappingProxyType({"DownloadState": (False, True),
                                                                  "DeliverReceipt": (False, False),
                                                                  "DeliverAttestation": (False, False),
                                                                  "ProbeLink": (True, True)})


def add_stage_service(server: grpc.aio.Server, handler: StageHandler, *,
                      max_stream_bytes: int, chunk_bytes: int, stream_timeout_s: float = 30.0,
                      inference: InferenceHandler | None = None,
                      extra: Mapping[str, grpc.RpcMethodHandler] = MappingProxyType({})) -> None:
    """Serve `handler` as agora.v1.Stage on `server` (unary and streaming variants alike), with
    tolerant request parsing; `max_stream_bytes` bounds what a refused stream is drained of,
    `stream_timeout_s` how long an admitted one may take after its first part. `inference`
    serves Prefill, Decode and CloseSession (None: UNIMPLEMENTED). `extra`: methods whose adapter
    lives in a module of its own (DownloadState: protos/state_adapter.py, DeliverReceipt:
    protos/receipt_adapter.py, DeliverAttestation: protos/attestation_adapter.py, ProbeLink:
    protos/link_probe_adapter.py); one of those without a handler answers UNIMPLEMENTED."""
    servicer = _Servicer(handler, max_stream_bytes, chunk_bytes, stream_timeout_s, inference)
    handlers = dict(extra)
    for method in stage_pb2.DESCRIPTOR.services_by_name["Stage"].methods:
        if method.name in handlers or _SERVED_ELSEWHERE.get(method.name) == (method.client_streaming,
                                                                              method.server_streaming):
            continue
        if method.client_streaming != method.server_streaming:  # the .proto grew a kind this loop does not serve
            raise RuntimeError(f"stage adapter out of date: {method.name} streams one way only")
        factory = (grpc.stream_stream_rpc_method_handler if method.client_streaming
                   else grpc.unary_unary_rpc_method_handler)
        request_cls = getattr(stage_pb2, method.input_type.name)
        reply_cls = getattr(stage_pb2, method.output_type.name)
        handlers[method.name] = factory(getattr(servicer, method.name),
                                        request_deserializer=tolerant_parser(request_cls),
                                        response_serializer=reply_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _relayed(channel: grpc.aio.Channel, method: str, request_cls: type, reply_cls: type, reply_dataclass: type):
    """A unary call whose request is serialized and whose reply is parsed by protos/stage_relay_adapter.py
    (the reply's bytes fields are views of what grpc received: no copy on the relay's hot path)."""
    return channel.unary_unary(f"/{SERVICE_NAME}/{method}",
                               request_serializer=lambda request: encode_message(request, request_cls),
                               response_deserializer=lambda data: decode_message(data, reply_cls, reply_dataclass))


class StageStub:
    """The generated client stub, speaking dataclasses. Raises grpc.aio.AioRpcError on failure.

    Forward and Backward (unary) go through protos/stage_relay_adapter.py instead of the generated
    classes: the same bytes on the wire, four fewer copies of every frame per call; their replies'
    bytes fields are memoryviews. `relay=False` keeps the generated classes (the reference path,
    measured against in bench/trainer_relay.py)."""

    def __init__(self, channel: grpc.aio.Channel, *, relay: bool = True):
        self._stub = stage_pb2_grpc.StageStub(channel)
        self._forward = self._backward = None
        if relay:
            self._forward = _relayed(channel, "Forward", stage_pb2.ForwardRequest, stage_pb2.ForwardReply,
                                     ForwardReply)
            self._backward = _relayed(channel, "Backward", stage_pb2.BackwardRequest, stage_pb2.BackwardReply,
                                      BackwardReply)

    async def forward(self, request: ForwardRequest, **call: Any) -> ForwardReply:
        if self._forward is not None:
            return await self._forward(request, **call)
        return from_message(await self._stub.Forward(to_message(request), **call))

    async def backward(self, request: BackwardRequest, **call: Any) -> BackwardReply:
        if self._backward is not None:
            return await self._backward(request, **call)
        return from_message(await self._stub.Backward(to_message(request), **call))

    async def step(self, request: StepRequest, **call: Any) -> StepReply:
        return from_message(await self._stub.Step(to_message(request), **call))

    async def abort(self, request: AbortRequest, **call: Any) -> AbortReply:
        return from_message(await self._stub.Abort(to_message(request), **call))

    async def info(self, request: InfoRequest = InfoRequest(), **call: Any) -> InfoReply:
        return from_message(await self._stub.Info(to_message(request), **call))

    async def prefill(self, request: InferRequest, **call: Any) -> InferReply:
        return from_message(await self._stub.Prefill(to_message(request), **call))

    async def decode(self, request: InferRequest, **call: Any) -> InferReply:
        return from_message(await self._stub.Decode(to_message(request), **call))

    async def close_session(self, request: CloseSessionRequest, **call: Any) -> CloseSessionReply:
        return from_message(await self._stub.CloseSession(to_message(request), **call))

    async def forward_stream(self, request: ForwardRequest, *, chunk_bytes: int, max_reply_bytes: int,
                             **call: Any) -> ForwardReply:
        stream = self._stub.ForwardStream(iter(split_parts(request, chunk_bytes)), **call)
        return await _assemble(stream, stage_pb2.ForwardReply, max_reply_bytes)

    async def backward_stream(self, request: BackwardRequest, *, chunk_bytes: int, max_reply_bytes: int,
                              **call: Any) -> BackwardReply:
        stream = self._stub.BackwardStream(iter(split_parts(request, chunk_bytes)), **call)
        return await _assemble(stream, stage_pb2.BackwardReply, max_reply_bytes)
