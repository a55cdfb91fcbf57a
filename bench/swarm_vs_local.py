"""Swarm vs centralized on this machine: same model, same tokens, measured in one run.

Runs `agora-node train-local` and `agora-node demo` (sync, then async) as subprocesses on the
same preset, stages, seed and steps, and reports swarm tokens/s divided by train-local tokens/s,
the per-stage split of each call (compute / queued / wire, from the workers' own timings) and
the loss of each run. Writes bench/results/swarm_vs_local_<preset>.md.

    python bench/swarm_vs_local.py --config small --stages 3 --steps 20
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def agora(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "agora.node", "--log-level", "WARNING", *args], check=True,
                   stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-in-flight", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    run = ["--config", args.config, "--stages", str(args.stages), "--steps", str(args.steps), "--seed", str(args.seed)]
    work = Path(tempfile.mkdtemp(prefix="agora-bench-"))

    agora("--threads", "2", "train-local", *run, "--log-json", str(work / "local.jsonl"))
    local = [json.loads(line) for line in (work / "local.jsonl").read_text().splitlines()]
    local_rate = local[-1]["tokens_per_s"]
    rows = [("train-local (2 threads)", local_rate, local[-1]["loss"], None)]
    for mode in ("sync", "async"):
        summary_path = work / f"{mode}.json"
        agora("demo", *run, *(["--sync"] if mode == "sync" else []), "--max-in-flight", str(args.max_in_flight),
              "--summary-json", str(summary_path), "--log-json", str(work / f"{mode}.jsonl"))
        summary = json.loads(summary_path.read_text())
        lines = [json.loads(line) for line in (work / f"{mode}.jsonl").read_text().splitlines()]
        rows.append((f"demo --{mode} ({args.stages} workers x 1 thread)", summary["tokens_per_s"], lines[-1]["loss"],
                     summary["time_split_by_stage"]))

    table = [f"# swarm vs train-local: {args.config}, {args.stages} stages, {args.steps} steps, seed {args.seed}", "",
             "| run | tokens/s | / train-local | last loss |", "|---|---:|---:|---:|"]
    for name, rate, loss, _ in rows:
        table.append(f"| {name} | {rate:,.0f} | {rate / local_rate:.3f} | {loss:.4f} |")
    table += ["", "Per-call time split by stage (ms per call; wire = round trip - compute - queued):", "",
              "| run | stage | calls | round trip | compute | queued | wire |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, _, _, split in rows[1:]:
        for stage, t in split.items():
            table.append(f"| {name} | {stage} | {t['calls']} | {t['round_trip_ms']:.1f} | {t['compute_ms']:.1f} | "
                         f"{t['queued_ms']:.1f} | {t['wire_ms']:.1f} |")
    text = "\n".join(table) + "\n"
    print(text)
    out = Path(args.out or Path(__file__).parent / "results" / f"swarm_vs_local_{args.config}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
