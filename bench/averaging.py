"""Replicas kept together by averaging, against the centralized run on the same tokens.

For each seed, on one preset, stage split and number of global batches (so the same tokens),
with the learning-rate schedule completed over those batches (warmup, cosine to the floor):
  - `train-local` (the centralized reference), its dense control (rank = d: what the subspace
    constraint costs at equal tokens) and `train-local` on 1/R of every batch (the same steps on
    what one replica sees of each batch: a replica that is never averaged, without asynchrony),
  - R replicas in one process averaged exactly at the run's sparta cadence (no asynchrony, no
    mixed routes: what the cadence alone costs),
  - `agora-node demo --replicas 1` (the asynchronous pipeline alone: no averaging possible), and
    again with `--pinned-weights 0` (each backward recomputed on the current weights instead of
    the weights its forward used: what weight pinning buys),
  - `agora-node demo --replicas R` with sync method sparta, diloco and none (never averaged),
and reports each run's held-out loss and its ratio to train-local (the issue's goal for the
swarm: <= 1.02), mean over seeds; the averaging rounds by outcome; averaging bytes per global
step and per parameter per local step; and the share of training time the compute thread spent
on averaging snapshots and applies (goal < 2%; training time = tokens / the trainer's tokens/s).
Writes bench/results/averaging_<preset>.md.

    python bench/averaging.py --config tiny --stages 3 --replicas 2 --steps 200 --seeds 0 1 2
    python bench/averaging.py --methods sparta --every 2 --fraction 0.5 --tag dense   # another cadence
    python bench/averaging.py --batch-size 32 --microbatches 8 --tag b32   # steps that outlast a round
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from agora.pipeline.centralized import CentralizedTrainer, evaluate_stages
from agora.pipeline.config import load_config
from agora.pipeline.data import build_data


def train_local(config, steps: int, heldout_batch_size: int | None = None) -> float:
    """Held-out loss after `steps`; on the held-out batches of `heldout_batch_size` sequences (default:
    the config's batch), so runs with a smaller batch are measured on the same held-out set."""
    torch.manual_seed(config.seed)
    data = build_data(config)
    trainer = CentralizedTrainer(config, data)
    trainer.run(steps)
    train = config.train
    batches = data.heldout_batches(train.eval_batches, heldout_batch_size or train.batch_size)
    return evaluate_stages(trainer.stages, trainer.codec, batches)


def ideal_sparta(config, steps: int, replicas: int) -> float:
    """R replicas in one process, no pipeline asynchrony and no mixed routes: each steps on its
    share of every batch (the shared epoch) and, every `sync.every_steps` steps, the replicas
    average slice r of every stage exactly (`sync.fraction`): what the averaging cadence alone
    costs. Held-out loss of replica 0."""
    from agora.node.averaging.sparta import SlicePartition

    torch.manual_seed(config.seed)
    data = build_data(config)
    models = [CentralizedTrainer(config, data) for _ in range(replicas)]
    partitions = [SlicePartition([p.numel() for p in optimizer.parameters], config.sync.n_slices, config.seed)
                  for optimizer in models[0].optimizers]
    n_micro = config.train.microbatches
    for step in range(steps):
        chunks = data.train.unit(step).chunk(n_micro)
        for r, model in enumerate(models):
            mine = chunks[r::replicas]
            for chunk in mine:
                model._microbatch(chunk)
            for optimizer in model.optimizers:
                optimizer.step(len(mine))
        if (step + 1) % config.sync.every_steps == 0:
            index = ((step + 1) // config.sync.every_steps) % config.sync.n_slices
            for k, partition in enumerate(partitions):
                values = [partition.gather(model.optimizers[k].parameters, index) for model in models]
                mean = sum(values) / replicas
                for model, value in zip(models, values):
                    partition.scatter_add(model.optimizers[k].parameters, index, mean - value)
    return models[0].evaluate()


def demo(args, seed: int, replicas: int, method: str, work: Path, pinned: int | None = None) -> dict:
    name = f"seed{seed}-r{replicas}-{method}" + ("" if pinned is None else f"-pinned{pinned}")
    summary_path = work / f"{name}.json"
    flags = [] if pinned is None else ["--pinned-weights", str(pinned)]
    for flag, value in (("--batch-size", args.batch_size), ("--microbatches", args.microbatches),
                        ("--max-in-flight", args.max_in_flight), ("--averaging-every", args.every),
                        ("--averaging-fraction", args.fraction)):
        if value is not None:
            flags += [flag, str(value)]
    subprocess.run([sys.executable, "-m", "agora.node", "--log-level", "WARNING", "demo", "--config", args.config,
                    "--stages", str(args.stages), "--replicas", str(replicas), "--steps", str(args.steps),
                    "--schedule-steps", str(args.steps), "--seed", str(seed), "--averaging", method, *flags,
                    "--summary-json", str(summary_path), "--workdir", str(work / name)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(summary_path.read_text())


def averaging_figures(summary: dict) -> dict:
    stages = summary.get("averaging_by_stage", {})
    train_s = summary["tokens"] / summary["tokens_per_s"] if summary.get("tokens_per_s") else None
    outcomes: dict[str, int] = {}
    bytes_sent = blocked = 0.0
    per_param_step, lags = [], []
    for stage in stages.values():
        if stage.get("mean_lag_steps") is not None:
            lags.append(stage["mean_lag_steps"])
        for outcome, n in stage["rounds_by_outcome"].items():
            outcomes[outcome] = outcomes.get(outcome, 0) + n
        bytes_sent += stage["bytes_sent"]
        if stage["local_steps"] and stage["parameters"]:
            per_param_step.append(stage["bytes_sent"] / (stage["parameters"] * stage["local_steps"]))
        if train_s:
            # Per replica: its compute thread's averaging time over the training time; the worst stage.
            blocked = max(blocked, stage["compute_blocked_s"] / stage["replicas_reporting"] / train_s)
    return {"outcomes": outcomes, "bytes_per_global_step": bytes_sent / max(1, summary["steps"]),
            "bytes_per_param_per_local_step": statistics.mean(per_param_step) if per_param_step else 0.0,
            "blocked_fraction": blocked, "lag_steps": statistics.mean(lags) if lags else None}


def run_config(args, seed: int):
    base = load_config(args.config)
    config = replace(base, seed=seed, model=replace(base.model, basis_seed=seed),
                     data=replace(base.data, seed=seed), optim=replace(base.optim, total_steps=args.steps))
    batch = {name: value for name, value in (("batch_size", args.batch_size), ("microbatches", args.microbatches))
             if value is not None}
    if batch:
        config = replace(config, train=replace(config.train, **batch))
    sync = {name: value for name, value in (("every_steps", args.every), ("fraction", args.fraction))
            if value is not None}
    return replace(config, sync=replace(config.sync, **sync)).with_stages(args.stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--methods", nargs="+", default=["sparta", "diloco", "none"])
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per global batch (default: the preset's)")
    parser.add_argument("--microbatches", type=int, default=None, help="microbatches per batch (default: the preset's)")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="demo runs: microbatches in flight (default: the trainer's, half a global batch)")
    parser.add_argument("--every", type=int, default=None, help="local steps between rounds (default: the preset's)")
    parser.add_argument("--fraction", type=float, default=None, help="sparta share per round (default: the preset's)")
    parser.add_argument("--tag", default=None, help="suffix of the results file")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="agora-bench-averaging-"))
    r = args.replicas
    names = ["train-local (subspace)", "train-local dense control",
             f"train-local on 1/{r} of every batch (a replica never averaged)",
             f"{r} in-process replicas, exact sparta at this cadence, no asynchrony", "demo --replicas 1 (async)",
             "demo --replicas 1 (async), backward on current weights (--pinned-weights 0)"]
    names += [f"demo --replicas {r} --averaging {m}" for m in args.methods]
    heldout: dict[str, list[float]] = {name: [] for name in names}
    figures: dict[str, list[dict]] = {name: [] for name in names}
    rates: dict[str, list[float]] = {name: [] for name in names}
    tokens = 0
    for seed in args.seeds:
        config = run_config(args, seed)
        tokens = args.steps * config.train.batch_size * config.train.seq_len
        heldout[names[0]].append(train_local(config, args.steps))
        heldout[names[1]].append(train_local(replace(config, model=replace(config.model, rank=None)), args.steps))
        share = replace(config, train=replace(config.train, batch_size=config.train.batch_size // r,
                                              microbatches=max(1, config.train.microbatches // r)))
        heldout[names[2]].append(train_local(share, args.steps, heldout_batch_size=config.train.batch_size))
        heldout[names[3]].append(ideal_sparta(config, args.steps, r))
        runs = [(names[4], 1, "none", None), (names[5], 1, "none", 0)]
        runs += [(f"demo --replicas {r} --averaging {m}", r, m, None) for m in args.methods]
        for name, replicas, method, pinned in runs:
            summary = demo(args, seed, replicas, method, work, pinned)
            heldout[name].append(summary["heldout_loss"])
            rates[name].append(summary["tokens_per_s"])
            if method != "none":
                figures[name].append(averaging_figures(summary))

    sync = run_config(args, args.seeds[0]).sync
    reference = heldout[names[0]]
    train = run_config(args, args.seeds[0]).train
    table = [f"# averaging: {args.config}, {args.stages} stages, {r} replicas, {args.steps} global batches of "
             f"{train.batch_size} x {train.seq_len} in {train.microbatches} microbatches ({tokens:,} tokens), "
             f"seeds {' '.join(map(str, args.seeds))}"
             + (f", {args.max_in_flight} microbatches in flight" if args.max_in_flight else ""), "",
             f"sync: every {sync.every_steps} local steps, sparta fraction {sync.fraction} ({sync.n_slices} slices), "
             f"diloco {sync.fragments} fragments (outer lr {sync.outer_lr}, momentum {sync.outer_momentum}), "
             f"matchmaking {sync.matchmaking_s:g} s, parts {sync.part_size_bytes} B", "",
             "| run | held-out loss (mean) | / train-local (mean) | per seed | tokens/s | rounds committed/alone/other "
             "| apply lag (steps) | bytes / global step | bytes / param / local step | compute blocked (max) |",
             "|---|---:|---:|---|---:|---|---:|---:|---:|---:|"]
    for name in names:
        losses = heldout[name]
        ratios = [loss / ref for loss, ref in zip(losses, reference)]
        rate = f"{statistics.mean(rates[name]):,.0f}" if rates[name] else "-"
        if figures[name]:
            outcomes: dict[str, int] = {}
            for f in figures[name]:
                for k, n in f["outcomes"].items():
                    outcomes[k] = outcomes.get(k, 0) + n
            other = sum(n for k, n in outcomes.items() if k not in ("committed", "alone"))
            lags = [f["lag_steps"] for f in figures[name] if f["lag_steps"] is not None]
            cells = (f"{outcomes.get('committed', 0)}/{outcomes.get('alone', 0)}/{other}",
                     f"{statistics.mean(lags):.2f}" if lags else "-",
                     f"{statistics.mean(f['bytes_per_global_step'] for f in figures[name]):,.0f}",
                     f"{statistics.mean(f['bytes_per_param_per_local_step'] for f in figures[name]):.3f}",
                     f"{100 * max(f['blocked_fraction'] for f in figures[name]):.3f}%")
        else:
            cells = ("-", "-", "-", "-", "-")
        table.append(f"| {name} | {statistics.mean(losses):.4f} | {statistics.mean(ratios):.4f} | "
                     f"{' '.join(f'{x:.3f}' for x in ratios)} | {rate} | " + " | ".join(cells) + " |")
    dense = statistics.mean(d / s for d, s in zip(heldout[names[1]], reference))
    table += ["", f"Subspace vs dense control at equal tokens: dense / subspace held-out = {dense:.4f} "
              "(below 1: the subspace constraint costs that much loss).", "",
              "Bytes: the averagers' estimate of what each peer sends (2 (g-1)/g of the averaged vector per "
              "round), summed over all workers per global step; per parameter per local step, one replica's "
              "(sparta: about 2 (g-1)/g x 4 bytes x fraction / every_steps; diloco also sends its fragment's "
              "anchor). Compute blocked: the largest per-replica share of training time its compute thread "
              "spent on averaging snapshots and applies. Apply lag: local steps from a round's snapshot to "
              "the step its result was applied at, mean over applied rounds (and stages)."]
    text = "\n".join(table) + "\n"
    print(text)
    suffix = f"_{args.tag}" if args.tag else ""
    out = Path(args.out or Path(__file__).parent / "results" / f"averaging_{args.config}{suffix}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
