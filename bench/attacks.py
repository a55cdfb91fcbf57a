"""Hostile workers against the trainer's checks, over real gRPC: detection F1 over repeated runs.

tiny, three stages (head, body, tail), two replicas each: six StageWorkers on loopback and one
SwarmTrainer, no DHT (tests/helpers/attack_swarm.py), so every liar has an honest twin on its
stage; a stage's replicas are averaged exactly every 3 steps, as a real run averages them. In each attacked run one replica (`s<stage>r1`) turns liar after `--honest-steps` steps
of its stage (tests/helpers/lying_workers.py): x10, x1e4, noise at the frame's scale,
sign-flipped gradients (a Backward's input gradient negated), zeros, a constant, stale (the
previous microbatch's frame), a small persistent bias (5% of the frame's RMS), on-off (x10 for
4 replies, honest for 4) and late (x10 after `--late-steps` honest steps). A head or body lies
in its Forward outputs (sign-grad: in its Backward's input gradient); a tail, whose output is a
loss, lies in the input gradient it sends back. A head's Backward sends nothing upstream, so
sign-grad has no head row.

Per behaviour and position, over `--runs` seeds: the detection F1 (a true positive: the liar
caught; a false positive: any honest worker caught; caught = flagged by the verifier, refused by
the trainer's scale bound, or blamed for a refusal downstream), the median steps from the first
lie to the catch, whom the trainer caught and how, the held-out loss against the clean run of the
same seed and length, and (`--unguarded N`, the first N seeds) the held-out loss with the
verifier, self and spot checks off (the scale bound stays), which says whether the lie moves the loss by more than 1%
at all (the F1 goal applies only then). Clean runs of every seed count toward the false
positives; with `--churn` each seed has one more clean run that loses a body replica half-way
while `--load` CPU-bound processes run beside it. The machine's 1-minute load is recorded at the
start and the end. Flags are argparse's, as the other bench scripts': a bench's knobs are not
settings of the node.

Writes bench/results/attacks_tiny.md and attacks_tiny.json (bench/attack_report.py renders both;
RESULTS.md's row 9 reads the JSON).

    python bench/attacks.py --runs 3 --unguarded 1 --churn --load 2   # the whole suite (about 15 min, 2 cores)
    python bench/attacks.py --quick     # x1e4 at the head and body, sign-grad at the body: shows it works
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from agora.bench.attack_report import render_markdown, score

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
from attack_swarm import ATTACKS, POSITIONS, Plan, run_plan  # noqa: E402 - the tests' own swarm and liars
from lying_workers import LieSchedule  # noqa: E402


@contextmanager
def _cpu_load(processes: int):
    """`processes` busy loops in child processes for the block's duration (each reaped after)."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def _plans(args) -> tuple[list[Plan], list[Plan]]:
    """The clean runs and the attacked ones, in the order they run."""
    seeds = [args.seed + run for run in range(args.runs)]
    steps, late_steps = args.honest_steps + args.lie_steps, args.late_steps + args.lie_steps
    clean = [Plan(seed, steps) for seed in seeds]
    clean += [Plan(seed, late_steps) for seed in seeds if any(ATTACKS[name].late for name in args.behaviours)]
    clean += [Plan(seed, steps, churn=True) for seed in seeds] if args.churn else []
    attacked = []
    for name in args.behaviours:
        attack = ATTACKS[name]
        steps = late_steps if attack.late else args.honest_steps + args.lie_steps
        schedule = LieSchedule(honest_steps=args.late_steps if attack.late else args.honest_steps, period=attack.period)
        for position in args.positions:
            if attack.frame_at(position) is None:
                continue
            attacked += [Plan(seed, steps, True, name, position, schedule) for seed in seeds]
            attacked += [Plan(seed, steps, False, name, position, schedule) for seed in seeds[:args.unguarded]]
    return clean, attacked


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--behaviours", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--position", dest="positions", nargs="+", default=["all"], choices=[*POSITIONS, "all"],
                        help="where the liar sits (all: head, body and tail)")
    parser.add_argument("--runs", type=int, default=3, help="seeds per behaviour and position (and clean runs)")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--honest-steps", type=int, default=20,
                        help="steps before a liar lies (the verifier's spread is wide while values still move fast)")
    parser.add_argument("--lie-steps", type=int, default=16, help="steps of a run after the honest ones")
    parser.add_argument("--late-steps", type=int, default=100, help="honest steps before the late attacker lies")
    parser.add_argument("--unguarded", type=int, default=0, metavar="N",
                        help="also run each attack with the verifier, self and spot checks off, on the first N seeds "
                        "(routes differ from run to run: held-out losses of one seed wander by about 1%%)")
    parser.add_argument("--churn", action="store_true", help="also run each clean seed losing a body replica half-way")
    parser.add_argument("--load", type=int, default=0, help="CPU-bound processes running beside the churned clean runs")
    parser.add_argument("--spot-share", type=float, default=None,
                        help="the trainer's spot_check_share (where the trainer has spot checks)")
    parser.add_argument("--gradient-share", type=float, default=None,
                        help="the trainer's gradient_check_share (default: the trainer's own; 0: off, the verifier "
                        "alone)")
    parser.add_argument("--quick", action="store_true",
                        help="one seed, 12 honest steps and 12 more: x1e4 at the head and body, sign-grad at the body, "
                        "to show it works")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "attacks_tiny.md"))
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.quick:
        args.runs, args.honest_steps, args.lie_steps, args.behaviours = 1, 12, 12, ["x1e4", "sign-grad"]
        args.positions = ["head", "body"]
    if "all" in args.positions:
        args.positions = list(POSITIONS)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)  # the progress lines below say what each run caught
    load_start, started = os.getloadavg()[0], time.monotonic()
    clean_plans, attacked_plans = _plans(args)
    runs, total = [], len(clean_plans) + len(attacked_plans)
    for plan in clean_plans + attacked_plans:
        with _cpu_load(args.load if plan.churn else 0):
            # Unguarded: every check of what workers compute off (the scale bound stays), so the
            # run says what the lie does to the loss when nothing stops it.
            shares = (args.spot_share, args.gradient_share) if plan.verify else (0.0, 0.0)
            result = asyncio.run(run_plan(plan, *shares))
        runs.append(result)
        caught = ", ".join(f"{peer} ({c['how']})" for peer, c in result["caught"].items()) or "-"
        print(f"[{len(runs)}/{total} {time.monotonic() - started:.0f}s] {plan.attack or 'clean'}"
              f"{'' if plan.position is None else ' at ' + plan.position} seed {plan.seed}"
              f"{'' if plan.verify else ' unguarded'}{' churn' if plan.churn else ''}: caught {caught}, "
              f"held-out {result['heldout']:.4f}", flush=True)
    results = {"command": "python bench/attacks.py " + shlex.join(sys.argv[1:]),
               "machine": f"{platform.node()}, {os.cpu_count()} cores", "load": [load_start, os.getloadavg()[0]],
               "seconds": time.monotonic() - started, "settings": {key: value for key, value in vars(args).items()
                                                                   if key not in ("out", "quick")},
               "runs": runs}
    results["scores"] = score(runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.write_text(render_markdown(results))
    print(out.read_text(), flush=True)


if __name__ == "__main__":
    main()
