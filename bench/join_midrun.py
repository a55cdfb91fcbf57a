"""What the sync phases buy: a replica joining a stage mid-run, with and without them.

For each seed, the same `agora-node demo` run three times side by side (tiny, 2 stages, one replica
each, the same tokens and schedule; the run's own averaging cadence):
  - no joiner (the reference),
  - a new replica of stage 0 joining after `--join-at` global batches, through the sync phases
    (weight sync from the member, weight 0 for a rotation, optimizer sync, member),
  - the same joiner with `--no-sync-phases`: a member at once with its freshly initialised weights,
    routed and averaged at full weight (what joining was before the phases),
and reports each run's held-out loss and its ratio to the reference, the mean and the worst training
loss over the global batches after the joiner arrived, and the joiner's seconds from start to member.
Writes bench/results/join_midrun_<preset>.md.

    python bench/join_midrun.py --steps 300 --join-at 40 --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {"no joiner": [], "joiner, sync phases": ["join"], "joiner, no sync phases": ["join", "--no-sync-phases"]}
_ARRIVED = (re.compile(r"phase weight_sync \(the stage's members are at step (\d+)"),
            re.compile(r"global batch (\d+) reported at local step 0"))


def run(config: str, steps: int, seed: int, join_at: int, flags: list[str], workdir: Path) -> dict:
    extra = [flag for flag in flags if flag != "join"] + (["--join-at", str(join_at)] if "join" in flags else [])
    summary_path = workdir / "summary.json"
    subprocess.run([sys.executable, "-m", "agora.node", "demo", "--config", config, "--stages", "2", "--replicas", "1",
                    "--steps", str(steps), "--seed", str(seed), "--no-monitor", "--workdir", str(workdir / "work"),
                    "--summary-json", str(summary_path), "--log-json", str(workdir / "log.jsonl"), *extra],
                   check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(summary_path.read_text())
    losses = {line["step"]: line["loss"] for line in map(json.loads, (workdir / "log.jsonl").read_text().splitlines())}
    result = {"heldout": summary["heldout_loss"], "arrived": None, "after_mean": None, "after_max": None,
              "to_member_s": None}
    joiner = workdir / "work" / "worker-s0-r1.log"
    if joiner.exists():
        text = joiner.read_text()
        found = next((m for pattern in _ARRIVED for m in [pattern.search(text)] if m), None)
        arrived = int(found.group(1)) if found else None
        result["arrived"] = arrived
        after = [losses[s] for s in sorted(losses) if arrived is not None and s >= arrived][:60]
        if after:
            result["after_mean"], result["after_max"] = statistics.mean(after), max(after)
        history = summary.get("phases_by_worker", {}).get("worker-s0-r1", [])
        result["to_member_s"] = next((at for phase, at in history if phase == "member"), None)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--join-at", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for seed in args.seeds:
        for name, flags in VARIANTS.items():
            with tempfile.TemporaryDirectory(prefix="agora-join-bench-") as scratch:
                result = run(args.config, args.steps, seed, args.join_at, flags, Path(scratch))
            results[name].append(result)
            print(f"seed {seed} {name}: {result}", flush=True)
    reference = [r["heldout"] for r in results["no joiner"]]
    rows = []
    for name, runs in results.items():
        ratio = statistics.mean(r["heldout"] / ref for r, ref in zip(runs, reference))

        def mean(key):
            values = [r[key] for r in runs if r[key] is not None]
            return f"{statistics.mean(values):.3f}" if values else "-"

        rows.append(f"| {name} | {statistics.mean(r['heldout'] for r in runs):.4f} | {ratio:.3f} | {mean('after_mean')} "
                    f"| {mean('after_max')} | {mean('to_member_s')} |")
    table = "\n".join([
        f"# A replica joining mid-run ({args.config}, 2 stages, 1 replica each, {args.steps} global batches, a "
        f"joiner of stage 0 started after {args.join_at}; seeds {', '.join(map(str, args.seeds))}; means over seeds)",
        "",
        "`python bench/join_midrun.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "| run | held-out loss | / no joiner | mean loss, 60 batches after it arrived | worst of those "
        "| joiner's s to member |",
        "|---|---:|---:|---:|---:|---:|",
        *rows, ""])
    print(table)
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"join_midrun_{args.config}.md"
    out.write_text(table)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
