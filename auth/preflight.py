"""The preflight's measurements, timed by the authorizer on its own clock, never self-reported.

Design choices:

- Latency: the authorizer sends numbered probes and times each echo. Download: from the first
  byte sent to the node's acknowledgement of the last. Upload: from the opening message to the
  last byte. Each is recorded on the challenge (auth/challenges.py) that the stream names in its
  first message, and Join reads them there.
- Checks, in order: the stream's first message (within ``first_message_s``: an idle stream holds
  a call slot, so it is not given the challenge's whole lifetime), the challenge (open, issued to
  this caller, with a measurement of this kind), then ``ChallengeState.begin`` (one measurement
  of a challenge at a time, each kind once). Only then does a byte of the transfer move, and
  every step is bounded by the challenge's expiry.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from agora.auth.challenges import ChallengeBook, ChallengeState
from agora.auth.credentials import Clock
from agora.auth.policy import upload_mbit
from agora.auth.status import Status
from agora.protos.authorizer_adapter import DOWNLOAD_CHUNK_BYTES, LatencyProbe, Payload, UploadReceipt

__all__ = ["PreflightMeter"]


class PreflightMeter:
    """Runs the three measurement streams against the challenges of ``book``."""

    def __init__(self, book: ChallengeBook, *, clock: Clock, timer: Clock, download_block: bytes,
                 first_message_s: float = 10.0):
        self._book, self._clock, self._timer = book, clock, timer
        self._block = download_block  # incompressible, DOWNLOAD_CHUNK_BYTES long
        self.first_message_s = first_message_s

    async def _open(self, stream: AsyncIterator[Any], caller: str, kind: str) -> ChallengeState:
        """The challenge a stream names in its first message, with its ``kind`` measurement begun."""
        try:
            first = await asyncio.wait_for(anext(stream, None), self.first_message_s)
        except asyncio.TimeoutError:
            first = None
        if first is None:
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, f"{kind}: the stream must open with the challenge nonce "
                                                           f"(within {self.first_message_s:g} s)")
        state = self._book.peek(first.nonce, caller, self._clock())
        size = {"latency": state.latency_probes, "download": state.download_bytes, "upload": state.upload_bytes}[kind]
        if size == 0:
            raise Status(grpc.StatusCode.FAILED_PRECONDITION, f"{kind}: not part of this challenge")
        state.begin(kind)
        return state

    async def _within(self, state: ChallengeState, awaitable: Awaitable[Any], kind: str) -> Any:
        """Await one step of a preflight stream, bounded by the challenge's expiry."""
        try:
            return await asyncio.wait_for(awaitable, max(1e-3, state.expires_at - self._clock()))
        except asyncio.TimeoutError:
            raise Status(grpc.StatusCode.FAILED_PRECONDITION,
                         f"{kind}: not finished before the challenge expired") from None

    async def latency(self, probes: AsyncIterator[LatencyProbe], send: Callable[[LatencyProbe], Awaitable[None]],
                      caller: str) -> None:
        state = await self._open(probes, caller, "latency")
        try:
            samples = []
            for sequence in range(state.latency_probes):
                start = self._timer()
                await self._within(state, send(LatencyProbe(sequence=sequence)), "latency")
                echo = await self._within(state, anext(probes, None), "latency")
                if echo is None or echo.sequence != sequence:
                    raise Status(grpc.StatusCode.INVALID_ARGUMENT, f"latency: expected the echo of probe {sequence}")
                samples.append(self._timer() - start)
            state.rtts_s = samples
        finally:
            state.end()

    async def download(self, controls: AsyncIterator[Any], send: Callable[[Payload], Awaitable[None]],
                       caller: str) -> None:
        state = await self._open(controls, caller, "download")
        try:
            start, sent = self._timer(), 0
            while sent < state.download_bytes:
                piece = self._block[:min(DOWNLOAD_CHUNK_BYTES, state.download_bytes - sent)]
                sent += len(piece)
                await self._within(state, send(Payload(data=piece, last=sent == state.download_bytes)), "download")
            ack = await self._within(state, anext(controls, None), "download")
            elapsed = self._timer() - start
            if ack is None:
                raise Status(grpc.StatusCode.INVALID_ARGUMENT, "download: the stream ended without an acknowledgement")
            state.download = (min(ack.received_bytes, sent), elapsed)
        finally:
            state.end()

    async def upload(self, chunks: AsyncIterator[Payload], caller: str) -> UploadReceipt:
        state = await self._open(chunks, caller, "upload")
        try:
            start, received = self._timer(), 0
            while (chunk := await self._within(state, anext(chunks, None), "upload")) is not None:
                received += len(chunk.data)
                if received > state.upload_bytes:
                    raise Status(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"upload: more than the challenge's {state.upload_bytes} bytes")
            elapsed = self._timer() - start
            state.upload = (received, elapsed)
        finally:
            state.end()
        return UploadReceipt(received_bytes=received, mbit_per_s=upload_mbit(received, elapsed))
