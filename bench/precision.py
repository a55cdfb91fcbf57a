"""Compute precision side by side: fp32, bf16 autocast over fp32 master weights, and bf16 weights.

Runs `CentralizedTrainer` on the same preset, seed, data units and stage split with
  - runtime.dtype fp32 (no autocast: what the swarm computes on a CPU by default),
  - dtype bf16 with fp32 master weights and optimizer state (the default bf16 recipe), and
  - dtype bf16 with runtime.weights bf16 (RoundedAdamW: bf16 weights, fp32 Adam moments, each
    update rounded into the weights; half the weight memory),
and prints final train loss (mean of the last 10 steps), held-out loss, its ratio to fp32,
tokens/s and the bytes of the stages' weights, then writes the table to
bench/results/precision_<preset>.md. On a CPU the bf16 rows measure the numerics, not speed (CPU
autocast to bf16 is not faster than fp32 there); on a GPU run the same command with --device cuda.

    python bench/precision.py --config tiny --steps 200 --stages 2
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch

from agora.pipeline.centralized import CentralizedTrainer
from agora.pipeline.config import RuntimeConfig, load_config
from agora.pipeline.data import build_data

VARIANTS = (("fp32", "fp32", "fp32"), ("bf16 autocast, fp32 masters", "bf16", "fp32"),
            ("bf16 weights (RoundedAdamW)", "bf16", "bf16"))


def run(config, data, steps: int) -> dict:
    torch.manual_seed(config.seed)
    trainer = CentralizedTrainer(config, data)
    started = time.perf_counter()
    records = trainer.run(steps)
    wall = time.perf_counter() - started
    tail = records[-10:]
    weights = sum(p.numel() * p.element_size() for stage in trainer.stages for p in stage.parameters()
                  if p.requires_grad)
    return {"train_loss": sum(r.loss for r in tail) / len(tail), "heldout": trainer.evaluate(),
            "tokens_per_s": records[-1].tokens / wall, "weight_bytes": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    base = load_config(args.config).with_stages(args.stages)
    base = replace(base, optim=replace(base.optim, total_steps=args.steps),
                   train=replace(base.train, eval_every=0, eval_batches=8))
    data = build_data(base)
    rows = []
    for name, dtype, weights in VARIANTS:
        config = replace(base, runtime=RuntimeConfig(device=args.device, dtype=dtype, weights=weights))
        result = run(config, data, args.steps)
        rows.append((name, result))
        print(f"{name:30s} train {result['train_loss']:.4f} heldout {result['heldout']:.4f} "
              f"{result['tokens_per_s']:,.0f} tok/s", flush=True)

    reference = rows[0][1]
    load = os.getloadavg()[0]
    lines = [
        f"# Compute precision side by side: {args.config}, {args.stages} stages, {args.steps} steps, seed {base.seed}",
        "",
        f"`python bench/precision.py --config {args.config} --steps {args.steps} --stages {args.stages} "
        f"--device {args.device}`; {platform.machine()}, {args.threads} threads, load {load:.1f} at the end; "
        "the same data units for every row. The wire is fp32 in every row (its dtype is independent).",
        "",
        "| compute | train loss (last 10) | held-out loss | held-out / fp32 | tokens/s | trainable weights MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, result in rows:
        lines.append(f"| {name} | {result['train_loss']:.4f} | {result['heldout']:.4f} | "
                     f"{result['heldout'] / reference['heldout']:.4f} | {result['tokens_per_s']:,.0f} | "
                     f"{result['weight_bytes'] / 2**20:.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(args.out or Path(__file__).parent / "results" / f"precision_{args.config}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)


if __name__ == "__main__":
    main()
