"""What tracing costs a swarm: tokens/s with tracing off, and with a share of 0.01 and 1.0 of the
microbatches traced, side by side in one run.

    python bench/tracing_cost.py [--steps 12] [--rounds 3] [--out bench/results/tracing_cost_tiny.md]

One process, one event loop, real grpc.aio on 127.0.0.1:0: `tiny` in three stages, one StageWorker
each, and a SwarmTrainer, as `join` and `trainer` run them (node/rpc/tracing.py). Traced variants
export for real: OTLP/gRPC, in batches from the SDK's thread, to a collector on loopback in this
process (`TraceCollector`, opentelemetry-proto's TraceService, counting what it receives), so
encoding and sending the spans is paid too. Each variant trains `--steps` global batches on fresh
workers (a run on workers that applied those batches already would skip their accumulation); the
variants take turns within a round, the order rotated every round, so the drift of a shared, busy
machine falls on all alike. The table gives each variant's median tokens/s over rounds and its
ratio to tracing off.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import torch
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from agora.node.rpc.server import run
from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.trainer import SwarmTrainer
from agora.node.trainer.traces import MicrobatchTraces
from agora.node.tracing_export import start_tracing, traced_calls
from agora.node.tracing_options import TracingOptions
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data

__all__ = ["TraceCollector", "main"]

BASE = PRESETS["tiny"].with_stages(3)
CONFIG = replace(BASE, train=replace(BASE.train, eval_every=0))
RUN = "bench"
SHARES = (None, 0.01, 1.0)  # None: tracing off


class TraceCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on loopback: the span names it was sent, per service name."""

    def __init__(self):
        self.spans: dict[str, Counter] = {}
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self.endpoint = ""

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next((a.value.string_value for a in resource_spans.resource.attributes
                                if a.key == "service.name"), "")
                names = self.spans.setdefault(service, Counter())
                for scope in resource_spans.scope_spans:
                    names.update(span.name for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def __enter__(self) -> "TraceCollector":
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.endpoint = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(0)


async def tokens_per_second(steps: int, share: float | None, endpoint: str) -> float:
    """Train `steps` global batches on fresh workers, traced at `share` (None: off); tokens/s."""
    options = TracingOptions() if share is None else TracingOptions(otlp_endpoint=endpoint, trace_sample=share)
    trainer_tracing, worker_tracing = start_tracing(options, "trainer"), start_tracing(
        TracingOptions(otlp_endpoint=options.otlp_endpoint), "worker")
    workers = [StageWorker(CONFIG, stage, run_id=RUN, options=WorkerOptions(),
                           interceptors=traced_calls(worker_tracing)) for stage in range(3)]
    traces = None if trainer_tracing is None else MicrobatchTraces(trainer_tracing.tracer, trainer_tracing.share)
    try:
        for worker in workers:
            await worker.start()
        views = [WorkerView(f"s{w.stage_index}", w.address, w.stage_index) for w in workers]
        trainer_options = TrainerOptions(run_id=RUN, gradient_check_share=0.0)
        async with SwarmTrainer(CONFIG, build_data(CONFIG), StaticDiscovery(views), trainer_options,
                                traces=traces) as trainer:
            started = time.perf_counter()
            await trainer.run(steps)
            seconds = time.perf_counter() - started
    finally:
        await asyncio.gather(*(w.stop(0) for w in workers))
        for tracing in (trainer_tracing, worker_tracing):
            if tracing is not None:
                tracing.close()
    return steps * CONFIG.train.batch_size * CONFIG.train.seq_len / seconds


def _label(share: float | None) -> str:
    return "off" if share is None else f"sampled {share:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "tracing_cost_tiny.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    figures: dict[float | None, list[float]] = {share: [] for share in SHARES}
    with TraceCollector() as collector:
        for round_index in range(args.rounds):
            order = SHARES[round_index % 3:] + SHARES[:round_index % 3]
            for share in order:
                figures[share].append(run(tokens_per_second(args.steps, share, collector.endpoint)))
            measured = ", ".join(f"{_label(share)} {figures[share][-1]:.0f}" for share in SHARES)
            print(f"round {round_index}: {measured} tokens/s", flush=True)
    off = statistics.median(figures[None])
    received = {service: sum(names.values()) for service, names in sorted(collector.spans.items())}
    lines = ["# Tracing cost (tiny, three stages in one process, in-process gRPC, OTLP to a loopback collector)", "",
             f"`python bench/tracing_cost.py --steps {args.steps} --rounds {args.rounds}`: one trainer and three "
             "workers per run, fresh each run, the variants in turn (order rotated per round); tokens/s of "
             f"{args.steps} global batches of {CONFIG.train.batch_size}x{CONFIG.train.seq_len} tokens.", "",
             "| tracing | tokens/s (median of rounds) | / off | each round |", "|---|---:|---:|---|"]
    for share in SHARES:
        median = statistics.median(figures[share])
        lines.append(f"| {_label(share)} | {median:.0f} | {median / off:.3f} | "
                     f"{', '.join(f'{value:.0f}' for value in figures[share])} |")
    lines += ["", f"Spans the collector received: {received}.", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
