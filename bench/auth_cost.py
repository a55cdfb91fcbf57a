"""What admission and trust cost: `agora-node demo` with the authorizer and every check on, against
`demo --insecure`, same model, tokens and cores, measured side by side in one run.

Runs alternate (secure, insecure, secure, insecure, ...) so that a machine that warms up or slows
down during the benchmark weighs on both. Reports the mean tokens/s of each mode, their ratio
(goal: within 3%, i.e. >= 0.97), and the swarm's start-up time (the secure demo adds an authorizer,
admission with a preflight and a dial-back per node). `--heartbeat 1 5` repeats the comparison at
the demo's 1 s DHT announce interval and at `join`'s default 5 s: the checks on the data path cost
the same at both, the signed DHT control plane costs in proportion to its request rate, and on
one machine every process shares the same cores. Writes bench/results/auth_cost_<preset>.md.

    python bench/auth_cost.py --config tiny --steps 100 --repeats 3 --heartbeat 1 5
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


def demo(run: list[str], summary: Path, secure: bool) -> tuple[dict, float]:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "agora.node", "--log-level", "WARNING", "demo", *run,
                    *([] if secure else ["--insecure"]), "--summary-json", str(summary)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(summary.read_text()), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    parser.add_argument("--heartbeat", type=float, nargs="+", default=[1.0],
                        help="workers' DHT announce intervals to compare (the demo's 1 s, join's 5 s)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    run = ["--config", args.config, "--stages", str(args.stages), "--steps", str(args.steps), "--seed",
           str(args.seed), "--replicas", str(args.replicas)]
    work = Path(tempfile.mkdtemp(prefix="agora-bench-auth-"))
    table = [
        f"# Cost of admission and trust: {args.config}, {args.stages} stages x {args.replicas} replicas, "
        f"{args.steps} steps, seed {args.seed}, {args.repeats} runs of each mode alternating", "",
        f"Machine: {platform.machine()}, {platform.system()}, Python {platform.python_version()}, "
        f"{os.cpu_count()} cores shared by every process of the swarm; loopback.", "",
        "| heartbeat | mode | tokens/s (each run) | mean tokens/s | / insecure | wall s (start to summary) "
        "| held-out loss |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for heartbeat in args.heartbeat:
        results: dict[str, list[tuple[dict, float]]] = {"secure": [], "insecure": []}
        flags = [*run, "--heartbeat", str(heartbeat)]
        for repeat in range(args.repeats):
            for mode in ("secure", "insecure"):
                summary, wall = demo(flags, work / f"{mode}-{heartbeat}-{repeat}.json", mode == "secure")
                if summary["outcome"] != "completed" or summary["steps"] != args.steps:
                    raise SystemExit(f"{mode} run {repeat} did not complete: {summary['outcome']}, "
                                     f"{summary['steps']} steps")
                results[mode].append((summary, wall))
                print(f"heartbeat {heartbeat:g} s, {mode} run {repeat}: {summary['tokens_per_s']:,.0f} tokens/s, "
                      f"wall {wall:.1f} s", flush=True)
        rate = {mode: statistics.mean(s["tokens_per_s"] for s, _ in results[mode]) for mode in results}
        for mode in ("secure", "insecure"):
            each = ", ".join(f"{s['tokens_per_s']:,.0f}" for s, _ in results[mode])
            wall = statistics.mean(w for _, w in results[mode])
            loss = statistics.mean(s["heldout_loss"] for s, _ in results[mode])
            table.append(f"| {heartbeat:g} s | {mode} | {each} | {rate[mode]:,.0f} | "
                         f"{rate[mode] / rate['insecure']:.3f} | {wall:.1f} | {loss:.4f} |")
    table += ["", "secure: an authorizer, admission with preflight and dial-back, mutual TLS with a per-call "
                  "credential check on every gRPC call, a token authorizer and signed records on every DHT "
                  "request, credentialed averaging groups. insecure: `demo --insecure` (the run fingerprint "
                  "is still checked on every call). heartbeat: seconds between each worker's DHT announces."]
    text = "\n".join(table) + "\n"
    print(text)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"auth_cost_{args.config}.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
