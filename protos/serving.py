"""What every service adapter does with what a peer sends before a handler sees it.

- Parse tolerantly: grpc's own deserializer answers bytes that are no protobuf (or a string field
  with invalid UTF-8) with UNKNOWN and logs the DecodeError as the servicer's exception. The
  adapters deserialize with `tolerant_parser`, which hands bytes that do not parse through as a
  `Malformed` marker; `checked` turns it into `MalformedMessage`, which the adapter answers with
  INVALID_ARGUMENT naming the message type.
- Read a refused request stream to its end (`drain`): grpc.aio clients that are still writing
  when the server aborts report INTERNAL ("Internal error from Core") instead of the status the
  server sent (grpc/grpc#36066), so the rest of a refused stream is read and dropped until the
  client half-closes, then the status goes out. The read is bounded in bytes, parts and seconds,
  so a client that never stops cannot hold the call: past a bound the status goes out anyway (and
  that client may see INTERNAL). Used by the Stage adapter (an oversized or malformed stream), by
  the per-call credential check (a stream refused at the door) and by the authorizer's upload
  measurement (a challenge busy, unknown or overrun).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterable, Callable, Optional

import grpc
from google.protobuf.message import DecodeError

__all__ = ["DRAIN_S", "Malformed", "MalformedMessage", "checked", "drain", "tolerant_parser"]

DRAIN_S = 5.0


class MalformedMessage(ValueError):
    """A request (or a streamed part of one) that does not parse as its message type."""


@dataclass(frozen=True)
class Malformed:
    """What the tolerant deserializer hands the servicer for bytes that do not parse."""

    message_type: str
    error: str
    size: int

    def ByteSize(self) -> int:  # noqa: N802 - counted like a message while draining
        return self.size


def tolerant_parser(message_cls: type) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except (DecodeError, ValueError) as error:
            return Malformed(message_cls.DESCRIPTOR.full_name, str(error), len(data))
    return parse


def checked(message: Any) -> Any:
    """The request's message; MalformedMessage when the tolerant deserializer could not parse it."""
    if isinstance(message, Malformed):
        raise MalformedMessage(f"request: not a valid {message.message_type} message ({message.error})")
    return message


async def drain(parts: AsyncIterable[Any], *, max_bytes: Optional[int] = None, max_parts: Optional[int] = None,
                timeout_s: float = DRAIN_S, size: Callable[[Any], int] = lambda part: part.ByteSize()) -> None:
    """Read and drop the rest of a refused stream, up to `max_bytes` (each part's `size`), `max_parts`
    and `timeout_s`."""
    async def read() -> None:
        seen = count = 0
        async for part in parts:
            count += 1
            seen += size(part)
            if (max_bytes is not None and seen > max_bytes) or (max_parts is not None and count >= max_parts):
                return
    try:
        await asyncio.wait_for(read(), timeout_s)
    except (asyncio.TimeoutError, grpc.RpcError, ValueError):
        pass  # the status goes out regardless
