"""`MicrobatchTraces`: a trainer's spans, one trace per sampled microbatch (node/rpc/tracing.py).

A sampled microbatch gets a root span (`microbatch`, current while it runs, every attempt under
it); each call it makes to a worker gets a client span under that (`hop`), current while the call
is in flight, so the stage client writes its context into the call's metadata and the worker's
server span becomes its child. The call's span ends with the trainer's own round trip and the
reply's queue and compute times as attributes (`Hop.answered`), or with the error that ended it
(`Hop.around`). Calls made outside a sampled microbatch get no span: `hop` returns None, having
made nothing. The spot and self checks a microbatch starts are its calls too (their spans say
`agora.training` false); they may end after their microbatch's span.
"""

from __future__ import annotations

import contextlib
from typing import Any, Awaitable, Iterator, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from agora.node.rpc.tracing import hop_attributes, sampled

__all__ = ["MicrobatchTraces", "Hop"]

T = TypeVar("T")


class Hop:
    """One call's client span, started (not yet current): `around` runs the call under it."""

    def __init__(self, span: Span, stage: int):
        self.span = span
        self.stage = stage

    async def around(self, call: Awaitable[T]) -> T:
        """Await `call` with this span current; an error ends the span, marked with it."""
        token = otel_context.attach(trace.set_span_in_context(self.span))
        try:
            return await call
        except BaseException as error:
            method = getattr(error, "method", "call")
            self.span.update_name(f"{method} stage {self.stage}")
            self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            self.span.end()
            raise
        finally:
            otel_context.detach(token)

    def answered(self, round_trip_s: float, result: Any, *, training: bool) -> None:
        """End the span with the trainer's round trip and the reply's own account of the time."""
        method = type(result).__name__.removesuffix("Result")
        self.span.update_name(f"{method} stage {self.stage}")
        self.span.set_attributes({**hop_attributes(round_trip_s, result.queued_s, result.compute_s),
                                  "agora.training": training})
        self.span.end()


class MicrobatchTraces:
    """Spans of a `share` of a trainer's microbatches, made with `tracer`."""

    def __init__(self, tracer: Tracer, share: float):
        self._tracer = tracer
        self.share = share

    @contextlib.contextmanager
    def microbatch(self, key: str, *, evaluate: bool) -> Iterator[Span | None]:
        """The root span of microbatch `key`, current inside, when it is sampled; else None, and nothing made."""
        if not sampled(key, self.share):
            yield None
            return
        attributes = {"agora.microbatch": key, "agora.evaluate": evaluate}
        with self._tracer.start_as_current_span("microbatch", kind=SpanKind.INTERNAL, attributes=attributes) as span:
            yield span

    def hop(self, stage: int, peer: str) -> Hop | None:
        """A client span for a call to `peer` on `stage`, under the current microbatch's; None outside one."""
        if not trace.get_current_span().is_recording():
            return None
        span = self._tracer.start_span(f"stage {stage}", kind=SpanKind.CLIENT,
                                       attributes={"agora.stage": stage, "agora.peer": peer})
        return Hop(span, stage)
