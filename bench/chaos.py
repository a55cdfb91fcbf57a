"""A swarm under churn against the same run left alone, side by side: `agora-node demo --chaos`.

For each seed, the same demo (3 stages x 2 replicas, 2 trainers by default) twice, alternating:
once without faults, once with a random worker or trainer killed -9 every `--every` seconds and
a newcomer (new identity, empty state) started in its place. Reports, per run and as ratios:
held-out loss (goal: within 3% of the fault-free run), tokens/s and wall time, the units
committed / lost / run twice, each newcomer's seconds from start to member, and the throughput
dip after a kill (global batches completed in the `--window` seconds after each kill, against the
fault-free run's rate), and the honest workers the trainers' verifiers flagged (every worker here is
honest: goal 0). The batches' completion times are read from the demo's live --log-json.
Writes bench/results/chaos_<preset>.md.

    python bench/chaos.py --steps 200 --every 15 --seeds 0 1
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

ROOT = Path(__file__).resolve().parents[1]


def run(args, seed: int, chaos: bool, work: Path) -> dict:
    name = f"seed{seed}-{'chaos' if chaos else 'quiet'}"
    log, summary = work / f"{name}.jsonl", work / f"{name}.json"
    command = [sys.executable, "-m", "agora.node", "--log-level", "WARNING", "demo", "--config", args.config,
               "--stages", str(args.stages), "--replicas", str(args.replicas), "--trainers", str(args.trainers),
               "--steps", str(args.steps), "--schedule-steps", str(args.steps), "--seed", str(seed), "--no-monitor",
               "--log-json", str(log), "--summary-json", str(summary), "--workdir", str(work / name)]
    if chaos:
        command += ["--chaos", str(args.every), "--chaos-seed", str(seed)]
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done_at: list[float] = []  # seconds into the run at which each global batch's line appeared
    while process.poll() is None:
        if log.exists():
            lines = log.read_text().count("\n")
            done_at += [time.monotonic() - started] * max(0, lines - len(done_at))
        time.sleep(0.2)
    if process.returncode != 0:
        raise SystemExit(f"{name}: the demo exited with {process.returncode}")
    result = json.loads(summary.read_text())
    result["done_at"] = done_at
    return result


def dip(chaotic: dict, quiet: dict, window: float) -> float | None:
    """Batches done in the `window` s after each kill, over what the quiet run did per `window` s."""
    events = chaotic.get("churn", {}).get("events", [])
    if not events or not quiet["done_at"]:
        return None
    quiet_rate = len(quiet["done_at"]) / max(quiet["done_at"][-1], 1e-9) * window
    after = [sum(1 for t in chaotic["done_at"] if e["at_s"] <= t < e["at_s"] + window) for e in events]
    return statistics.mean(after) / quiet_rate if quiet_rate else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=float, default=15.0, help="seconds between kills")
    parser.add_argument("--window", type=float, default=10.0, help="seconds after a kill the dip is measured over")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="agora-bench-chaos-"))
    load = os.getloadavg()
    table = [f"# Churn: {args.config}, {args.stages} stages x {args.replicas} replicas, {args.trainers} trainers, "
             f"{args.steps} global batches, a kill every {args.every:g} s", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores shared by every process of both runs (one at a "
             f"time); load average at the start {load[0]:.1f}. Runs alternate, fault-free first.", "",
             "| seed | run | held-out loss | / fault-free | tokens/s | / fault-free | wall s | kills | units committed "
             "/ lost / run twice | newcomers' s to member | batches in 10 s after a kill / fault-free | honest workers "
             "flagged |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|"]
    ratios = []
    for seed in args.seeds:
        quiet = run(args, seed, False, work)
        chaotic = run(args, seed, True, work)
        churn = chaotic["churn"]
        units = churn["units"]
        joined = [j["seconds_to_member"] for j in churn["joins"] if j["seconds_to_member"] is not None]
        loss_ratio = chaotic["heldout_loss"] / quiet["heldout_loss"]
        ratios.append(loss_ratio)
        table.append(f"| {seed} | fault-free | {quiet['heldout_loss']:.4f} | 1.000 | {quiet['tokens_per_s']:,.0f} | 1.000 | "
                     f"{quiet['wall_s']:.1f} | 0 | {quiet['steps']} / 0 / 0 | - | - | {len(quiet.get('flagged', {}))} |")
        table.append(f"| {seed} | chaos | {chaotic['heldout_loss']:.4f} | {loss_ratio:.3f} | "
                     f"{chaotic['tokens_per_s']:,.0f} | {chaotic['tokens_per_s'] / quiet['tokens_per_s']:.3f} | "
                     f"{chaotic['wall_s']:.1f} | {churn['kills']} | {units['committed']} / {units['lost']} / "
                     f"{units['duplicated']} | {', '.join(f'{s:.1f}' for s in joined) or '-'} | "
                     f"{(dip(chaotic, quiet, args.window) or 0):.2f} | {len(chaotic.get('flagged', {}))} |")
        print("\n".join(table[-2:]), flush=True)
    table += ["", f"Held-out loss under chaos / fault-free, mean over seeds: {statistics.mean(ratios):.3f} "
              "(goal: within 3%)."]
    out = Path(args.out or ROOT / "bench" / "results" / f"chaos_{args.config}.md")
    out.write_text("\n".join(table) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
