"""Traces of microbatches over real gRPC: tiny in three stages, one StageWorker each and a SwarmTrainer
in this process (no DHT), spans kept by the SDK's InMemorySpanExporter.

Sampled at 1.0, each microbatch is one trace: its root span, a client span per call to a worker
(each stage's Forward, then the body's and head's Backward) and under each the worker's server span,
joined through the `traceparent` the call carried. Per hop the worker's queue and compute times and
the trainer's wire time add up to the client span's own duration (the SDK's clock, not the
trainer's). A refused call is an error on both its spans. With the trainer's share at 0 nothing is
exported and no tracer is asked for a span. And through the real exporter: the spans reach an OTLP/gRPC
collector on loopback (bench/tracing_cost.py's TraceService, standing for Jaeger or Tempo).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import replace

import grpc
import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from agora.bench.tracing_cost import TraceCollector
from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.stage_client import RequestRefused, StageClient
from agora.node.trainer.trainer import SwarmTrainer
from agora.node.trainer.traces import MicrobatchTraces
from agora.node.tracing_export import Tracing, start_tracing, traced_calls
from agora.node.tracing_options import TracingOptions
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data
from agora.pipeline.fingerprint import run_fingerprint
from counting_tracer import CountingTracer

pytestmark = pytest.mark.timeout(180)

STEPS = 2
# Tracing on; the endpoint is never dialled, since the spans go to the test's exporter.
TRACED = TracingOptions(otlp_endpoint="127.0.0.1:4317", trace_sample=1.0)


def _config():
    config = PRESETS["tiny"].with_stages(3)
    return replace(config, train=replace(config.train, batch_size=4, microbatches=2, seq_len=32,
                                         eval_every=0, eval_batches=2))


async def _train(config, worker_tracing: Tracing | None, traces: MicrobatchTraces | None) -> None:
    data = build_data(config)
    workers = [StageWorker(config, stage, run_id="test", options=WorkerOptions(),
                           interceptors=traced_calls(worker_tracing))
               for stage in range(len(config.layer_split))]
    try:
        for worker in workers:
            await worker.start()
        views = [WorkerView(f"s{w.stage_index}", w.address, w.stage_index) for w in workers]
        options = TrainerOptions(run_id="test", max_in_flight=1, gradient_check_share=0.0)
        async with SwarmTrainer(config, data, StaticDiscovery(views), options, traces=traces) as trainer:
            await trainer.run(STEPS)
    finally:
        await asyncio.gather(*(w.stop(0) for w in workers))


def _by_trace(spans) -> dict[int, list]:
    traces = defaultdict(list)
    for span in spans:
        traces[span.context.trace_id].append(span)
    return traces


def _seconds(span) -> float:
    return (span.end_time - span.start_time) / 1e9


def test_each_sampled_microbatch_is_one_trace_through_every_stage_forward_and_backward():
    config = _config()
    exporter = InMemorySpanExporter()
    trainer_tracing = start_tracing(TRACED, "trainer", exporter=exporter)
    worker_tracing = start_tracing(TRACED, "worker", exporter=exporter)
    traces = MicrobatchTraces(trainer_tracing.tracer, trainer_tracing.share)
    asyncio.run(_train(config, worker_tracing, traces))
    trainer_tracing.close()
    worker_tracing.close()

    spans = exporter.get_finished_spans()
    roots = [span for span in spans if span.name == "microbatch"]
    assert len(roots) == STEPS * config.train.microbatches
    assert len({root.context.trace_id for root in roots}) == len(roots)  # one trace per microbatch
    by_trace = _by_trace(spans)
    assert set(by_trace) == {root.context.trace_id for root in roots}  # nothing outside a microbatch's trace
    for root in roots:
        assert root.parent is None and root.attributes["agora.loss"] > 0
        members = by_trace[root.context.trace_id]
        clients = [s for s in members if s.kind is SpanKind.CLIENT]
        assert sorted(s.name for s in clients) == sorted(
            ["Forward stage 0", "Forward stage 1", "Forward stage 2", "Backward stage 1", "Backward stage 0"])
        for client in clients:
            assert client.parent.span_id == root.context.span_id
            servers = [s for s in members if s.kind is SpanKind.SERVER and s.parent.span_id == client.context.span_id]
            assert len(servers) == 1, client.name
            server = servers[0]
            assert server.name == client.name.split()[0]
            assert server.attributes["rpc.grpc.status_code"] == 0
            # The worker's own account, as the reply carried it to the trainer.
            assert server.attributes["agora.queue_s"] == client.attributes["agora.queue_s"]
            assert server.attributes["agora.compute_s"] == client.attributes["agora.compute_s"]
            worker_s = server.attributes["agora.queue_s"] + server.attributes["agora.compute_s"]
            hop = worker_s + client.attributes["agora.wire_s"]
            assert hop == pytest.approx(_seconds(client), rel=0.10)
            assert server.start_time >= client.start_time and server.end_time <= client.end_time


def test_with_a_share_of_zero_nothing_is_exported_and_no_span_is_made():
    config = _config()
    exporter = InMemorySpanExporter()
    # The trainer samples nothing; the workers trace what their callers sample, and start no trace of their own.
    worker_tracing = start_tracing(TracingOptions(otlp_endpoint="127.0.0.1:4317"), "worker", exporter=exporter)
    trainer_tracing = start_tracing(replace(TRACED, trace_sample=0.0), "trainer", exporter=exporter)
    counting = CountingTracer(trainer_tracing.tracer), CountingTracer(worker_tracing.tracer)
    asyncio.run(_train(config, replace(worker_tracing, tracer=counting[1]),
                       MicrobatchTraces(counting[0], trainer_tracing.share)))
    worker_tracing.close()
    trainer_tracing.close()
    assert worker_tracing.share == 0.0
    assert exporter.get_finished_spans() == ()
    assert [tracer.asked for tracer in counting] == [0, 0]



def test_the_spans_reach_an_otlp_collector():
    with TraceCollector() as collector:
        options = TracingOptions(otlp_endpoint=collector.endpoint, trace_sample=1.0)
        trainer_tracing, worker_tracing = start_tracing(options, "trainer"), start_tracing(options, "worker")
        asyncio.run(_train(_config(), worker_tracing, MicrobatchTraces(trainer_tracing.tracer, 1.0)))
        trainer_tracing.close()  # flushes the batch
        worker_tracing.close()
    microbatches = STEPS * _config().train.microbatches
    assert collector.spans["agora-trainer"]["microbatch"] == microbatches
    assert collector.spans["agora-trainer"]["Backward stage 0"] == microbatches
    assert collector.spans["agora-worker"]["Forward"] == 3 * microbatches


def test_a_refused_call_is_an_error_on_both_sides_of_its_trace():
    """A Backward of a microbatch the worker never saw: FAILED_PRECONDITION, marked on the client's span
    and on the worker's, which still hangs under it."""
    config = _config()
    exporter = InMemorySpanExporter()
    trainer_tracing = start_tracing(TRACED, "trainer", exporter=exporter)
    worker_tracing = start_tracing(TRACED, "worker", exporter=exporter)
    traces = MicrobatchTraces(trainer_tracing.tracer, 1.0)

    async def main():
        worker = StageWorker(config, 1, run_id="test", options=WorkerOptions(),
                             interceptors=traced_calls(worker_tracing))
        await worker.start()
        client = StageClient(worker.address, run_id="test", stage=1, model=config.model,
                             fingerprint=run_fingerprint(config))
        try:
            with traces.microbatch("u0m0", evaluate=False):
                hop = traces.hop(1, "s1")
                grad = torch.zeros(config.train.microbatch_size, config.train.seq_len, config.model.wire_dim)
                with pytest.raises(RequestRefused):
                    await hop.around(client.backward("never-forwarded", grad))
        finally:
            await client.close()
            await worker.stop(0)

    asyncio.run(main())
    spans = {span.kind: span for span in exporter.get_finished_spans() if span.kind is not SpanKind.INTERNAL}
    client, server = spans[SpanKind.CLIENT], spans[SpanKind.SERVER]
    assert client.name == "Backward stage 1" and not client.status.is_ok
    assert server.parent.span_id == client.context.span_id and not server.status.is_ok
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.FAILED_PRECONDITION.value[0]
