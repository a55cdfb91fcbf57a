"""What spot checks cost: tokens/s with and without them, side by side, over real gRPC.

tiny, two stages: two head replicas and one tail, StageWorkers on loopback and one SwarmTrainer
(the harness of tests/integration/test_spot_checks_grpc.py), all honest. The same run (same seed,
same data) once per `--shares` value of `spot_check_share`: tokens/s and its ratio to the run
without checks, the checks sent (each one extra held-out Forward on the other head), skipped (no
credit free there), disagreements, the second replica's compute on them, and the held-out loss.
On one machine every process shares the CPUs, so a check's forward competes with the pipeline's
own work: the ratio is an upper bound on what checks cost where each worker has its own device.

Writes bench/results/spot_checks_tiny.md.

    python bench/spot_checks.py --steps 60 --shares 0 0.02 0.1 1
    python bench/spot_checks.py --quick      # 4 steps, shares 0 and 1: shows it works
"""

from __future__ import annotations

import argparse
import asyncio
import platform
from dataclasses import replace
from pathlib import Path

import torch

from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.trainer import SwarmTrainer, TrainerOptions
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"s0r0": 0, "s0r1": 0, "s1r0": 1}


def _config(seed: int):
    config = PRESETS["tiny"].with_stages(2)
    return replace(config, seed=seed, train=replace(config.train, batch_size=8, microbatches=4, seq_len=64,
                                                    eval_every=0, eval_batches=4))


async def run(config, data, steps: int, share: float) -> dict:
    workers = {peer: StageWorker(config, stage, run_id="bench", options=WorkerOptions())
               for peer, stage in STAGES.items()}
    try:
        for worker in workers.values():
            await worker.start()
        views = [WorkerView(peer, w.address, STAGES[peer], announced_samples_per_s=100.0) for peer, w in workers.items()]
        options = TrainerOptions(run_id="bench", max_in_flight=4, spot_check_share=share)
        async with SwarmTrainer(config, data, StaticDiscovery(views), options) as trainer:
            records = await trainer.run(steps)
            held_out = await trainer.evaluate(data.heldout_batches(config.train.eval_batches, config.train.batch_size))
        checks = trainer.stats.spot_check_split().get("0", {"sent": 0, "skipped": 0, "disagreements": 0,
                                                            "compute_s": 0.0})
        return {"tokens_per_s": records[-1].tokens_per_s, "flagged": sorted(trainer.stats.flagged_by_peer),
                "microbatches": trainer.stats.microbatches, "heldout": held_out, **checks}
    finally:
        await asyncio.gather(*(w.stop(0) for w in workers.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.02, 0.1, 1.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4 steps, shares 0 and 1")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "spot_checks_tiny.md"))
    args = parser.parse_args()
    if args.quick:
        args.steps, args.shares = 4, [0.0, 1.0]
    torch.set_num_threads(1)
    config = _config(args.seed)
    data = build_data(config)
    lines = [f"# Spot checks' cost (tiny, 2 stages, head x2, {args.steps} steps, seed {args.seed}, "
             f"{platform.node()})", "",
             "| share | tokens/s | vs none | checks sent | per microbatch | skipped | disagreements | "
             "checks' compute (s) | flagged | held-out loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    baseline = None
    for share in args.shares:
        result = asyncio.run(run(config, data, args.steps, share))
        baseline = baseline or result["tokens_per_s"]
        lines.append(f"| {share:g} | {result['tokens_per_s']:.0f} | {result['tokens_per_s'] / baseline:.3f} | "
                     f"{result['sent']} | {result['sent'] / max(1, result['microbatches']):.3f} | "
                     f"{result['skipped']} | {result['disagreements']} | {result['compute_s']:.2f} | "
                     f"{', '.join(result['flagged']) or '-'} | {result['heldout']:.4f} |")
        print(lines[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
