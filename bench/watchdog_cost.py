"""What the worker's watchdog costs a swarm: tokens/s of the same `agora-node demo` with the watchdog
on (its defaults) and off (`--no-watchdog`), side by side in one run.

    python bench/watchdog_cost.py [--steps 120] [--rounds 3] [--out bench/results/watchdog_cost_tiny.md]
    python bench/watchdog_cost.py --quick    # one round of 6 steps: shows it runs, writes no table

Each run is a whole demo as `swarm_vs_local.demo` starts it (tiny in two stages, one worker per
stage, one trainer, the authorizer and the bootstrap, every one its own process; seed 0; no
monitor, which would poll both alike): the workers run `join`, whose daemon is where the watchdog
samples the worker (node/worker/watchdog.py: a no-op job on the compute thread, /proc, the
accelerator's memory, the averaging and renewal counters, the ban list, every `check_s`). The
variants alternate within a round, the order swapped every round, so the drift of a shared, busy
machine falls on both alike. The table gives each variant's median tokens/s over rounds (the
trainer's, from the demo's summary), its ratio to the watchdog off, each variant's spread over the
rounds ((max - min) / median) and each round's ratio, and the 1-minute load before and after.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from pathlib import Path

from agora.bench.swarm_vs_local import demo, run_flags

__all__ = ["VARIANTS", "measure", "table", "main"]

# The variants: label -> the demo's flags for its workers.
VARIANTS = {"off": ["--no-watchdog"], "on (defaults)": []}
CONFIG, STAGES, SEED = "tiny", 2, 0


def measure(steps: int, rounds: int, work: Path) -> dict[str, list[float]]:
    """Each variant's tokens/s per round, the variants in turn (order swapped every round)."""
    figures: dict[str, list[float]] = {label: [] for label in VARIANTS}
    labels = list(VARIANTS)
    for round_index in range(rounds):
        for label in labels if round_index % 2 == 0 else labels[::-1]:
            name = f"{label.split()[0]}{round_index}"
            summary = demo(run_flags(CONFIG, STAGES, steps, SEED), ["--no-monitor", *VARIANTS[label]], work, name)
            figures[label].append(summary["tokens_per_s"])
        print(f"round {round_index}: " + ", ".join(f"{label} {figures[label][-1]:.0f}" for label in labels) +
              " tokens/s", flush=True)
    return figures


def table(figures: dict[str, list[float]], steps: int, rounds: int, load: tuple[float, float]) -> list[str]:
    off = statistics.median(figures["off"])
    per_round = [on / base for on, base in zip(figures["on (defaults)"], figures["off"])]
    lines = [f"# Watchdog cost ({CONFIG}, {STAGES} stages, one worker per stage, one trainer, {steps} steps, "
             f"seed {SEED}, {platform.node()}, {os.cpu_count()} cores)", "",
             f"`python bench/watchdog_cost.py --steps {steps} --rounds {rounds}`: a fresh `agora-node demo` per run "
             f"(admitted, no monitor), the workers' watchdog on (its defaults) and off (`--no-watchdog`), in turn, the "
             f"order swapped every round; the trainer's tokens/s. 1-minute load {load[0]:.2f} at the start, "
             f"{load[1]:.2f} at the end.", "",
             "| watchdog | tokens/s (median of rounds) | / off | spread of the rounds | each round |",
             "|---|---:|---:|---:|---|"]
    for label, values in figures.items():
        median = statistics.median(values)
        lines.append(f"| {label} | {median:.0f} | {median / off:.3f} | {(max(values) - min(values)) / median:.1%} | "
                     f"{', '.join(f'{value:.0f}' for value in values)} |")
    lines += ["", f"On / off per round: {', '.join(f'{ratio:.3f}' for ratio in per_round)}.", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="global batches each demo trains")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both variants")
    parser.add_argument("--quick", action="store_true", help="one round of 6 steps; no table written unless --out")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 6, 1
    load_start = os.getloadavg()[0]
    figures = measure(args.steps, args.rounds, Path(tempfile.mkdtemp(prefix="agora-bench-watchdog-")))
    text = "\n".join(table(figures, args.steps, args.rounds, (load_start, os.getloadavg()[0])))
    print(text)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"watchdog_cost_{CONFIG}.md"
    if not args.quick or args.out:
        out.write_text(text)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
