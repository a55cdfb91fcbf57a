"""What every gRPC service here does with a request stream it refuses: read it to its end first.

grpc.aio clients that are still writing when the server aborts report INTERNAL ("Internal error
from Core") instead of the status the server sent (grpc/grpc#36066), so a refused stream is read
and dropped until the client half-closes, then the status goes out. The read is bounded in bytes,
parts and seconds, so a client that never stops cannot hold the call: past a bound the status goes
out anyway (and that client may see INTERNAL). Used by the Stage adapter (an oversized or malformed
stream) and by the per-call credential check (a stream refused at the door).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterable, Optional

import grpc

__all__ = ["DRAIN_S", "drain"]

DRAIN_S = 5.0


async def drain(parts: AsyncIterable[Any], *, max_bytes: Optional[int] = None, max_parts: Optional[int] = None,
                timeout_s: float = DRAIN_S) -> None:
    """Read and drop the rest of a refused stream, up to `max_bytes`, `max_parts` and `timeout_s`."""
    async def read() -> None:
        seen = count = 0
        async for part in parts:
            count += 1
            size = getattr(part, "ByteSize", None)  # protobuf messages; a part that did not parse has none
            seen += size() if size is not None else 0
            if (max_bytes is not None and seen > max_bytes) or (max_parts is not None and count >= max_parts):
                return
    try:
        await asyncio.wait_for(read(), timeout_s)
    except (asyncio.TimeoutError, grpc.RpcError, ValueError):
        pass  # the status goes out regardless
