"""A node's OpenTelemetry tracer: its provider, sampler and exporter, built from `TracingOptions`.

Design choices:

- One provider per process, made by the role's command and closed with it (its last spans are
  flushed then); nothing sets opentelemetry's global provider, so tests run several in one process.
- The sampler follows the role. A trainer decides per microbatch itself, before any span exists
  (node/rpc/tracing.py `sampled`), so its provider records every span it is asked for; its share is
  `--trace-sample`, 0.01 by default. A worker follows the caller's decision carried in the call's
  `traceparent` (ParentBased), and starts traces of its own only when given `--trace-sample`: for
  that share of the calls that carry none (TraceIdRatioBased), a trainer's unsampled microbatches
  among them. By default it records just what its callers trace, so a trace is a whole microbatch.
- Spans go to the OTLP/gRPC endpoint in batches, from a thread of the SDK's (BatchSpanProcessor): a
  call never waits for the collector, and a collector that is down costs dropped spans, not
  training. A test hands its own `exporter` (the SDK's InMemorySpanExporter), exported as each span
  ends so that it reads them at once.
- The provider is built after the role's forks (hivemind's processes): its export thread must not
  be running when a process forks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import Tracer

from agora.node.rpc.tracing import TracingHook
from agora.node.tracing_options import TracingOptions

__all__ = ["Tracing", "start_tracing", "traced_calls"]

# A collector that does not answer holds a batch this long before it is dropped.
_EXPORT_TIMEOUT_S = 5.0

Role = Literal["trainer", "worker"]


@dataclass(frozen=True)
class Tracing:
    """A process's tracer and the share of traces it starts; `close` flushes and stops the export."""

    tracer: Tracer
    share: float
    provider: TracerProvider

    def close(self) -> None:
        self.provider.shutdown()


def _started_share(options: TracingOptions, role: Role) -> float:
    """The share of traces a process starts (module docstring)."""
    return options.share if role == "trainer" else options.trace_sample or 0.0


def _sampler(role: Role, share: float) -> Sampler:
    return ALWAYS_ON if role == "trainer" else ParentBased(TraceIdRatioBased(share))


def start_tracing(options: TracingOptions, role: Role, *, run_id: str = "",
                  exporter: SpanExporter | None = None) -> Tracing | None:
    """The tracer of a `role` process, or None when `options` leave tracing off. `exporter`: where
    spans go instead of the endpoint (tests)."""
    if not options.enabled:
        return None
    resource = Resource.create({"service.name": f"agora-{role}", "agora.run": run_id})
    share = _started_share(options, role)
    provider = TracerProvider(resource=resource, sampler=_sampler(role, share))
    if exporter is None:
        exporter = OTLPSpanExporter(endpoint=options.otlp_endpoint, insecure=True, timeout=_EXPORT_TIMEOUT_S)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider.get_tracer("agora.node"), share, provider)


def traced_calls(tracing: Tracing | None) -> list[TracingHook]:
    """The server hooks a node adds to its chain for `tracing` (its share: of the calls that carry no
    trace): none when it does not trace."""
    return [] if tracing is None else [TracingHook(tracing.tracer, tracing.share)]
