"""Swarm vs centralized on this machine: same model, same tokens, measured in one run.

Runs `agora-node train-local` and `agora-node demo` (sync, then async) as subprocesses on the
same preset, stages, seed and steps, and reports swarm tokens/s divided by train-local tokens/s,
the per-stage split of each call (compute / queued / wire, from the workers' own timings) and
the loss of each run. Writes bench/results/swarm_vs_local_<preset>.md. `train_local` and `demo`
are what the suite (bench/suite.py, `agora-bench`) runs for its row 2.

    python bench/swarm_vs_local.py --config small --stages 3 --steps 20
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run_flags(config: str, stages: int, steps: int, seed: int) -> list[str]:
    return ["--config", config, "--stages", str(stages), "--steps", str(steps), "--seed", str(seed)]


def train_local(run: list[str], work: Path, threads: int = 2) -> tuple[float, float]:
    """`agora-node train-local` in its own process with `threads` torch threads: (tokens/s, held-out loss)."""
    log = work / "local.jsonl"
    printed = subprocess.run([sys.executable, "-m", "agora.node", "--log-level", "WARNING", "--threads", str(threads),
                              "train-local", *run, "--log-json", str(log)],
                             check=True, capture_output=True, text=True).stdout
    local = [json.loads(line) for line in log.read_text().splitlines()]
    return local[-1]["tokens_per_s"], float(printed.split("heldout=")[1].split()[0])


def demo(run: list[str], flags: list[str], work: Path, name: str) -> dict:
    """`agora-node demo` with `flags` on loopback: its summary."""
    summary_path = work / f"{name}.json"
    subprocess.run([sys.executable, "-m", "agora.node", "--log-level", "WARNING", "demo", *run, *flags,
                    "--summary-json", str(summary_path), "--log-json", str(work / f"{name}.jsonl")],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(summary_path.read_text())


def split_rows(name: str, split: dict) -> list[str]:
    """Markdown rows of one run's per-stage time split (ms per call)."""
    return [f"| {name} | {stage} | {t['calls']} | {t['round_trip_ms']:.1f} | {t['compute_ms']:.1f} | "
            f"{t['queued_ms']:.1f} | {t['wire_ms']:.1f} |" for stage, t in split.items()]


SPLIT_HEADER = ["| run | stage | calls | round trip | compute | queued | wire |", "|---|---:|---:|---:|---:|---:|---:|"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-in-flight", type=int, nargs="*", default=[],
                        help="extra async runs at these depths, beside the default")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    run = run_flags(args.config, args.stages, args.steps, args.seed)
    work = Path(tempfile.mkdtemp(prefix="agora-bench-"))

    local_rate, local_heldout = train_local(run, work)
    rows = [("train-local (2 threads)", local_rate, local_heldout, None)]
    modes = [("sync", ["--sync"]), ("async", [])] + [(f"async, {n} in flight", ["--max-in-flight", str(n)])
                                                    for n in args.max_in_flight]
    for index, (mode, flags) in enumerate(modes):
        summary = demo(run, flags, work, f"run{index}")
        rows.append((f"demo --{mode} ({args.stages} workers x 1 thread)", summary["tokens_per_s"],
                     summary["heldout_loss"], summary["time_split_by_stage"]))

    table = [f"# swarm vs train-local: {args.config}, {args.stages} stages, {args.steps} steps, seed {args.seed}", "",
             "| run | tokens/s | / train-local | held-out loss | / train-local |", "|---|---:|---:|---:|---:|"]
    for name, rate, loss, _ in rows:
        table.append(f"| {name} | {rate:,.0f} | {rate / local_rate:.3f} | {loss:.4f} | {loss / local_heldout:.4f} |")
    table += ["", "Per-call time split by stage (ms per call; wire = round trip - compute - queued):", "", *SPLIT_HEADER]
    for name, _, _, split in rows[1:]:
        table += split_rows(name, split)
    text = "\n".join(table) + "\n"
    print(text)
    out = Path(args.out or Path(__file__).parent / "results" / f"swarm_vs_local_{args.config}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
