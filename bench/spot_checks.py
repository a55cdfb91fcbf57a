"""What the trainer's checks cost: tokens/s with and without them, side by side, over real gRPC.

tiny, two stages: two head replicas and one tail, StageWorkers on loopback and one SwarmTrainer
(the harness of tests/integration/test_spot_checks_grpc.py), all honest. The same run (same seed,
same data) once per `--shares` value, in turn, `--repeats` times (A B C A B C: a slow stretch of
the machine falls on every share): tokens/s (median) and its ratio to the run without checks, the
checks sent, skipped (no credit free), failed, the checks' own compute, and the held-out loss.

- `--check spot` (node/trainer/spot_checks.py): `spot_check_share` varies, self checks off; a
  check is one extra held-out Forward on the other head; "failed" counts disagreements.
- `--check self` (node/trainer/gradient_checks.py): `gradient_check_share` varies, spot checks off;
  a check is one held-out replay at a head, two finite-difference probes at the tail; "failed"
  counts checks out of band (none expected: every worker is honest).

On one machine every process shares the CPUs, so a check's forward competes with the pipeline's
own work: the ratio is an upper bound on what checks cost where each worker has its own device.

Writes bench/results/spot_checks_tiny.md (or self_checks_tiny.md).

    python bench/spot_checks.py --steps 60 --shares 0 0.02 0.1 1
    python bench/spot_checks.py --check self --steps 60 --shares 0 0.05 0.2 --repeats 2
    python bench/spot_checks.py --quick      # 4 steps, shares 0 and 1: shows it works
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
from dataclasses import replace
from pathlib import Path

import torch

from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.trainer import SwarmTrainer
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"s0r0": 0, "s0r1": 0, "s1r0": 1}


def _config(seed: int):
    config = PRESETS["tiny"].with_stages(2)
    return replace(config, seed=seed, train=replace(config.train, batch_size=8, microbatches=4, seq_len=64,
                                                    eval_every=0, eval_batches=4))


async def run(config, data, steps: int, share: float, check: str) -> dict:
    workers = {peer: StageWorker(config, stage, run_id="bench", options=WorkerOptions())
               for peer, stage in STAGES.items()}
    try:
        for worker in workers.values():
            await worker.start()
        views = [WorkerView(peer, w.address, STAGES[peer], announced_samples_per_s=100.0) for peer, w in workers.items()]
        shares = {"spot_check_share": share, "gradient_check_share": 0.0} if check == "spot" else \
            {"spot_check_share": 0.0, "gradient_check_share": share}
        options = TrainerOptions(run_id="bench", max_in_flight=4, **shares)
        async with SwarmTrainer(config, data, StaticDiscovery(views), options) as trainer:
            records = await trainer.run(steps)
            held_out = await trainer.evaluate(data.heldout_batches(config.train.eval_batches, config.train.batch_size))
        split = trainer.stats.spot_check_split() if check == "spot" else trainer.stats.gradient_check_split()
        checks = {"sent": 0, "skipped": 0, "failed": 0, "compute_s": 0.0}
        for stage in split.values():  # summed over the checked stages
            for name, value in stage.items():
                checks["failed" if name in ("disagreements", "failures") else name] += value
        return {"tokens_per_s": records[-1].tokens_per_s, "flagged": sorted(trainer.stats.flagged_by_peer),
                "microbatches": trainer.stats.microbatches, "heldout": held_out, **checks}
    finally:
        await asyncio.gather(*(w.stop(0) for w in workers.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", choices=("spot", "self"), default="spot")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.02, 0.1, 1.0])
    parser.add_argument("--repeats", type=int, default=1, help="runs per share, in turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4 steps, shares 0 and 1")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.shares, args.repeats = 4, [0.0, 1.0], 1
    out = args.out or ROOT / "bench" / "results" / f"{args.check}_checks_tiny.md"
    torch.set_num_threads(1)
    config = _config(args.seed)
    data = build_data(config)
    load = [os.getloadavg()[0]]
    runs: dict[float, list[dict]] = {share: [] for share in args.shares}
    for _ in range(args.repeats):
        for share in args.shares:
            runs[share].append(asyncio.run(run(config, data, args.steps, share, args.check)))
            print(f"share {share:g}: {runs[share][-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    load.append(os.getloadavg()[0])
    title = "Spot checks'" if args.check == "spot" else "Self checks'"
    failed = "disagreements" if args.check == "spot" else "out of band"
    lines = [f"# {title} cost (tiny, 2 stages, head x2, {args.steps} steps, seed {args.seed}, {platform.node()})", "",
             f"`python bench/spot_checks.py --check {args.check} --steps {args.steps} --shares "
             f"{' '.join(f'{s:g}' for s in args.shares)} --repeats {args.repeats}`; 1-minute load "
             f"{load[0]:.2f}->{load[1]:.2f}; tokens/s the median of {args.repeats} run(s) per share, taken in turn.", "",
             f"| share | tokens/s | vs none | checks sent | per microbatch | skipped | {failed} | "
             "checks' compute (s) | flagged | held-out loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    baseline = statistics.median(r["tokens_per_s"] for r in runs[args.shares[0]])
    for share, results in runs.items():
        speed, result = statistics.median(r["tokens_per_s"] for r in results), results[-1]
        lines.append(f"| {share:g} | {speed:.0f} | {speed / baseline:.3f} | "
                     f"{result['sent']} | {result['sent'] / max(1, result['microbatches']):.3f} | "
                     f"{result['skipped']} | {result['failed']} | {result['compute_s']:.2f} | "
                     f"{', '.join(result['flagged']) or '-'} | {result['heldout']:.4f} |")
        print(lines[-1], flush=True)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
