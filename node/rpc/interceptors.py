"""The server interceptor chain every gRPC service of a node sits behind.

Cross-cutting concerns (logging; the per-call credential, role and run-fingerprint check,
node/rpc/auth_check.py; metrics, node/rpc/metrics_hook.py) live here, never in handlers. Design choices:

- `CallHook` is the one extension point: a `grpc.aio.ServerInterceptor` that wraps each method
  handler's behaviour. `before(call, context)` runs ahead of the handler and may abort the call
  (a credential check: `await context.abort(UNAUTHENTICATED, ...)`); `after(record)` observes
  the outcome. Wrapping the behaviour rather than the lookup is what gives access to the peer,
  the metadata and the final status code, which `HandlerCallDetails` alone does not carry.
- The status is read from what the handler did: a normal return is OK, `context.abort` leaves
  its code on the context, a cancelled call is CANCELLED, an escaping exception is UNKNOWN
  (what grpc itself answers).
- Time comes from an injected clock, so tests can pin durations.
- Streaming calls are wrapped like unary ones; the duration covers the whole stream.
- A hook may also wrap the method's (de)serializers (`codecs`), which see every message's bytes:
  that is where wire bytes are counted, streams included.
- A hook that holds something for the length of a call (a slot, node/rpc/call_slots.py; a span,
  node/rpc/tracing.py) returns it from `before` and gets it back in `release` with the call's record,
  which runs once when a call `before` let through ends, whatever its outcome: a call refused in
  `before` took nothing and gives nothing back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import grpc

__all__ = ["CallInfo", "CallRecord", "CallHook", "LoggingInterceptor", "interceptor_chain", "peer_host"]

Clock = Callable[[], float]


@dataclass(frozen=True)
class CallInfo:
    method: str  # full method name, "/agora.v1.Stage/Forward"
    peer: str  # "ipv4:127.0.0.1:53122"
    # A request-streaming call's parts (an async iterator), so a hook that refuses the call can read
    # what the client is still sending first: aborting mid-stream makes grpc.aio clients see
    # INTERNAL instead of the status (grpc/grpc#36066). None for unary requests.
    request_stream: Any = field(default=None, compare=False, repr=False)


    @property
    def host(self) -> str:
        return peer_host(self.peer)


def peer_host(peer: str) -> str:
    """A grpc peer's address without the port: ``ipv4:10.0.0.5:53122`` -> ``10.0.0.5``."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.split(":", 1)[1].rsplit(":", 1)[0]
    return peer


@dataclass(frozen=True)
class CallRecord:
    method: str
    peer: str
    code: grpc.StatusCode
    details: str
    duration_s: float


def _outcome(context: Any, error: BaseException | None) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, "cancelled"
    code = context.code()
    details = context.details() or ""
    if isinstance(code, int):  # grpc.aio reports some codes as raw integers
        code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    if code is not None:
        return code, details
    if error is None:
        return grpc.StatusCode.OK, details
    return grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}"


class CallHook(grpc.aio.ServerInterceptor):
    """Base interceptor: override `before` (may abort) and/or `after` (observe)."""

    def __init__(self, *, clock: Clock = time.monotonic):
        self._clock = clock

    async def before(self, call: CallInfo, context: Any) -> Any:
        """Runs ahead of the handler; abort the call here to refuse it. What it returns is handed
        to `release` when the call ends."""

    def after(self, record: CallRecord) -> None:
        """Runs when the call ends, whatever its outcome. Must not raise."""

    def release(self, call: CallInfo, held: Any, record: CallRecord) -> None:
        """Runs when a call that `before` let through ends, with what `before` returned and the call's
        outcome (before `after`). Must not raise."""

    def codecs(self, method: str, deserialize: Any, serialize: Any) -> tuple[Any, Any]:
        """The request deserializer and reply serializer to use for `method` (default: unchanged)."""
        return deserialize, serialize

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: grpc answers UNIMPLEMENTED
        return self._wrap(handler, handler_call_details.method)

    def _wrap(self, handler: Any, method: str) -> Any:
        def call_info(request: Any, context: Any) -> CallInfo:
            return CallInfo(method, context.peer(), request if handler.request_streaming else None)

        if handler.response_streaming:
            behaviour = handler.stream_stream if handler.request_streaming else handler.unary_stream

            async def streaming(request: Any, context: Any):
                call, start, error, admitted = call_info(request, context), self._clock(), None, None
                try:
                    admitted = (await self.before(call, context),)
                    result = behaviour(request, context)
                    if hasattr(result, "__aiter__"):
                        async for reply in result:
                            yield reply
                    else:  # a coroutine handler that writes with context.write
                        await result
                except BaseException as caught:
                    error = caught
                    raise
                finally:
                    self._finish(call, context, start, error, admitted)

            wrapped = streaming
        else:
            behaviour = handler.stream_unary if handler.request_streaming else handler.unary_unary

            async def unary(request: Any, context: Any):
                call, start, error, admitted = call_info(request, context), self._clock(), None, None
                try:
                    admitted = (await self.before(call, context),)
                    return await behaviour(request, context)
                except BaseException as caught:
                    error = caught
                    raise
                finally:
                    self._finish(call, context, start, error, admitted)

            wrapped = unary
        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        deserialize, serialize = self.codecs(method, handler.request_deserializer, handler.response_serializer)
        return factory(wrapped, request_deserializer=deserialize, response_serializer=serialize)

    def _finish(self, call: CallInfo, context: Any, start: float, error: BaseException | None,
                admitted: tuple[Any] | None) -> None:
        """`admitted`: a 1-tuple of what `before` returned, None when `before` refused the call."""
        code, details = _outcome(context, error)
        record = CallRecord(call.method, call.peer, code, details, self._clock() - start)
        if admitted is not None:
            self._guarded(self.release, call, admitted[0], record)
        self._guarded(self.after, record)

    def _guarded(self, hook: Callable[..., None], *args: Any) -> None:
        try:
            hook(*args)
        except Exception:  # a hook's bug must not turn a served call into a failed one
            logging.getLogger(__name__).exception("interceptor %s failed in %s()", type(self).__name__,
                                                  hook.__name__)


class LoggingInterceptor(CallHook):
    """One line per call: method, peer, status, duration. OK and CANCELLED at DEBUG (per microbatch), else WARNING."""

    def __init__(self, logger: logging.Logger | None = None, *, clock: Clock = time.monotonic,
                 ok_level: int = logging.DEBUG, error_level: int = logging.WARNING):
        super().__init__(clock=clock)
        self._logger = logger or logging.getLogger("agora.node.rpc")
        self._ok_level = ok_level
        self._error_level = error_level

    def after(self, record: CallRecord) -> None:
        ok = record.code is grpc.StatusCode.OK
        # A caller hanging up (or a Watch ended by shutdown) is routine, not a fault to surface.
        quiet = ok or record.code is grpc.StatusCode.CANCELLED
        self._logger.log(
            self._ok_level if quiet else self._error_level,
            "rpc %s from %s: %s in %.1f ms%s", record.method, record.peer, record.code.name,
            record.duration_s * 1e3, "" if ok else f" ({record.details})",
        )


def interceptor_chain(*extra: grpc.aio.ServerInterceptor, outer: Sequence[grpc.aio.ServerInterceptor] = (),
                      logger: logging.Logger | None = None,
                      clock: Clock = time.monotonic) -> list[grpc.aio.ServerInterceptor]:
    """Logging outermost (so it sees refusals by later hooks), then `outer` (hooks that must see every
    call's outcome too, such as metrics), then `extra` in order (the credential check, ...)."""
    chain: list[grpc.aio.ServerInterceptor] = [LoggingInterceptor(logger, clock=clock)]
    chain.extend(outer)
    chain.extend(extra)
    return chain
