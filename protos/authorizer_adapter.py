"""The one place that touches the generated `agora.v1.Authorizer` classes.

Everything else speaks the frozen dataclasses below. Design choices:

- The dataclasses mirror the messages field for field; conversion is one generic function over
  `dataclasses.fields` that recurses into nested messages (`Hardware`, the outcomes of
  `JoinReply`), turns repeated fields into tuples and maps proto3 `optional`/oneof members to
  None when unset.
- Requests are parsed by a tolerant deserializer: grpc's own answers a corrupt message (bad wire
  format, invalid UTF-8 in a string) with UNKNOWN, so here a message that does not parse reaches
  the servicer as `Malformed` and is answered INVALID_ARGUMENT naming the message type. The
  authorizer faces the internet; a peer's garbage must never look like our fault.
- Streaming RPCs are handed to the handler as an async iterator of dataclasses plus a `send`
  coroutine, so the handler owns the timing (the preflight is measured on the authorizer's
  clock) while this module owns the messages.
- `signed_payload` is the canonical byte string a node signs for a Join, a Renew, a trainer's
  Report or a Leave: a domain tag, then every field except the signature as sorted JSON (bytes as hex). Both
  sides build it here, so they cannot disagree on what was signed.

Imports nothing of ours except the generated modules beside it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Optional, Protocol

import grpc

from agora.protos import authorizer_pb2, authorizer_pb2_grpc
from agora.protos.serving import MalformedMessage, checked, tolerant_parser

__all__ = [
    "SERVICE_NAME",
    "RunRequest",
    "RunDescription",
    "ChallengeRequest",
    "Challenge",
    "LatencyProbe",
    "TransferControl",
    "Payload",
    "UploadReceipt",
    "Hardware",
    "JoinRequest",
    "Admitted",
    "Queued",
    "Refused",
    "JoinReply",
    "RenewRequest",
    "RenewReply",
    "WorkerReport",
    "ReportReceipt",
    "LeaveRequest",
    "LeaveReceipt",
    "RunFloors",
    "JoinCheck",
    "StageMember",
    "StageCapacity",
    "MalformedMessage",
    "AuthorizerHandler",
    "AuthorizerStub",
    "add_authorizer_service",
    "from_message",
    "signed_payload",
    "to_message",
    "DOWNLOAD_CHUNK_BYTES",
]

SERVICE_NAME: str = authorizer_pb2.DESCRIPTOR.services_by_name["Authorizer"].full_name  # "agora.v1.Authorizer"
DOWNLOAD_CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class RunRequest:
    pass


@dataclass(frozen=True)
class RunDescription:
    run_id: str
    config_json: str
    fingerprint: str
    root_pem: bytes = b""


@dataclass(frozen=True)
class ChallengeRequest:
    peer_id: str = ""
    role: str = ""
    renewal: bool = False


@dataclass(frozen=True)
class Challenge:
    nonce: bytes
    dial_token: bytes
    expires_in_s: float
    latency_probes: int = 0
    download_bytes: int = 0
    upload_bytes: int = 0


@dataclass(frozen=True)
class LatencyProbe:
    nonce: bytes = b""
    sequence: int = 0


@dataclass(frozen=True)
class TransferControl:
    nonce: bytes = b""
    received_bytes: int = 0


@dataclass(frozen=True)
class Payload:
    nonce: bytes = b""
    data: bytes = b""
    last: bool = False


@dataclass(frozen=True)
class UploadReceipt:
    received_bytes: int
    mbit_per_s: float


@dataclass(frozen=True)
class Hardware:
    device: str
    accelerator_memory_bytes: int
    ram_bytes: int


@dataclass(frozen=True)
class JoinRequest:
    nonce: bytes
    public_key_pem: bytes
    role: str
    fingerprint: str
    hardware: Optional[Hardware] = None
    stage: Optional[int] = None  # workers: None lets the authorizer assign one
    announce_host: str = ""  # workers only
    announce_port: int = 0
    signature: bytes = b""


@dataclass(frozen=True)
class Admitted:
    credential_pem: bytes
    root_pem: bytes
    run_id: str
    role: str
    lifetime_s: float
    config_json: str
    initial_peers: tuple[str, ...] = ()
    stage: Optional[int] = None
    run_signature: bytes = b""


@dataclass(frozen=True)
class Queued:
    position: int
    retry_after_s: float


@dataclass(frozen=True)
class Refused:
    reason: str
    field: str = ""


@dataclass(frozen=True)
class JoinReply:
    """Exactly one of the three is set."""

    admitted: Optional[Admitted] = None
    queued: Optional[Queued] = None
    refused: Optional[Refused] = None


@dataclass(frozen=True)
class RenewRequest:
    nonce: bytes
    credential_pem: bytes
    signature: bytes = b""


@dataclass(frozen=True)
class RenewReply:
    credential_pem: bytes
    lifetime_s: float


@dataclass(frozen=True)
class WorkerReport:
    nonce: bytes
    credential_pem: bytes
    peer_id: str
    stage: int
    kind: str
    feature: str
    cusum: float
    replies: int
    reason: str = ""
    signature: bytes = b""


@dataclass(frozen=True)
class ReportReceipt:
    reporters: int
    needed: int
    banned: bool


@dataclass(frozen=True)
class LeaveRequest:
    nonce: bytes
    credential_pem: bytes
    reason: str = ""
    signature: bytes = b""


@dataclass(frozen=True)
class LeaveReceipt:
    freed: bool


@dataclass(frozen=True)
class RunFloors:
    min_upload_mbit: float
    min_download_mbit: float
    max_rtt_ms: float
    min_accelerator_gb: float
    min_ram_gb: float


@dataclass(frozen=True)
class StageMember:
    """One current member of a stage, as a Join's dry run shows it: its announced address and compute,
    and its peer id (the TLS name a link probe dials it by; empty: not known)."""

    address: str
    samples_per_s: float = 0.0
    peer_id: str = ""


@dataclass(frozen=True)
class StageCapacity:
    """One stage as a Join's dry run sums it up: its current members, how many of them announce no
    compute, and the compute the others announce in all (samples/s per job)."""

    stage: int
    members: int = 0
    unknown_members: int = 0
    samples_per_s: float = 0.0


@dataclass(frozen=True)
class JoinCheck:
    """A Join's dry run: ``refused`` when a check before the measurements failed, else the rest;
    ``probe_credential_pem``: for a link probe of the members shown (empty: none issued)."""

    refused: Optional[Refused] = None
    rtt_ms: float = 0.0
    download_mbit: float = 0.0
    upload_mbit: float = 0.0
    floors: Optional[RunFloors] = None
    unreachable: str = ""
    stage: Optional[int] = None
    server_time: float = 0.0
    tolerated_skew_s: float = 0.0
    members: tuple[StageMember, ...] = ()
    member_samples_per_s: tuple[float, ...] = ()
    stage_capacities: tuple[StageCapacity, ...] = ()
    probe_credential_pem: bytes = b""
    probe_lifetime_s: float = 0.0


# Read-only pairing of each dataclass with its generated message class.
_MESSAGE_OF: Mapping[type, type] = MappingProxyType({
    RunRequest: authorizer_pb2.RunRequest,
    RunDescription: authorizer_pb2.RunDescription,
    ChallengeRequest: authorizer_pb2.ChallengeRequest,
    Challenge: authorizer_pb2.Challenge,
    LatencyProbe: authorizer_pb2.LatencyProbe,
    TransferControl: authorizer_pb2.TransferControl,
    Payload: authorizer_pb2.Payload,
    UploadReceipt: authorizer_pb2.UploadReceipt,
    Hardware: authorizer_pb2.Hardware,
    JoinRequest: authorizer_pb2.JoinRequest,
    Admitted: authorizer_pb2.Admitted,
    Queued: authorizer_pb2.Queued,
    Refused: authorizer_pb2.Refused,
    JoinReply: authorizer_pb2.JoinReply,
    RenewRequest: authorizer_pb2.RenewRequest,
    RenewReply: authorizer_pb2.RenewReply,
    WorkerReport: authorizer_pb2.WorkerReport,
    ReportReceipt: authorizer_pb2.ReportReceipt,
    LeaveRequest: authorizer_pb2.LeaveRequest,
    LeaveReceipt: authorizer_pb2.LeaveReceipt,
    RunFloors: authorizer_pb2.RunFloors,
    JoinCheck: authorizer_pb2.JoinCheck,
    StageMember: authorizer_pb2.StageMember,
    StageCapacity: authorizer_pb2.StageCapacity,
})
_DATACLASS_OF: Mapping[type, type] = MappingProxyType({message: data for data, message in _MESSAGE_OF.items()})


def to_message(value: Any) -> Any:
    """The generated message for one of this module's dataclasses (None fields left unset)."""
    values = {}
    for f in dataclasses.fields(value):
        item = getattr(value, f.name)
        if item is None:
            continue
        if dataclasses.is_dataclass(item):
            item = to_message(item)
        elif isinstance(item, tuple):
            item = [to_message(entry) if dataclasses.is_dataclass(entry) else entry for entry in item]
        values[f.name] = item
    return _MESSAGE_OF[type(value)](**values)


def from_message(message: Any) -> Any:
    """The dataclass for a generated message; unset optional and oneof fields become None."""
    cls = _DATACLASS_OF[type(message)]
    descriptor = message.DESCRIPTOR.fields_by_name
    values = {}
    for f in dataclasses.fields(cls):
        field = descriptor[f.name]
        if field.is_repeated and field.message_type is not None:
            values[f.name] = tuple(from_message(entry) for entry in getattr(message, f.name))
        elif field.is_repeated:
            values[f.name] = tuple(getattr(message, f.name))
        elif field.has_presence and not message.HasField(f.name):
            values[f.name] = None
        elif field.message_type is not None:
            values[f.name] = from_message(getattr(message, f.name))
        else:
            values[f.name] = getattr(message, f.name)
    return cls(**values)


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def signed_payload(request: JoinRequest | RenewRequest | WorkerReport | LeaveRequest) -> bytes:
    """What the node signs: a domain tag and every field but the signature, canonically."""
    tag = {JoinRequest: b"agora-join-v1\0", RenewRequest: b"agora-renew-v1\0",
           WorkerReport: b"agora-report-v1\0", LeaveRequest: b"agora-leave-v1\0"}[type(request)]
    fields = _plain(dataclasses.replace(request, signature=b""))
    del fields["signature"]
    return tag + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


# ---- server side

async def _dataclasses(messages: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for message in messages:
        yield from_message(checked(message))


class AuthorizerHandler(Protocol):
    """What the authorizer implements; `context` is the grpc.aio.ServicerContext (to abort)."""

    def get_run(self, request: RunRequest, context: Any) -> Awaitable[RunDescription]: ...
    def get_challenge(self, request: ChallengeRequest, context: Any) -> Awaitable[Challenge]: ...
    def measure_latency(self, probes: AsyncIterator[LatencyProbe], send: Callable[[LatencyProbe], Awaitable[None]],
                        context: Any) -> Awaitable[None]: ...
    def measure_download(self, controls: AsyncIterator[TransferControl], send: Callable[[Payload], Awaitable[None]],
                         context: Any) -> Awaitable[None]: ...
    def measure_upload(self, chunks: AsyncIterator[Payload], context: Any) -> Awaitable[UploadReceipt]: ...
    def join(self, request: JoinRequest, context: Any) -> Awaitable[JoinReply]: ...
    def renew(self, request: RenewRequest, context: Any) -> Awaitable[RenewReply]: ...
    def report(self, request: WorkerReport, context: Any) -> Awaitable[ReportReceipt]: ...
    def leave(self, request: LeaveRequest, context: Any) -> Awaitable[LeaveReceipt]: ...
    def check_join(self, request: JoinRequest, context: Any) -> Awaitable[JoinCheck]: ...


class _Servicer:
    def __init__(self, handler: AuthorizerHandler):
        self._handler = handler

    async def _unary(self, call: Callable[[Any, Any], Awaitable[Any]], request: Any, context: Any) -> Any:
        try:
            value = from_message(checked(request))
        except MalformedMessage as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return to_message(await call(value, context))

    async def GetRun(self, request, context):
        return await self._unary(self._handler.get_run, request, context)

    async def GetChallenge(self, request, context):
        return await self._unary(self._handler.get_challenge, request, context)

    async def Join(self, request, context):
        return await self._unary(self._handler.join, request, context)

    async def Renew(self, request, context):
        return await self._unary(self._handler.renew, request, context)

    async def Report(self, request, context):
        return await self._unary(self._handler.report, request, context)

    async def Leave(self, request, context):
        return await self._unary(self._handler.leave, request, context)

    async def CheckJoin(self, request, context):
        return await self._unary(self._handler.check_join, request, context)

    async def _streaming(self, run: Callable[[], Awaitable[Any]], context: Any) -> Any:
        try:
            return await run()
        except MalformedMessage as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

    async def MeasureLatency(self, request_iterator, context):
        send = lambda probe: context.write(to_message(probe))  # noqa: E731
        await self._streaming(lambda: self._handler.measure_latency(_dataclasses(request_iterator), send, context),
                              context)

    async def MeasureDownload(self, request_iterator, context):
        send = lambda payload: context.write(to_message(payload))  # noqa: E731
        await self._streaming(lambda: self._handler.measure_download(_dataclasses(request_iterator), send, context),
                              context)

    async def MeasureUpload(self, request_iterator, context):
        receipt = await self._streaming(lambda: self._handler.measure_upload(_dataclasses(request_iterator), context),
                                        context)
        return to_message(receipt)


_KINDS = {
    "GetRun": (grpc.unary_unary_rpc_method_handler, authorizer_pb2.RunRequest),
    "GetChallenge": (grpc.unary_unary_rpc_method_handler, authorizer_pb2.ChallengeRequest),
    "MeasureLatency": (grpc.stream_stream_rpc_method_handler, authorizer_pb2.LatencyProbe),
    "MeasureDownload": (grpc.stream_stream_rpc_method_handler, authorizer_pb2.TransferControl),
    "MeasureUpload": (grpc.stream_unary_rpc_method_handler, authorizer_pb2.Payload),
    "Join": (grpc.unary_unary_rpc_method_handler, authorizer_pb2.JoinRequest),
    "Renew": (grpc.unary_unary_rpc_method_handler, authorizer_pb2.RenewRequest),
    "Report": (grpc.unary_unary_rpc_method_handler, authorizer_pb2.WorkerReport),
    "Leave": (grpc.unary_unary_rpc_method_handler, authorizer_pb2.LeaveRequest),
    "CheckJoin": (grpc.unary_unary_rpc_method_handler, authorizer_pb2.JoinRequest),
}


def add_authorizer_service(server: grpc.aio.Server, handler: AuthorizerHandler) -> None:
    """Serve `handler` as agora.v1.Authorizer on `server`, with tolerant request parsing."""
    servicer = _Servicer(handler)
    methods = authorizer_pb2.DESCRIPTOR.services_by_name["Authorizer"].methods_by_name
    if set(methods) != set(_KINDS):  # the .proto grew a method this table does not serve
        raise RuntimeError(f"authorizer adapter out of date: {sorted(set(methods) ^ set(_KINDS))}")
    handlers = {}
    for name, (factory, request_cls) in _KINDS.items():
        reply_cls = getattr(authorizer_pb2, methods[name].output_type.name)
        handlers[name] = factory(getattr(servicer, name), request_deserializer=tolerant_parser(request_cls),
                                 response_serializer=reply_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


# ---- client side

class AuthorizerStub:
    """The generated client stub, speaking dataclasses. Raises grpc.aio.AioRpcError on failure."""

    def __init__(self, channel: grpc.aio.Channel):
        self._stub = authorizer_pb2_grpc.AuthorizerStub(channel)

    async def get_run(self, **call: Any) -> RunDescription:
        return from_message(await self._stub.GetRun(to_message(RunRequest()), **call))

    async def get_challenge(self, request: ChallengeRequest, **call: Any) -> Challenge:
        return from_message(await self._stub.GetChallenge(to_message(request), **call))

    async def join(self, request: JoinRequest, **call: Any) -> JoinReply:
        return from_message(await self._stub.Join(to_message(request), **call))

    async def renew(self, request: RenewRequest, **call: Any) -> RenewReply:
        return from_message(await self._stub.Renew(to_message(request), **call))

    async def report(self, request: WorkerReport, **call: Any) -> ReportReceipt:
        return from_message(await self._stub.Report(to_message(request), **call))

    async def leave(self, request: LeaveRequest, **call: Any) -> LeaveReceipt:
        return from_message(await self._stub.Leave(to_message(request), **call))

    async def check_join(self, request: JoinRequest, **call: Any) -> JoinCheck:
        return from_message(await self._stub.CheckJoin(to_message(request), **call))

    async def echo_latency(self, nonce: bytes, **call: Any) -> int:
        """Answer the authorizer's latency probes until it ends the stream; returns the count."""
        stream = self._stub.MeasureLatency(**call)
        await stream.write(to_message(LatencyProbe(nonce=nonce)))
        echoed = 0
        while (probe := await stream.read()) is not grpc.aio.EOF:
            await stream.write(to_message(LatencyProbe(sequence=probe.sequence)))
            echoed += 1
        await stream.done_writing()
        return echoed

    async def download(self, nonce: bytes, *, max_bytes: int, **call: Any) -> int:
        """Receive the authorizer's download and acknowledge it; returns the bytes received."""
        stream = self._stub.MeasureDownload(**call)
        await stream.write(to_message(TransferControl(nonce=nonce)))
        received = 0
        while (payload := await stream.read()) is not grpc.aio.EOF:
            received += len(payload.data)
            if received > max_bytes:
                stream.cancel()
                raise ValueError(f"download: the authorizer sent more than the {max_bytes} bytes announced")
            if payload.last:
                await stream.write(to_message(TransferControl(received_bytes=received)))
                await stream.done_writing()
        return received

    async def upload(self, nonce: bytes, *, size: int, chunk_bytes: int = DOWNLOAD_CHUNK_BYTES,
                     **call: Any) -> UploadReceipt:
        """Stream `size` bytes to the authorizer; returns what it measured."""
        async def chunks():
            sent, block = 0, bytes(chunk_bytes)
            yield to_message(Payload(nonce=nonce))
            while sent < size:
                piece = block[:min(chunk_bytes, size - sent)]
                sent += len(piece)
                yield to_message(Payload(data=piece))
        return from_message(await self._stub.MeasureUpload(chunks(), **call))
