"""What robust aggregation costs and what it stops, measured side by side in one run.

1. The reducer's work per all-reduce part (2 MiB of float32, the report's part size): the robust
   rules (dht/robust.py: outlier rejection, CenteredClip for 3+, the pair bound) against
   hivemind's weighted mean, honest values, for groups of 2, 3 and 5; median of repeated runs.
2. Three replicas training on disjoint data through real hivemind averaging (the harness of
   tests/integration/test_hostile_averaging.py, so what is measured is what is tested): all honest; one
   hostile replica (x10 / random values, weight 1e6, a poisoning reducer) with the robust rules;
   the same hostile replica against the plain mean. Held-out loss of the honest replicas.
3. `agora-node demo --replicas 2`, honest, with `--aggregation centered_clip` and `mean`,
   alternating: held-out loss and tokens/s (what the rules cost a run that needs none of them).

Writes bench/results/robust_averaging_tiny.md.

    python bench/robust_averaging.py --demo-steps 200 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from agora.dht.robust import RobustAggregation, aggregate_part

ROOT = Path(__file__).resolve().parents[1]


def reducer_cost(group: int, repeats: int = 15) -> tuple[float, float, float]:
    """Median seconds per 2 MiB part: robust rules, plain mean; and the ratio."""
    generator = torch.Generator().manual_seed(group)
    base = 0.02 * torch.randn(2**19, generator=generator)
    parts = [base + 2e-4 * torch.randn(base.shape, generator=generator) for _ in range(group)]
    weights = [32.0] * group
    timings = {}
    for name, policy in (("robust", RobustAggregation()), ("mean", RobustAggregation("mean"))):
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            aggregate_part(parts, weights, policy, own=0, bound=0.5)
            samples.append(time.perf_counter() - started)
        timings[name] = statistics.median(samples)
    return timings["robust"], timings["mean"], timings["robust"] / timings["mean"]


def hostile_training() -> dict[str, list[float]]:
    sys.path[:0] = [str(ROOT / "tests" / "integration"), str(ROOT / "tests" / "helpers")]
    import test_hostile_averaging as harness  # noqa: E402 - the test's own harness

    torch.set_num_threads(1)
    return {name: harness.train(kinds, f"bench-{name}")[0] for name, kinds in (
        ("all honest", ["robust"] * 3), ("one hostile, robust rules", ["robust", "robust", "hostile"]),
        ("one hostile, plain mean", ["mean", "mean", "hostile"]))}


def demo(aggregation: str, steps: int, seed: int, work: Path) -> dict:
    summary = work / f"{aggregation}-{time.monotonic_ns()}.json"
    subprocess.run([sys.executable, "-m", "agora.node", "--log-level", "WARNING", "demo", "--replicas", "2",
                    "--steps", str(steps), "--schedule-steps", str(steps), "--seed", str(seed),
                    "--aggregation", aggregation, "--summary-json", str(summary)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(summary.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo-steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2, help="demo runs of each aggregation, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "robust_averaging_tiny.md"))
    args = parser.parse_args()
    lines = ["# Robust aggregation: its cost and what it stops", "",
             f"Machine: {platform.machine()}, {platform.system()}, Python {platform.python_version()}, "
             f"{os.cpu_count()} cores, torch {torch.__version__} on the CPU, {torch.get_num_threads()} threads.", "",
             "## 1. Reducer work per 2 MiB part (honest values)", "",
             "| group | robust rules ms | plain mean ms | robust / mean |", "|---:|---:|---:|---:|"]
    for group in (2, 3, 5):
        robust, mean, ratio = reducer_cost(group)
        lines.append(f"| {group} | {robust * 1e3:.2f} | {mean * 1e3:.2f} | {ratio:.1f} |")
        print(lines[-1], flush=True)
    lines += ["", "For scale: 2 MiB take 84 ms to send at the report's 200 Mbit/s admission floor.", "",
              "## 2. Three replicas, one of them hostile (tests/integration/test_hostile_averaging.py's harness)", "",
              "Tiny as one stage, 48 local steps of 2 sequences each on disjoint data, a round every 2 steps "
              "(half of the stage per round); held-out loss of each replica (the hostile one last).", "",
              "| run | held-out loss per replica | honest mean / all-honest mean |", "|---|---|---:|"]
    results = hostile_training()
    reference = statistics.mean(results["all honest"])
    for name, losses in results.items():
        honest = losses if name == "all honest" else losses[:2]
        lines.append(f"| {name} | {', '.join(f'{x:.4f}' for x in losses)} | {statistics.mean(honest) / reference:.3f} |")
        print(lines[-1], flush=True)
    if not args.skip_demo:
        lines += ["", f"## 3. `demo --replicas 2`, honest, {args.demo_steps} steps, seed {args.seed}, "
                  f"{args.repeats} runs each, alternating", "",
                  "| aggregation | held-out loss (each run) | tokens/s (each run) | rejections |", "|---|---|---|---|"]
        work = Path(tempfile.mkdtemp(prefix="agora-bench-robust-"))
        runs: dict[str, list[dict]] = {"centered_clip": [], "mean": []}
        for _ in range(args.repeats):
            for aggregation in runs:
                runs[aggregation].append(demo(aggregation, args.demo_steps, args.seed, work))
        for aggregation, summaries in runs.items():
            rejections: dict[str, int] = {}
            for summary in summaries:
                for stage in summary.get("averaging_by_stage", {}).values():
                    for reason, n in stage.get("rejections", {}).items():
                        rejections[reason] = rejections.get(reason, 0) + n
            losses = ", ".join(f"{s['heldout_loss']:.4f}" for s in summaries)
            rates = ", ".join(f"{s['tokens_per_s']:,.0f}" for s in summaries)
            lines.append(f"| {aggregation} | {losses} | {rates} | {rejections or 'none'} |")
            print(lines[-1], flush=True)
        clip = statistics.mean(s["heldout_loss"] for s in runs["centered_clip"])
        mean = statistics.mean(s["heldout_loss"] for s in runs["mean"])
        lines += ["", f"Held-out loss, centered_clip / mean: {clip / mean:.3f} (asynchronous runs vary by 1-2% "
                  "from run to run)."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
