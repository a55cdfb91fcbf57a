"""The generated classes of `agora.v1.Stage/ProbeLink`, a would-be member's link probe, as dataclasses.

A method of the Stage service with an adapter of its own, like DeliverAttestation
(protos/attestation_adapter.py): `agora-node doctor` times its link to a member of the stage it would
join (node/doctor_links.py), and the worker answers it within its bounds (node/worker/link_probe.py),
a concern apart from training and inference; the stage adapter serves this module's handler beside its
own (`add_stage_service(..., extra=...)`).

- One bidirectional stream per probe: the client leads (pings, an upload, a download ask) and the
  worker answers each step, so both sides time the same call and the worker holds one slot for it.
- A step is one `LinkProbe`: ``step`` names the oneof member set (``STEPS``), ``number`` carries a
  ping's number, the bytes received or the bytes asked for, ``data`` an upload's or a download's
  piece. A message that does not parse, or sets no step, is INVALID_ARGUMENT naming it.
- A handler's `StageRefusal` becomes its status, after the rest of the client's stream is read
  (bounded, `drain`): grpc.aio clients misreport an abort that lands while they are still writing.

Imports nothing of ours except the generated modules and stage_adapter's refusal beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Optional, Protocol

import grpc

from agora.protos import stage_pb2, stage_pb2_grpc
from agora.protos.serving import MalformedMessage, checked, drain, tolerant_parser
from agora.protos.stage_adapter import SERVICE_NAME, StageRefusal

__all__ = ["LINK_PROBE_METHOD", "LINK_PROBE_FULL_METHOD", "PROBE_CHUNK_BYTES", "STEPS", "LinkProbe",
           "LinkProbeHandler", "link_probe_method_handlers", "LinkProbeStub", "LinkProbeCall"]

LINK_PROBE_METHOD = "ProbeLink"
LINK_PROBE_FULL_METHOD = f"/{SERVICE_NAME}/{LINK_PROBE_METHOD}"
# The largest upload or download piece either side sends (what stage.proto promises).
PROBE_CHUNK_BYTES = 32 * 1024
STEPS = ("ping", "upload", "upload_done", "received", "download", "payload")
_BYTES_STEPS = frozenset({"upload", "payload"})
# What a refused probe's client may still send before its status goes out: a probe's whole upload.
_DRAIN_BYTES = 8 << 20


@dataclass(frozen=True)
class LinkProbe:
    """One step: ``step`` (one of ``STEPS``), its number (ping, received, download) or its bytes."""

    step: str
    number: int = 0
    data: bytes = b""


def _message(probe: LinkProbe) -> Any:
    if probe.step not in STEPS:
        raise ValueError(f"step: expected one of {', '.join(STEPS)}, got {probe.step!r}")
    if probe.step in _BYTES_STEPS:
        return stage_pb2.LinkProbe(**{probe.step: probe.data})
    if probe.step == "upload_done":
        return stage_pb2.LinkProbe(upload_done=True)
    return stage_pb2.LinkProbe(**{probe.step: probe.number})


def _probe(message: Any) -> LinkProbe:
    """The dataclass of a parsed message; MalformedMessage for one that sets no step."""
    step = checked(message).WhichOneof("step")
    if step is None:
        raise MalformedMessage("request: an agora.v1.LinkProbe that sets no step")
    value = getattr(message, step)
    if step in _BYTES_STEPS:
        return LinkProbe(step, data=bytes(value))
    return LinkProbe(step, number=0 if step == "upload_done" else int(value))


async def _probes(messages: AsyncIterator[Any]) -> AsyncIterator[LinkProbe]:
    async for message in messages:
        yield _probe(message)


class LinkProbeHandler(Protocol):
    """What a worker implements: answer the client's steps with `send`; raise `StageRefusal` to refuse."""

    def probe_link(self, probes: AsyncIterator[LinkProbe], send: Callable[[LinkProbe], Awaitable[None]],
                   context: Any) -> Awaitable[None]: ...


def link_probe_method_handlers(handler: LinkProbeHandler) -> Mapping[str, grpc.RpcMethodHandler]:
    """The ProbeLink method handler, for `stage_adapter.add_stage_service(..., extra=...)`."""

    async def probe_link(requests: AsyncIterator[Any], context: Any) -> None:
        async def send(probe: LinkProbe) -> None:
            await context.write(_message(probe))

        try:
            await handler.probe_link(_probes(requests), send, context)
        except MalformedMessage as error:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(error)
        except StageRefusal as refusal:
            code, message = refusal.code, refusal.message
        else:
            return
        await drain(requests, max_bytes=_DRAIN_BYTES)
        await context.abort(code, message)

    return {LINK_PROBE_METHOD: grpc.stream_stream_rpc_method_handler(
        probe_link, request_deserializer=tolerant_parser(stage_pb2.LinkProbe),
        response_serializer=stage_pb2.LinkProbe.SerializeToString)}


class LinkProbeStub:
    """The client side of ProbeLink, speaking dataclasses."""

    def __init__(self, channel: grpc.aio.Channel):
        self._stub = stage_pb2_grpc.StageStub(channel)

    def open(self, **call: Any) -> "LinkProbeCall":
        return LinkProbeCall(self._stub.ProbeLink(**call))


class LinkProbeCall:
    """One ProbeLink call in progress: write steps, read the worker's answers; grpc.aio.AioRpcError on failure."""

    def __init__(self, call: Any):
        self._call = call

    async def write(self, probe: LinkProbe) -> None:
        await self._call.write(_message(probe))

    async def read(self) -> Optional[LinkProbe]:
        """The worker's next step, or None when it ended the stream."""
        message = await self._call.read()
        return None if message is grpc.aio.EOF else _probe(message)

    async def done_writing(self) -> None:
        await self._call.done_writing()

    def cancel(self) -> None:
        self._call.cancel()
