"""Traces without sockets: the sampling decision, the spans' attributes, the context a call carries,
the settings (node/rpc/tracing.py, node/trainer/traces.py, node/tracing_options.py)."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from agora.node.cli import build_parser
from agora.node.demo.options import DemoOptions
from agora.node.rpc.tracing import hop_attributes, job_attributes, sampled, with_trace_context
from agora.node.tracing_export import start_tracing, traced_calls
from agora.node.tracing_options import DEFAULT_TRACE_SAMPLE, TracingOptions
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.traces import MicrobatchTraces
from agora.node.worker.options import WorkerOptions
from agora.pipeline.option_flags import options_from_args
from agora.pipeline.schema import ConfigError
from counting_tracer import CountingTracer

FINGERPRINT = (("agora-run-fingerprint", "abc"),)


def _tracer():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


# ------------------------------------------------------------------ the sampling decision

def test_a_share_of_zero_samples_nothing_and_one_everything():
    keys = [f"u{unit}m{index}" for unit in range(50) for index in range(8)]
    assert not any(sampled(key, 0.0) for key in keys)
    assert all(sampled(key, 1.0) for key in keys)


def test_the_sampled_share_is_near_the_asked_one_and_each_key_is_decided_alike_every_time():
    keys = [f"u{unit}m{index}" for unit in range(2000) for index in range(5)]
    for share in (0.01, 0.1, 0.5):
        chosen = [key for key in keys if sampled(key, share)]
        assert abs(len(chosen) / len(keys) - share) < 0.2 * share + 0.003, share
        assert chosen == [key for key in keys if sampled(key, share)]
    # A key sampled at a share is sampled at every larger one: raising the share only adds traces.
    assert {k for k in keys if sampled(k, 0.1)} <= {k for k in keys if sampled(k, 0.5)}


# ------------------------------------------------------------------ attributes

def test_a_hop_is_its_round_trip_split_into_queue_compute_and_wire():
    attributes = hop_attributes(0.010, 0.002, 0.005)
    assert attributes == pytest.approx({"agora.round_trip_s": 0.010, "agora.queue_s": 0.002,
                                        "agora.compute_s": 0.005, "agora.wire_s": 0.003})
    parts = attributes["agora.queue_s"] + attributes["agora.compute_s"] + attributes["agora.wire_s"]
    assert parts == pytest.approx(attributes["agora.round_trip_s"])


def test_wire_time_is_never_negative_when_the_worker_reports_more_than_the_round_trip():
    assert hop_attributes(0.004, 0.001, 0.005)["agora.wire_s"] == 0.0


def test_a_job_is_its_queue_and_compute():
    assert job_attributes(1, 2.5) == {"agora.queue_s": 1.0, "agora.compute_s": 2.5}


# ------------------------------------------------------------------ the context in metadata

def test_a_call_outside_a_span_carries_its_metadata_unchanged():
    assert with_trace_context(FINGERPRINT) is FINGERPRINT


def test_a_call_under_an_unsampled_span_carries_no_trace_context():
    unsampled = NonRecordingSpan(SpanContext(trace_id=7, span_id=9, is_remote=False, trace_flags=TraceFlags(0)))
    with trace.use_span(unsampled):
        assert with_trace_context(FINGERPRINT) == FINGERPRINT


def test_a_call_under_a_sampled_span_carries_its_traceparent():
    tracer, _ = _tracer()
    with tracer.start_as_current_span("hop") as span:
        metadata = dict(with_trace_context(FINGERPRINT))
    context = span.get_span_context()
    assert metadata["agora-run-fingerprint"] == "abc"
    version, trace_id, span_id, flags = metadata["traceparent"].split("-")
    assert (version, trace_id, span_id) == ("00", f"{context.trace_id:032x}", f"{context.span_id:016x}")
    assert int(flags, 16) & 1  # sampled


# ------------------------------------------------------------------ the trainer's spans

def test_an_unsampled_microbatch_and_its_calls_make_no_span():
    tracer, exporter = _tracer()
    counting = CountingTracer(tracer)
    traces = MicrobatchTraces(counting, 0.0)
    with traces.microbatch("u1m0", evaluate=False) as root:
        assert root is None
        assert traces.hop(0, "peer") is None
    assert counting.asked == 0 and exporter.get_finished_spans() == ()


def test_a_sampled_microbatch_is_the_parent_of_its_calls():
    tracer, exporter = _tracer()
    traces = MicrobatchTraces(tracer, 1.0)
    assert traces.hop(0, "peer") is None  # outside a microbatch
    with traces.microbatch("u1m0", evaluate=False) as root:
        hop = traces.hop(2, "peer")

    class Reply:  # a ForwardResult's account of the time
        queued_s, compute_s = 0.001, 0.002

    Reply.__name__ = "ForwardResult"
    hop.answered(0.004, Reply(), training=True)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"microbatch", "Forward stage 2"}
    assert spans["Forward stage 2"].parent.span_id == root.get_span_context().span_id
    assert spans["Forward stage 2"].attributes["agora.wire_s"] == pytest.approx(0.001)
    assert spans["microbatch"].attributes["agora.microbatch"] == "u1m0"


# ------------------------------------------------------------------ settings

def test_tracing_is_off_unless_an_endpoint_is_given_and_then_samples_the_default_share():
    assert TracingOptions().share == 0.0 and not TracingOptions().enabled
    assert TracingOptions(otlp_endpoint="collector:4317").share == DEFAULT_TRACE_SAMPLE
    assert TracingOptions(otlp_endpoint="collector:4317", trace_sample=0.25).share == 0.25
    assert TrainerOptions(run_id="r").tracing == TracingOptions() and WorkerOptions().tracing == TracingOptions()


@pytest.mark.parametrize("argv, message", [
    (["--trace-sample", "0.5"], "trainer.tracing.trace_sample: --trace-sample needs --otlp-endpoint"),
    (["--otlp-endpoint", "collector:4317", "--trace-sample", "1.5"], "trainer.tracing.trace_sample: must be <= 1"),
    (["--otlp-endpoint", "collector"], "trainer.tracing.otlp_endpoint: 'collector' is not HOST:PORT"),
    (["--otlp-endpoint", "collector:99999"], "trainer.tracing.otlp_endpoint: 'collector:99999' is not HOST:PORT"),
])
def test_a_bad_tracing_flag_is_one_line_naming_the_field(argv, message):
    args = build_parser().parse_args(["trainer", "--run-id", "r", *argv])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        options_from_args(TrainerOptions, args, "trainer", run_id="r")


def test_join_and_the_demo_take_the_tracing_flags_and_the_demo_hands_on_those_given():
    args = build_parser().parse_args(["join", "--otlp-endpoint", "collector:4317", "--trace-sample", "0.5"])
    assert options_from_args(WorkerOptions, args, "worker").tracing.share == 0.5
    given = build_parser().parse_args(["demo", "--otlp-endpoint", "collector:4317", "--trace-sample", "0.5"])
    handed_on = ["--otlp-endpoint", "collector:4317", "--trace-sample", "0.5"]
    assert DemoOptions.from_args(given).tracing_flags() == handed_on
    assert DemoOptions.from_args(build_parser().parse_args(["demo"])).tracing_flags() == []


def test_a_trainer_starts_its_share_of_traces_and_a_worker_none_unless_given_one():
    endpoint = TracingOptions(otlp_endpoint="collector:4317")
    started = {role: start_tracing(options, role, exporter=InMemorySpanExporter()).share
               for role, options in (("trainer", endpoint), ("worker", endpoint))}
    assert started == {"trainer": DEFAULT_TRACE_SAMPLE, "worker": 0.0}
    given = TracingOptions(otlp_endpoint="collector:4317", trace_sample=0.5)
    assert start_tracing(given, "worker", exporter=InMemorySpanExporter()).share == 0.5
    assert start_tracing(TracingOptions(), "trainer") is None and start_tracing(TracingOptions(), "worker") is None
    assert traced_calls(None) == []  # nothing in a worker's chain
