"""Centralized reference runs side by side: wire dtype cost and the subspace constraint's cost.

Runs `CentralizedTrainer` on the same preset, seed, data units and stage split with
  - the subspace model and fp32 / bf16 / int8 boundary encodings (what int8 costs in loss), and
  - the dense control (rank = d) with fp32 (what the subspace constraint costs at equal tokens),
then prints final train loss (mean of the last 10 steps), held-out loss, their ratios to the
SSN-fp32 run and tokens/s, and writes the table to bench/results/train_local_<preset>.md.

    python bench/train_local.py --config small --steps 60 --stages 4
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import torch

from agora.pipeline.centralized import CentralizedTrainer
from agora.pipeline.config import load_config
from agora.pipeline.data import build_data


def run(config, data, wire_dtype: str, steps: int) -> dict:
    torch.manual_seed(config.seed)
    trainer = CentralizedTrainer(config, data, wire_dtype=wire_dtype)
    started = time.perf_counter()
    records = trainer.run(steps)
    wall = time.perf_counter() - started
    tail = records[-10:]
    return {"train_loss": sum(r.loss for r in tail) / len(tail), "heldout": trainer.evaluate(),
            "tokens_per_s": records[-1].tokens / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    base = load_config(args.config).with_stages(args.stages)
    base = replace(base, optim=replace(base.optim, total_steps=args.steps),
                   train=replace(base.train, eval_every=0, eval_batches=8))
    data = build_data(base)
    dense = replace(base, model=replace(base.model, rank=None))
    variants = [("SSN", base, "fp32"), ("SSN", base, "bf16"), ("SSN", base, "int8"), ("dense", dense, "fp32")]
    rows = []
    for name, config, dtype in variants:
        result = run(config, data, dtype, args.steps)
        rows.append((name, dtype, result))
        print(f"{name:5s} {dtype:4s} train {result['train_loss']:.4f} heldout {result['heldout']:.4f} "
              f"{result['tokens_per_s']:,.0f} tok/s", flush=True)

    reference = rows[0][2]
    model = base.model
    lines = [
        f"# train-local side by side: {args.config}, {args.stages} stages, {args.steps} steps, seed {base.seed}",
        "",
        f"d={model.d_model}, k={model.rank}, layers={model.n_layers}, batch {base.train.batch_size} x "
        f"seq {base.train.seq_len}, {args.threads} threads, same data units for every row.",
        "",
        "| model | wire | train loss (last 10) | held-out loss | held-out / SSN-fp32 | tokens/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, dtype, result in rows:
        lines.append(f"| {name} | {dtype} | {result['train_loss']:.4f} | {result['heldout']:.4f} | "
                     f"{result['heldout'] / reference['heldout']:.4f} | {result['tokens_per_s']:,.0f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(args.out or Path(__file__).parent / "results" / f"train_local_{args.config}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)


if __name__ == "__main__":
    main()
