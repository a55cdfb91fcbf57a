"""What one averaging round's all-reduce costs the host in CPU, per byte a replica sends.

bench/averaging_scale.py measures a round's formation and duration with R replicas on one host;
the time between the two is the all-reduce, whose CPU (hivemind's butterfly through each replica's
averager process and p2pd, the robust reduction of dht/robust_allreduce.py) no harness measured.
The simulator needs it as an input, measured apart from the figures it predicts.

Here R replicas as bench/averaging_replica.py starts them (a `SwarmDHT` on loopback, insecure, and
a `SliceAverager` with tiny's sync settings and robust aggregation) average a vector together,
round after round, each round started by every replica at once with the group's size as its
matchmaking target (no window waited out). The CPU of this process and every child (DHT
processes, p2pd, averager processes) is read from /proc before and after the rounds, less what
they burn idle over as long. Done twice, with tiny's middle-stage vector and with a small one:
matchmaking and the round's fixed costs are the same in both, so the difference is the
all-reduce's CPU for the difference in bytes. The figure is CPU seconds per byte one replica sends
(`estimated_bytes`, which it receives as much of), summed over the host's processes and divided by
R: what each replica's all-reduce costs per byte of its sending.

    python -m agora.bench.allreduce_cost [--replicas 2 4] [--rounds 20]

Writes bench/results/allreduce_cost.json and .md. A few seconds per R; no namespaces.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from agora.bench.many_nodes import tree_usage
from agora.bench.simulate_scale_validation import tiny_middle_stage_bytes
from agora.dht.averaging import RoundResult, SliceAverager, estimated_bytes
from agora.dht.robust import RobustAggregation
from agora.dht.swarm import SwarmDHT
from agora.node.averaging.sparta import max_round_weight
from agora.pipeline.config import PRESETS

__all__ = ["Cost", "fit", "measure", "main"]

RESULTS = Path(__file__).resolve().parent / "results"
SMALL_VALUES = 1024  # 4 KiB: one part per reducer, the round's fixed costs
IDLE_S = 3.0
PAUSE_S = 0.2  # between rounds, as the replicas' results are read back


@dataclasses.dataclass
class Cost:
    """One (R, vector) run: the host's CPU per round (its processes, less idle) with every weight 1
    and with every weight 0, and the round's times with weight 1."""

    replicas: int
    vector_bytes: int
    rounds: int
    committed: int
    cpu_s_per_round: float
    cpu_s_per_round_no_allreduce: float
    idle_cpu_s_per_s: float
    formation_p50_s: float
    duration_p50_s: float

    @property
    def allreduce_cpu_s(self) -> float:
        return self.cpu_s_per_round - self.cpu_s_per_round_no_allreduce

    @property
    def sent_bytes(self) -> int:
        return estimated_bytes(self.vector_bytes, self.replicas)


def _config():
    return PRESETS["tiny"].with_stages(3)


def _start(replicas: int, values: int) -> tuple[list[SwarmDHT], list[SliceAverager]]:
    """R replicas as bench/averaging_replica.py starts each (its `_start_averager`, any size)."""
    config = _config()
    sync = config.sync
    robust = RobustAggregation(sync.aggregation, max_weight=max_round_weight(sync, config.train.batch_size))
    dhts, averagers = [], []
    for _ in range(replicas):
        dhts.append(SwarmDHT.start(initial_peers=dhts[0].visible_maddrs() if dhts else ()))
        averagers.append(SliceAverager.start(
            dhts[-1].hivemind_dht, prefix=f"cost{values}", size=values, matchmaking_s=sync.matchmaking_s,
            request_s=sync.request_s, sender_s=sync.sender_s, reducer_s=sync.reducer_s, round_s=sync.round_s,
            part_size_bytes=sync.part_size_bytes, robust=robust))
    return dhts, averagers


def _round(averagers: list[SliceAverager], number: int, values: int, weight: float) -> list[RoundResult]:
    results: list = [None] * len(averagers)

    def run(index: int) -> None:
        vector = torch.full((values,), float(index))
        results[index] = averagers[index].average(vector, round_number=number, weight=weight,
                                                  group_size=len(averagers))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(averagers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _rounds(averagers: list[SliceAverager], first: int, rounds: int, values: int, weight: float, idle: float
            ) -> tuple[float, list[RoundResult]]:
    """The host's CPU per round over `rounds` rounds (less `idle` per second), and their results."""
    cpu0, began, results = tree_usage(os.getpid())[0], time.monotonic(), []
    for number in range(first, first + rounds):
        results += _round(averagers, number, values, weight)
        time.sleep(PAUSE_S)
    wall = time.monotonic() - began
    return (tree_usage(os.getpid())[0] - cpu0 - idle * wall) / rounds, results


def measure(replicas: int, values: int, rounds: int) -> Cost:
    """With weight 0 everywhere the group forms and every member refuses to run its all-reduce
    (dht/averaging.py's `_refuse`): the same round less the all-reduce."""
    dhts, averagers = _start(replicas, values)
    try:
        _round(averagers, 1, values, 1.0)  # connections opened, first-use costs paid
        cpu0 = tree_usage(os.getpid())[0]
        time.sleep(IDLE_S)
        idle = (tree_usage(os.getpid())[0] - cpu0) / IDLE_S
        with_allreduce, results = _rounds(averagers, 2, rounds, values, 1.0, idle)
        without, _ = _rounds(averagers, 2 + rounds, rounds, values, 0.0, idle)
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
    formed = [r.formation_s for r in results if r.formation_s is not None]
    return Cost(replicas, 4 * values, rounds, sum(r.outcome == "committed" for r in results), with_allreduce,
                without, idle, statistics.median(formed) if formed else float("nan"),
                statistics.median(r.duration_s for r in results))


def fit(costs: list[Cost]) -> tuple[float, float]:
    """(CPU s per peer a replica exchanges with, CPU s per byte it sends): least squares of the host's
    all-reduce CPU per round = R (R - 1) a + R sent b, sent being `estimated_bytes` of one replica."""
    rows = [(c.replicas * (c.replicas - 1), c.replicas * c.sent_bytes, c.allreduce_cpu_s) for c in costs]
    sxx = sum(x * x for x, _, _ in rows)
    sxy = sum(x * y for x, y, _ in rows)
    syy = sum(y * y for _, y, _ in rows)
    sxz = sum(x * z for x, _, z in rows)
    syz = sum(y * z for _, y, z in rows)
    det = sxx * syy - sxy * sxy
    return (sxz * syy - syz * sxy) / det, (syz * sxx - sxz * sxy) / det


def report(costs: list[Cost], per_peer: float, per_byte: float, command: str) -> str:
    lines = ["# An all-reduce's CPU (bench/allreduce_cost.py)", "",
             f"`{command}` on {time.strftime('%Y-%m-%d %H:%M')}; {platform.node()}, {os.cpu_count()} cores, "
             f"1-minute load {os.getloadavg()[0]:.1f} at the end. R replicas (SwarmDHT on loopback, insecure; "
             "SliceAverager with tiny's sync settings), every round started by all at once with the group "
             "size as target. CPU: this process and its children, less their idle rate; with weight 0 the "
             "group forms and no all-reduce runs.", "",
             "| R | vector bytes | sent / replica | rounds | committed | host CPU s / round | without all-reduce | "
             "all-reduce | formation p50 s | round p50 s |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in costs:
        lines.append(f"| {c.replicas} | {c.vector_bytes:,} | {c.sent_bytes:,} | {c.rounds} | {c.committed} | "
                     f"{c.cpu_s_per_round:.4f} | {c.cpu_s_per_round_no_allreduce:.4f} | {c.allreduce_cpu_s:.4f} | "
                     f"{c.formation_p50_s:.4f} | {c.duration_p50_s:.4f} |")
    lines += ["", f"Fitted over the rows: one replica's all-reduce costs {per_peer * 1000:.2f} ms of CPU per peer "
              f"it exchanges with and {per_byte * 1e9:.1f} ns per byte it sends (host CPU per round = "
              "R (R - 1) x the first + R x sent x the second)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "allreduce_cost.md")
    args = parser.parse_args(argv)
    if any(r < 2 for r in args.replicas) or args.rounds < 1:
        parser.error("--replicas: each at least 2; --rounds at least 1")
    full_values = tiny_middle_stage_bytes() // 4
    costs = []
    for replicas in args.replicas:
        for values in (full_values, SMALL_VALUES):
            costs.append(measure(replicas, values, args.rounds))
            print(json.dumps(dataclasses.asdict(costs[-1])), flush=True)
    per_peer, per_byte = fit(costs)
    command = "python -m agora.bench.allreduce_cost " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.write_text(report(costs, per_peer, per_byte, command))
    args.out.with_suffix(".json").write_text(json.dumps(
        {"costs": [dataclasses.asdict(c) for c in costs], "cpu_s_per_peer": per_peer,
         "cpu_s_per_byte_sent": per_byte}, indent=1) + "\n")
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
