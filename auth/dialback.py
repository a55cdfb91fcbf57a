"""The authorizer's dial-back: it connects to the address a worker announced and expects the
challenge's dial token back (the worker's reachability listener, auth/admission.py)."""

from __future__ import annotations

import asyncio
from typing import Optional

from agora.auth.policy import DIALBACK_PREFIX, dialback_answer

__all__ = ["dial_back"]


async def dial_back(host: str, port: int, token: bytes, timeout_s: float) -> Optional[str]:
    """Connect to a worker's announced address and check its listener's answer; None when it is
    reachable, else what went wrong (one phrase)."""
    expected = dialback_answer(token)
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        answer = await asyncio.wait_for(reader.readline(), timeout_s)
    except asyncio.TimeoutError:
        return f"no answer within {timeout_s:g} s" if writer is not None else f"no connection within {timeout_s:g} s"
    except (OSError, ValueError) as error:  # refused, unreachable, unknown host; a line too long
        return getattr(error, "strerror", None) or str(error) or type(error).__name__
    finally:
        if writer is not None:
            writer.close()
    if answer == expected:
        return None
    if answer.startswith(DIALBACK_PREFIX):
        return "it answered with another challenge's token (a stale listener, or another node on that address)"
    return "something else answers on that port (not this node's admission listener)"
