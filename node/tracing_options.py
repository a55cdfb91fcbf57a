"""`TracingOptions`: whether and where a node sends OpenTelemetry traces.

A section of the settings schema (pipeline/schema.py), nested as `tracing` in `TrainerOptions` and
`WorkerOptions`, so `trainer` and `join` both take `--otlp-endpoint HOST:PORT` and
`--trace-sample FRACTION` (and the demo hands them on). Off unless an endpoint is given: tracing
costs nothing then (node/rpc/tracing.py installs nothing). Both are this machine's choice (where
its spans go, how many), never part of the run's fingerprint.

Light (no opentelemetry import): the CLI builds its parser from it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import StrictFloat, StrictStr, model_validator
from pydantic.dataclasses import dataclass

from agora.pipeline.schema import SECTION, NoneOr, setting

__all__ = ["TracingOptions", "DEFAULT_TRACE_SAMPLE"]

# One microbatch in a hundred: enough to see where a hop's time goes at a few traces a second
# per trainer, without exporting (and storing) a trace per microbatch.
DEFAULT_TRACE_SAMPLE = 0.01


@dataclass(frozen=True, config=SECTION)
class TracingOptions:
    otlp_endpoint: Annotated[StrictStr | None, NoneOr] = setting(
        None, "send OpenTelemetry traces of sampled microbatches to this OTLP/gRPC collector (HOST:PORT: Jaeger, "
        "Tempo, an OpenTelemetry Collector; plaintext); default: no tracing, at no cost",
        flag="--otlp-endpoint", local=True)
    trace_sample: StrictFloat | None = setting(
        None, f"with --otlp-endpoint: the share of microbatches a trainer traces through every stage (default "
        f"{DEFAULT_TRACE_SAMPLE:g}); a worker records the calls its callers trace, and given this, also starts a "
        "trace of its own for this share of the calls that carry none (default 0)", flag="--trace-sample", ge=0,
        le=1, local=True)

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None

    @property
    def share(self) -> float:
        """The share of microbatches a trainer traces; 0 when tracing is off."""
        if not self.enabled:
            return 0.0
        return DEFAULT_TRACE_SAMPLE if self.trace_sample is None else self.trace_sample

    @model_validator(mode="after")
    def _agree(self) -> "TracingOptions":
        if self.trace_sample is not None and self.otlp_endpoint is None:
            raise ValueError("trace_sample: --trace-sample needs --otlp-endpoint (without one nothing is traced)")
        if self.otlp_endpoint is not None:
            host, _, port = self.otlp_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"otlp_endpoint: {self.otlp_endpoint!r} is not HOST:PORT")
        return self
