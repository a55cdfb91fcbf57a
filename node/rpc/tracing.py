"""OpenTelemetry traces across the pipeline: the sampling decision, span attributes, and the trace
context in gRPC call metadata.

Design choices:

- One trace per sampled microbatch. The trainer decides (`sampled`: a hash of the microbatch's work
  key against the share) before any span exists, so an unsampled microbatch creates no span object,
  and every attempt of one microbatch (and every trainer that runs it) decides alike.
- The context travels in each call's metadata as W3C `traceparent`/`tracestate`, written and read
  by opentelemetry's own TraceContext propagator, so any OTLP backend joins a trainer's spans with
  its workers'. A client adds it only when a sampled span is current (`with_trace_context`); with
  tracing off that check is one context-variable read, no object made.
- A worker's side is `TracingHook`, a `CallHook` (node/rpc/interceptors.py) behind the credential
  check: a server span for each admitted call its caller traced, a child of the caller's span,
  current while the handler runs, ended with the call's status; any other call makes no span. The
  worker adds the queue and compute times it measured for its reply (`annotate_job`): the numbers
  the reply carries, not a second measurement. A refused call has no server span; the caller's
  span shows the refusal.
- The trainer's span of a call (node/trainer/traces.py) carries its measured round trip and the
  reply's queue and compute times; the rest of the round trip is `wire` (`hop_attributes`): the
  network, (de)serialization, and the worker's admission.
- No process-wide state: each process builds its own tracer provider (node/tracing_export.py) and
  hands its tracer to what makes spans; opentelemetry's global provider and propagator are left alone.
  This module needs opentelemetry's API only (every worker and trainer imports it); the SDK and the
  exporter are node/tracing_export.py's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from agora.node.rpc.interceptors import CallHook, CallInfo, CallRecord

__all__ = ["sampled", "job_attributes", "hop_attributes", "with_trace_context", "annotate_job", "TracingHook"]

# Stateless: it only reads and writes the carrier it is given.
_PROPAGATOR = TraceContextTextMapPropagator()
_HASH_SPAN = 2.0 ** 64


def sampled(key: str, share: float) -> bool:
    """Whether the microbatch named `key` is traced at `share` (0: never, 1: always): the first 8
    bytes of its BLAKE2b digest, as a fraction of 2^64, below the share."""
    if share <= 0.0:
        return False
    if share >= 1.0:
        return True
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _HASH_SPAN < share


def job_attributes(queued_s: float, compute_s: float) -> dict[str, float]:
    """A worker's account of one job, as its server span carries it."""
    return {"agora.queue_s": float(queued_s), "agora.compute_s": float(compute_s)}


def hop_attributes(round_trip_s: float, queued_s: float, compute_s: float) -> dict[str, float]:
    """The trainer's span of one call: its measured round trip split into the worker's queue and
    compute and the rest (`wire`, never below 0: the two clocks are read on different machines)."""
    return {"agora.round_trip_s": float(round_trip_s), **job_attributes(queued_s, compute_s),
            "agora.wire_s": max(0.0, float(round_trip_s) - float(queued_s) - float(compute_s))}


def with_trace_context(metadata: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """`metadata` plus the current span's `traceparent` (and `tracestate`) when that span is sampled."""
    if not trace.get_current_span().get_span_context().trace_flags.sampled:
        return metadata
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return (*metadata, *carrier.items())


def annotate_job(queued_s: float, compute_s: float) -> None:
    """Put a job's queue and compute times on the current server span (nothing when none records)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(job_attributes(queued_s, compute_s))


def _incoming_context(context: Any) -> otel_context.Context:
    metadata = context.invocation_metadata() or ()
    carrier = {key: value for key, value in metadata if isinstance(value, str)}
    return _PROPAGATOR.extract(carrier)


@dataclass
class _ServerSpan:
    span: Span
    token: object  # the context attached for the handler, detached when the call ends


class TracingHook(CallHook):
    """A server span per admitted call, under the caller's trace context (module docstring): for each
    call its caller sampled, and with `root_share` above 0 for the calls that carry no trace, where
    the tracer's sampler takes that share (node/tracing_export.py). Other calls make no span."""

    def __init__(self, tracer: Tracer, root_share: float = 0.0):
        super().__init__()
        self._tracer = tracer
        self._root_share = root_share

    async def before(self, call: CallInfo, context: Any) -> _ServerSpan | None:
        parent = _incoming_context(context)
        caller = trace.get_current_span(parent).get_span_context()
        if not (caller.trace_flags.sampled if caller.is_valid else self._root_share > 0.0):
            return None
        service, _, method = call.method.lstrip("/").rpartition("/")
        span = self._tracer.start_span(method, context=parent, kind=SpanKind.SERVER, attributes={
            "rpc.system": "grpc", "rpc.service": service, "rpc.method": method, "agora.peer": call.peer})
        if not span.is_recording():
            return None
        return _ServerSpan(span, otel_context.attach(trace.set_span_in_context(span, parent)))

    def release(self, call: CallInfo, held: _ServerSpan | None, record: CallRecord) -> None:
        if held is None:
            return
        held.span.set_attribute("rpc.grpc.status_code", record.code.value[0])
        if record.code is not grpc.StatusCode.OK:
            held.span.set_status(Status(StatusCode.ERROR, f"{record.code.name}: {record.details}"))
        held.span.end()
        otel_context.detach(held.token)
