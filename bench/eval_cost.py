"""What evaluating the live swarm during training costs the training: the same `agora-node demo`
(preset, stages, seed, steps) without evaluations and with the run config's `evals` (held-out
perplexity and an lm-eval task of bench/evals/agora_code every N global batches), side by side in
one run, in turn, `--repeats` times each. Reports tokens/s with over without, the evaluations the
run made, their mean duration, and the last held-out loss through the swarm beside the trainer's
own final one. Writes bench/results/eval_cost_<preset>.md.

    python bench/eval_cost.py --config tiny --stages 2 --steps 60 --every 10
    python bench/eval_cost.py --quick          # the smallest form: shows it runs, no figures to keep
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from agora.bench.swarm_vs_local import demo, run_flags

TASKS = Path(__file__).resolve().parent / "evals" / "agora_code"


def evals_config(preset: str, every: int, heldout_batches: int, task: str, limit: int) -> str:
    """A run config file: the preset with an `evals` section (what the `with` runs add)."""
    return (f'preset = "{preset}"\n\n[evals]\nevery = {every}\nheldout_batches = {heldout_batches}\n'
            f'tasks = ["{task}"]\ninclude_path = "{TASKS}"\nlimit = {limit}\n')


def measure(args: argparse.Namespace, work: Path) -> dict[str, list[dict]]:
    config = work / "evals.toml"
    config.write_text(evals_config(args.config, args.every, args.heldout_batches, args.task, args.limit))
    runs: dict[str, list[dict]] = {"without": [], "with": []}
    for repeat in range(args.repeats):  # in turn, so a slower spell of the machine hits both
        for name, spec in (("without", args.config), ("with", str(config))):
            summary = demo(run_flags(spec, args.stages, args.steps, args.seed), [], work, f"{name}{repeat}")
            runs[name].append(summary)
    return runs


def table(args: argparse.Namespace, runs: dict[str, list[dict]]) -> list[str]:
    rate = {name: statistics.median(s["tokens_per_s"] for s in summaries) for name, summaries in runs.items()}
    evaluations = [e for s in runs["with"] for e in s.get("evaluations", [])]
    last = runs["with"][-1].get("evaluations") or [{}]
    lines = [f"# evaluations during training: {args.config}, {args.stages} stages, {args.steps} steps, seed {args.seed}",
             "", f"Every {args.every} global batches: held-out loss over {args.heldout_batches} batches and "
             f"{args.task} ({args.limit} examples) through the swarm; median of {args.repeats} run(s) each, in turn.",
             "", "| run | tokens/s | / without | evaluations | held-out loss (trainer, end) | held-out loss (swarm, last eval) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, summaries in runs.items():
        made = sum(len(s.get("evaluations", [])) for s in summaries) / len(summaries)
        swarm = last[-1].get("heldout_loss") if name == "with" else None
        lines.append(f"| {name} | {rate[name]:,.0f} | {rate[name] / rate['without']:.3f} | {made:g} | "
                     f"{summaries[-1]['heldout_loss']:.4f} | {'-' if swarm is None else f'{swarm:.4f}'} |")
    if evaluations:
        lines += ["", f"Evaluations' figures (last): {last[-1]}"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=10, help="global batches between evaluations")
    parser.add_argument("--heldout-batches", type=int, default=2)
    parser.add_argument("--task", default="agora_code_mc")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="12 steps, one evaluation every 6, one run each")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.every, args.limit, args.repeats, args.heldout_batches = 12, 6, 4, 1, 1
    work = Path(tempfile.mkdtemp(prefix="agora-bench-evals-"))
    lines = table(args, measure(args, work))
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"eval_cost_{args.config}.md"
    if not args.quick or args.out:
        out.write_text(text)


if __name__ == "__main__":
    main()
