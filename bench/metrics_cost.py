"""What metrics cost a worker: Forward calls per second with and without them, side by side.

    python bench/metrics_cost.py [--calls 300] [--rounds 5] [--out bench/results/metrics_cost_tiny.md]

One process, one event loop, real grpc.aio on 127.0.0.1:0: two `tiny` body-stage workers, one
served plain (no registry, no hook) and one served as `join` serves it (WorkerMetrics, the gRPC
MetricsHook counting calls, codes and message bytes, a trainer-side StageClient counting
payload bytes). Held-out Forward calls of one microbatch go to the two in turn (the order
swapped every call), so the drift of a shared, busy machine falls on both alike; each round
reports the median per-call time of each, and the ratio is of the medians over rounds. A `/metrics` scrape costs the scraper's interval, not the data path,
and is not part of this.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from agora.monitor.metrics import new_registry
from agora.monitor.trainer_metrics import RpcClientMetrics
from agora.monitor.worker_metrics import RpcServerMetrics, WorkerMetrics
from agora.node.rpc.metrics_hook import MetricsHook
from agora.node.rpc.server import run
from agora.node.trainer.stage_client import StageClient
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.fingerprint import run_fingerprint

CONFIG = PRESETS["tiny"].with_stages(3)
RUN = "bench"


async def serve(with_metrics: bool):
    registry = new_registry() if with_metrics else None
    worker = StageWorker(CONFIG, 1, run_id=RUN, options=WorkerOptions(synchronous=True),
                         outer_interceptors=[MetricsHook(RpcServerMetrics(registry))] if with_metrics else (),
                         metrics=WorkerMetrics(registry) if with_metrics else None)
    await worker.start()
    client = StageClient(worker.address, run_id=RUN, stage=1, model=CONFIG.model, fingerprint=run_fingerprint(CONFIG),
                         metrics=RpcClientMetrics(registry) if with_metrics else None)
    return worker, client


async def call_seconds(calls: int) -> dict[bool, list[float]]:
    """Per-call seconds of each variant, the two called in turn (plain, metrics, plain, ...)."""
    served = {variant: await serve(variant) for variant in (False, True)}
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIG.model.vocab_size, (CONFIG.train.microbatch_size, CONFIG.train.seq_len),
                           generator=generator)
    wire = torch.randn(*tokens.shape, CONFIG.model.wire_dim, generator=generator)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    try:
        for index in range(-5, calls):  # five warm-up calls each, not counted
            for variant in ((False, True) if index % 2 == 0 else (True, False)):
                started = time.perf_counter()
                await served[variant][1].forward(f"m{index}", tokens, wire, evaluate=True)
                if index >= 0:
                    seconds[variant].append(time.perf_counter() - started)
    finally:
        for worker, client in served.values():
            await client.close()
            await worker.stop()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "metrics_cost_tiny.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    medians: dict[bool, list[float]] = {False: [], True: []}
    for round_index in range(args.rounds):
        seconds = run(call_seconds(args.calls))
        for variant in (False, True):
            medians[variant].append(statistics.median(seconds[variant]) * 1e3)
        print(f"round {round_index}: {medians[False][-1]:.3f} ms plain, {medians[True][-1]:.3f} ms with metrics",
              flush=True)
    plain, measured = statistics.median(medians[False]), statistics.median(medians[True])
    ratio = measured / plain
    print(f"per-call time with metrics / without: {ratio:.3f} ({measured:.3f} vs {plain:.3f} ms, medians)")
    lines = ["# Metrics cost on a worker (tiny, body stage, one microbatch per Forward, in-process gRPC)", "",
             f"`python bench/metrics_cost.py --calls {args.calls} --rounds {args.rounds}`: two workers of the same "
             "stage in one process, one plain and one served as `join` serves it (worker metrics, the gRPC metrics "
             "hook, a client counting payload bytes), called in turn; median milliseconds per Forward call.", "",
             "| variant | ms per call (median of rounds) | each round's median |", "|---|---:|---|",
             f"| without metrics | {plain:.3f} | {', '.join(f'{r:.3f}' for r in medians[False])} |",
             f"| with metrics | {measured:.3f} | {', '.join(f'{r:.3f}' for r in medians[True])} |",
             "", f"Time per call with / without: **{ratio:.3f}**.", ""]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
