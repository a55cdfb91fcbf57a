"""What the trainer's verifier stops, over real gRPC: one head replica lying, against a clean run.

tiny, two stages: two head replicas and one tail, StageWorkers on loopback and one SwarmTrainer
(the harness of tests/integration/test_reply_verification.py). One head replica answers honestly for
`--honest` Forwards, then lies in one way (x10, its output's sign flipped, noise at the output's
scale, a constant, its previous output replayed). Per behaviour: whether it was flagged (and who
was), after how many lies, the microbatches rerouted, and the held-out loss against the clean
run's (same seed, same data). With `--unguarded` each behaviour also runs without the verifier,
to show what the lie costs when nothing stops it.

Writes bench/results/attacks_tiny.md.

    python bench/attacks.py --steps 80 --honest 80 --unguarded
    python bench/attacks.py --quick          # x10 and a constant, 50 steps: shows it works
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
from dataclasses import replace
from pathlib import Path

import torch

from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.trainer import SwarmTrainer, TrainerOptions
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"s0r0": 0, "s0r1": 0, "s1r0": 1}
LIAR = "s0r1"


def _behaviours() -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    from lying_workers import rewritten_output  # noqa: E402 - the tests' own liars

    def noise(output, previous):
        return output + torch.randn_like(output) * output.square().mean().sqrt()

    return {
        "x10": rewritten_output(lambda output, previous: output * 10),
        "sign": rewritten_output(lambda output, previous: -output),
        "noise": rewritten_output(noise),
        "constant": rewritten_output(lambda output, previous: output.mean(dim=(0, 1), keepdim=True).expand_as(output)),
        "stale": rewritten_output(lambda output, previous: output if previous is None else previous),
    }


def _config(seed: int):
    config = PRESETS["tiny"].with_stages(2)
    return replace(config, seed=seed, train=replace(config.train, batch_size=8, microbatches=4, seq_len=64,
                                                    eval_every=0, eval_batches=4))


async def run(config, data, steps: int, honest: int, rewrite, verify: bool) -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    from lying_workers import rewrite_replies  # noqa: E402

    workers = {peer: StageWorker(config, stage, run_id="bench", options=WorkerOptions())
               for peer, stage in STAGES.items()}
    served = [0]
    try:
        for worker in workers.values():
            await worker.start()
        if rewrite is not None:
            forward = workers[LIAR].compute.forward

            def counted(request, **caller):
                served[0] += 1
                return forward(request, **caller)
            workers[LIAR].compute.forward = counted
            rewrite_replies(workers[LIAR], rewrite, after=honest)
        views = [WorkerView(peer, w.address, STAGES[peer], announced_samples_per_s=100.0) for peer, w in workers.items()]
        options = TrainerOptions(run_id="bench", max_in_flight=2, verify_replies=verify)
        async with SwarmTrainer(config, data, StaticDiscovery(views), options) as trainer:
            await trainer.run(steps)
            held_out = await trainer.evaluate(data.heldout_batches(config.train.eval_batches, config.train.batch_size))
        summary = trainer.verification_summary()
        peak = max((value for key, value in summary.get("peak_cusum", {}).items() if key.endswith(f"/{LIAR}")),
                   default=0.0)
        return {"flagged": sorted(trainer.stats.flagged_by_peer), "reroutes": trainer.stats.reroutes, "peak": peak,
                "lies": max(0, served[0] - honest) if rewrite is not None else 0, "heldout": held_out}
    finally:
        await asyncio.gather(*(w.stop(0) for w in workers.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--honest", type=int, default=80, help="the liar's honest Forwards before it lies (two a "
                        "step: before the stage's values settle, a tenfold lie is within their drift)")
    parser.add_argument("--behaviours", nargs="+", default=["x10", "sign", "noise", "constant", "stale"])
    parser.add_argument("--unguarded", action="store_true", help="also run each behaviour without the verifier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="x10 and a constant, 50 steps, liar after 60 Forwards")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "attacks_tiny.md"))
    args = parser.parse_args()
    if args.quick:
        args.steps, args.honest, args.behaviours = 50, 60, ["x10", "constant"]
    torch.set_num_threads(1)
    config = _config(args.seed)
    data = build_data(config)
    behaviours = _behaviours()
    clean = asyncio.run(run(config, data, args.steps, args.honest, None, True))
    lines = [f"# One lying head replica against the verifier (tiny, 2 stages, head x2, {args.steps} steps, liar "
             f"after {args.honest} Forwards, seed {args.seed}, {platform.node()})", "",
             "| behaviour | verifier | flagged | lies | liar's peak CUSUM | reroutes | held-out loss | vs clean |",
             "|---|---|---|---|---|---|---|---|",
             f"| none (clean) | on | {', '.join(clean['flagged']) or '-'} | 0 | - | {clean['reroutes']} | "
             f"{clean['heldout']:.4f} | 1.000 |"]
    print(lines[-1], flush=True)
    for name in args.behaviours:
        for verify in (True, False) if args.unguarded else (True,):
            result = asyncio.run(run(config, data, args.steps, args.honest, behaviours[name], verify))
            lines.append(f"| {name} | {'on' if verify else 'off'} | {', '.join(result['flagged']) or '-'} | "
                         f"{result['lies']} | {result['peak']:.1f} | {result['reroutes']} | {result['heldout']:.4f} | "
                         f"{result['heldout'] / clean['heldout']:.3f} |")
            print(lines[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
