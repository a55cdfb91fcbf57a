"""How the authorizer's handlers answer a fault: raise ``Status`` (or a ``ChallengeError``) anywhere
below a handler decorated with ``answers``, and the call ends with that gRPC status, its message,
and a ``retry-after`` trailer when the caller should come back later."""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Optional
from urllib.parse import unquote

import grpc

from agora.auth.challenges import ChallengeError

__all__ = ["Status", "answers", "caller_address"]

logger = logging.getLogger("agora.auth.service")

_CHALLENGE_STATUS = {"unknown": grpc.StatusCode.FAILED_PRECONDITION, "wrong_caller": grpc.StatusCode.PERMISSION_DENIED,
                     "full": grpc.StatusCode.RESOURCE_EXHAUSTED, "busy": grpc.StatusCode.FAILED_PRECONDITION,
                     "repeated": grpc.StatusCode.FAILED_PRECONDITION}


class Status(Exception):
    """A gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: Optional[float] = None):
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


def answers(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Turn ``Status`` and ``ChallengeError`` into the call's status (the context is the last argument)."""
    async def wrapped(self: Any, *args: Any) -> Any:
        context = args[-1]
        try:
            return await handler(self, *args)
        except ChallengeError as error:
            status = Status(_CHALLENGE_STATUS[error.kind], str(error), error.retry_after_s)
        except Status as error:
            status = error
        metadata = () if status.retry_after_s is None else (("retry-after", f"{status.retry_after_s:.1f}"),)
        logger.debug("authorizer: %s to %s: %s", status.code.name, context.peer(), status.message)
        await context.abort(status.code, status.message, trailing_metadata=metadata)
    wrapped.__name__, wrapped.__doc__ = handler.__name__, handler.__doc__
    return wrapped


def caller_address(peer: str) -> str:
    """The IP address in a grpc peer string ("ipv4:1.2.3.4:5"; "ipv6:%5B::1%5D:5", grpc escapes
    the brackets)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return unquote(rest).rsplit(":", 1)[0].strip("[]")
    return peer
