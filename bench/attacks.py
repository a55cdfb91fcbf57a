"""Hostile workers against the trainer's checks, over real gRPC: detection F1 over repeated runs.

tiny, three stages (head, body, tail), two replicas each: six StageWorkers on loopback and one
SwarmTrainer, no DHT (the harness of tests/integration/test_reply_verification.py), so every liar
has an honest twin on its stage. In each attacked run one replica (`s<stage>r1`) turns liar after
`--honest-steps` steps of its stage (tests/helpers/lying_workers.py): x10, x1e4, noise at the
frame's scale, sign-flipped gradients (a Backward's input gradient negated), zeros, a constant,
stale (the previous microbatch's frame), a small persistent bias, on-off (x10 for `--period`
replies, honest for as many) and late (x10 after `--late-steps` honest steps). A head or body lies
in its Forward outputs (sign-grad: its Backward's input gradient); a tail, whose output is a
loss, lies in the input gradient it sends back. A head's Backward sends nothing upstream, so
sign-grad has no head row.

Per behaviour and position, over `--runs` seeds: the detection F1 (a true positive: the liar
caught; a false positive: any honest worker caught; caught = flagged by the verifier, refused by
the trainer's scale bound, or blamed for a refusal downstream), the median steps from the first
lie to the catch, whom the trainer caught and how, the held-out loss against the clean run of the
same seed, and (`--unguarded`, the first seed) the held-out loss with the verifier off, which
says whether the lie moves the loss by more than 1% at all (the F1 goal applies only then).
Clean runs of every seed count toward the false positives; with `--churn` a clean run also loses
a body replica half-way. The figures are for one machine's load: os.getloadavg() is recorded at
the start and the end. Flags are argparse's (as the other bench scripts'): a bench's knobs are not
settings of the node.

Writes bench/results/attacks_tiny.md and attacks_tiny.json (bench/attack_report.py renders both,
and RESULTS.md's detection row reads the JSON).

    python bench/attacks.py --runs 3 --unguarded --churn        # the whole suite (about 15 min, 2 cores)
    python bench/attacks.py --quick                             # x1e4 at the head, sign-grad at the body
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from agora.bench.attack_report import render_markdown, score

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
from attack_swarm import ATTACKS, POSITIONS, Plan, run_plan  # noqa: E402 - the tests' own swarm and liars
from lying_workers import LieSchedule  # noqa: E402


def _plans(args) -> tuple[list[Plan], list[Plan]]:
    """The clean runs and the attacked ones, in the order they run."""
    seeds = [args.seed + run for run in range(args.runs)]
    clean = [Plan(seed, args.steps) for seed in seeds]
    clean += [Plan(seed, args.steps, churn=True) for seed in seeds] if args.churn else []
    attacked = []
    for name in args.behaviours:
        attack = ATTACKS[name]
        steps = args.late_steps + args.lie_steps if attack.late else args.steps
        schedule = LieSchedule(honest_steps=args.late_steps if attack.late else args.honest_steps, period=attack.period)
        for position in args.positions:
            if attack.frame_at(position) is None:
                continue
            attacked += [Plan(seed, steps, True, name, position, schedule) for seed in seeds]
            if args.unguarded:
                attacked.append(Plan(seeds[0], steps, False, name, position, schedule))
    return clean, attacked


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--behaviours", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--position", dest="positions", nargs="+", default=["all"], choices=[*POSITIONS, "all"],
                        help="where the liar sits (all: head, body and tail)")
    parser.add_argument("--runs", type=int, default=3, help="seeds per behaviour and position (and clean runs)")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--honest-steps", type=int, default=24,
                        help="steps before a liar lies (the verifier's spread is wide while values still move fast)")
    parser.add_argument("--lie-steps", type=int, default=16, help="steps of lying a late attacker gets")
    parser.add_argument("--steps", type=int, default=40, help="steps of a clean or attacked run")
    parser.add_argument("--late-steps", type=int, default=100, help="honest steps before the late attacker lies")
    parser.add_argument("--unguarded", action="store_true", help="also run each attack once with the verifier off")
    parser.add_argument("--churn", action="store_true", help="also run each clean seed losing a body replica half-way")
    parser.add_argument("--spot-share", type=float, default=None,
                        help="the trainer's spot_check_share (where the trainer has spot checks)")
    parser.add_argument("--quick", action="store_true",
                        help="one seed, 24 steps: x1e4 at the head and sign-grad at the body, to show it works")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "attacks_tiny.md"))
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.quick:
        args.runs, args.steps, args.honest_steps, args.behaviours = 1, 24, 12, ["x1e4", "sign-grad"]
        args.positions = ["head", "body"]
    if "all" in args.positions:
        args.positions = list(POSITIONS)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)  # the progress lines below say what each run caught
    load_start, started = os.getloadavg()[0], time.monotonic()
    clean_plans, attacked_plans = _plans(args)
    runs, total = [], len(clean_plans) + len(attacked_plans)
    for plan in clean_plans + attacked_plans:
        result = asyncio.run(run_plan(plan, args.spot_share))
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
