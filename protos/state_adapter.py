"""The generated classes of `agora.v1.Stage/DownloadState`, the weight-sync download, as dataclasses.

A method of the Stage service with an adapter of its own, so that state transfer stays apart from
the training and inference calls (protos/stage_adapter.py serves those and takes this module's
handler beside them). Design choices:

- One request, a stream of chunks: the donor writes chunk after chunk with `send` (grpc.aio's
  `context.write`), which waits for the joiner's flow-control window, so a joiner that reads slowly
  slows its donor's writes instead of making it buffer the stage; the donor bounds how long one
  write may wait (`StateHandler` implementations time it out).
- The request is parsed tolerantly (protos/serving.py): bytes that are no `StateRequest` are
  INVALID_ARGUMENT naming it; a handler's `StageRefusal` becomes its status.
- The client side (`StateStub.download`) is a `StateCall`: read the `StateChunk`s in turn, cancel it
  to drop it; grpc's errors surface as `grpc.aio.AioRpcError` for the caller to judge (try another
  donor, resume).

Imports nothing of ours except the generated modules and stage_adapter's refusal beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Protocol

import grpc

from agora.protos import stage_pb2, stage_pb2_grpc
from agora.protos.serving import MalformedMessage, checked, tolerant_parser
from agora.protos.stage_adapter import StageRefusal

__all__ = ["DOWNLOAD_METHOD", "StateRequest", "StateChunk", "StateHandler", "state_method_handlers", "StateStub",
           "StateCall"]

DOWNLOAD_METHOD = "DownloadState"


@dataclass(frozen=True)
class StateRequest:
    run_id: str
    stage: int
    snapshot_id: str = ""  # resume: the snapshot being received ("" : the donor's current one)
    offset: int = 0  # resume: bytes of it already held
    sketch_seed: int = 0  # with sketch_size > 0: the member's sketch of its own state under this seed, not the state
    sketch_size: int = 0


@dataclass(frozen=True)
class StateChunk:
    snapshot_id: str
    offset: int  # where `data` starts in the state's byte stream
    data: bytes
    total_bytes: int  # the whole stream's length
    sha256: str  # the whole stream's digest (hex)
    step: int  # the donor's optimizer step in the snapshot


def _request(message: Any) -> StateRequest:
    return StateRequest(run_id=message.run_id, stage=message.stage, snapshot_id=message.snapshot_id,
                        offset=message.offset, sketch_seed=message.sketch_seed, sketch_size=message.sketch_size)


def _chunk_message(chunk: StateChunk) -> Any:
    return stage_pb2.StateChunk(snapshot_id=chunk.snapshot_id, offset=chunk.offset, data=chunk.data,
                                total_bytes=chunk.total_bytes, sha256=chunk.sha256, step=chunk.step)


def _chunk(message: Any) -> StateChunk:
    return StateChunk(snapshot_id=message.snapshot_id, offset=message.offset, data=message.data,
                      total_bytes=message.total_bytes, sha256=message.sha256, step=message.step)


class StateHandler(Protocol):
    """What a donor implements: write the chunks with `send`; raise `StageRefusal` to refuse."""

    def download_state(self, request: StateRequest, send: Callable[[StateChunk], Awaitable[None]],
                       context: Any) -> Awaitable[None]: ...


def state_method_handlers(handler: StateHandler) -> Mapping[str, grpc.RpcMethodHandler]:
    """The DownloadState method handler, for `stage_adapter.add_stage_service(..., extra=...)`."""

    async def download_state(request: Any, context: Any) -> None:
        try:
            value = _request(checked(request))
        except MalformedMessage as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

        async def send(chunk: StateChunk) -> None:
            await context.write(_chunk_message(chunk))

        try:
            await handler.download_state(value, send, context)
        except StageRefusal as refusal:
            await context.abort(refusal.code, refusal.message)

    return {DOWNLOAD_METHOD: grpc.unary_stream_rpc_method_handler(
        download_state, request_deserializer=tolerant_parser(stage_pb2.StateRequest),
        response_serializer=stage_pb2.StateChunk.SerializeToString)}


class StateStub:
    """The client side of DownloadState, speaking dataclasses."""

    def __init__(self, channel: grpc.aio.Channel):
        self._stub = stage_pb2_grpc.StageStub(channel)

    def download(self, request: StateRequest, **call: Any) -> "StateCall":
        return StateCall(self._stub.DownloadState(stage_pb2.StateRequest(
            run_id=request.run_id, stage=request.stage, snapshot_id=request.snapshot_id, offset=request.offset,
            sketch_seed=request.sketch_seed, sketch_size=request.sketch_size), **call))


class StateCall:
    """One DownloadState call in progress: read its chunks in turn, or cancel it."""

    def __init__(self, call: Any):
        self._call = call

    async def next(self) -> StateChunk | None:
        """The next chunk, or None when the donor ended the stream; grpc.aio.AioRpcError on failure."""
        message = await self._call.read()
        return None if message is grpc.aio.EOF else _chunk(message)

    def cancel(self) -> None:
        self._call.cancel()
