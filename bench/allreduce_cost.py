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

Three more inputs of the simulator come from the same replicas, so that they are taken on the DHT the
averaging harness runs (insecure, loopback, R peers) rather than on dht_scale's admitted swarm: the
weight-0 rounds' CPU per replica (hivemind's matchmaking: its declaration, its read of the declared
averagers, the join requests and the refusals that end the round); what one of the averaging
loop's own DHT operations costs the host: each replica, in a thread of its own, stores its round
record and reads the stage's round records and workers' records (the keys of R entries the loop
probes), one operation every `DHT_OP_PACE_S` as the loop makes them, the host's CPU less idle over
the operations made; and that idle rate per replica, what its processes burn with nothing to do.

    python -m agora.bench.allreduce_cost [--replicas 2 4 8 16] [--rounds 20] [--fit-up-to 4]

Writes bench/results/allreduce_cost.json and .md (the simulator's validation reads the json). About
8 minutes on 2 cores, most of it R = 16; no namespaces.
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

from agora.node.host_cpu import tree_usage
from agora.bench.simulate_scale_validation import tiny_middle_stage_bytes
from agora.dht.averaging import RoundResult, SliceAverager, estimated_bytes
from agora.dht.keys import rounds_key
from agora.dht.records import RoundRecord, WorkerRecord
from agora.dht.robust import RobustAggregation
from agora.dht.swarm import SwarmDHT
from agora.node.averaging.sparta import max_round_weight
from agora.pipeline.config import PRESETS
from agora.pipeline.fingerprint import run_fingerprint

__all__ = ["Cost", "fit", "measure", "main"]

RESULTS = Path(__file__).resolve().parent / "results"
SMALL_VALUES = 1024  # 4 KiB: one part per reducer, the round's fixed costs
IDLE_S = 10.0  # after a second for the warm-up round's tail
PAUSE_S = 0.2  # between rounds, as the replicas' results are read back
BLOCK = 5  # rounds of one weight between two readings of the host's CPU
DHT_OP_REPEATS = 8  # each replica's store and two reads, this many times
# One operation a replica this often, the replicas' turns spread over it: about the pace of the averaging
# loop's probes, closes and beats (a replica's CPU per operation is higher at that pace than flat out).
DHT_OP_PACE_S = 0.75
RUN_ID = "allreduce-cost"


@dataclasses.dataclass
class Cost:
    """One (R, vector) run: the host's CPU per round (its processes, less idle) with every weight 1
    and with every weight 0 (rounds alternated), the round's times with weight 1, and the CPU of one
    DHT operation on the same replicas."""

    replicas: int
    vector_bytes: int
    rounds: int
    committed: int
    cpu_s_per_round: float
    cpu_s_per_round_no_allreduce: float
    idle_cpu_s_per_s: float
    formation_p50_s: float
    duration_p50_s: float
    dht_op_cpu_ms: float = float("nan")

    @property
    def matchmaking_cpu_ms(self) -> float:
        """One replica's CPU in a round without its all-reduce, ms."""
        return self.cpu_s_per_round_no_allreduce / self.replicas * 1000.0

    @property
    def idle_cpu_ms_per_s(self) -> float:
        """What one replica's processes burn a second, idle, ms."""
        return self.idle_cpu_s_per_s / self.replicas * 1000.0

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


def _rounds(averagers: list[SliceAverager], first: int, rounds: int, values: int, idle: float
            ) -> tuple[float, float, list[RoundResult]]:
    """The host's CPU per round (less `idle` per second) with every weight 1 and with every weight 0,
    over `rounds` of each, in blocks of `BLOCK` alternated (A B A B) so that a drift in what else runs
    on the host falls on both; and the weight-1 rounds' results. (A block, not a round: each reading
    of the CPU walks /proc, which costs this process CPU too.)"""
    cpu = {1.0: 0.0, 0.0: 0.0}
    results: list[RoundResult] = []
    number = first
    for block in range(2 * -(-rounds // BLOCK)):
        weight = 1.0 if block % 2 == 0 else 0.0
        count = min(BLOCK, rounds - block // 2 * BLOCK)
        cpu0, began = tree_usage(os.getpid())[0], time.monotonic()
        for _ in range(count):
            outcome = _round(averagers, number, values, weight)
            number += 1
            time.sleep(PAUSE_S)
            if weight:
                results += outcome
        cpu[weight] += tree_usage(os.getpid())[0] - cpu0 - idle * (time.monotonic() - began)
    return cpu[1.0] / rounds, cpu[0.0] / rounds, results


def _dht_ops(dhts: list[SwarmDHT], repeats: int, idle: float) -> float:
    """The host's CPU per DHT operation, ms: every replica stores its round record and reads the
    stage's round records and its workers' records, `repeats` times, one operation every
    `DHT_OP_PACE_S` (after one worker record each, so both keys hold R entries)."""
    config = _config()
    fingerprint = run_fingerprint(config).text()
    key = rounds_key(RUN_ID, 1, config.sync.method)
    for dht in dhts:
        dht.announce_worker(WorkerRecord(peer_id=dht.peer_id, run_id=RUN_ID, endpoint="127.0.0.1:9", stage=1,
                                         n_stages=3, throughput=1.0, queue_depth=0, step=0, phase="member",
                                         version="bench", updated_at=0.0, fingerprint=fingerprint), ttl=600.0)

    def run(dht: SwarmDHT, turn: float) -> None:
        operations = [op for number in range(repeats) for op in (
            lambda number=number: dht.store(key, RoundRecord(peer_id=dht.peer_id, run_id=RUN_ID, stage=1, round=number,
                                                             started_at=dht.clock()), 60.0,
                                            subkey=dht.subkey_of(dht.peer_id)),
            lambda: dht.owned_entries(key, RoundRecord),
            lambda: dht.live_workers(RUN_ID, 1))]
        for index, operation in enumerate(operations):
            time.sleep(max(0.0, began + turn + index * DHT_OP_PACE_S - time.monotonic()))
            operation()

    cpu0, began = tree_usage(os.getpid())[0], time.monotonic()
    threads = [threading.Thread(target=run, args=(dht, i / len(dhts) * DHT_OP_PACE_S)) for i, dht in enumerate(dhts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu = tree_usage(os.getpid())[0] - cpu0 - idle * (time.monotonic() - began)
    return cpu / (3 * repeats * len(dhts)) * 1000.0


def measure(replicas: int, values: int, rounds: int) -> Cost:
    """With weight 0 everywhere the group forms and every member refuses to run its all-reduce
    (dht/averaging.py's `_refuse`): the same round less the all-reduce."""
    dhts, averagers = _start(replicas, values)
    try:
        _round(averagers, 1, values, 1.0)  # connections opened, first-use costs paid
        time.sleep(1.0)
        cpu0 = tree_usage(os.getpid())[0]
        time.sleep(IDLE_S)
        idle = (tree_usage(os.getpid())[0] - cpu0) / IDLE_S
        with_allreduce, without, results = _rounds(averagers, 2, rounds, values, idle)
        dht_op = _dht_ops(dhts, DHT_OP_REPEATS, idle)
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
    formed = [r.formation_s for r in results if r.formation_s is not None]
    return Cost(replicas, 4 * values, rounds, sum(r.outcome == "committed" for r in results), with_allreduce,
                without, idle, statistics.median(formed) if formed else float("nan"),
                statistics.median(r.duration_s for r in results), dht_op)


def fit(costs: list[Cost]) -> tuple[float, float]:
    """(CPU s per peer a replica exchanges with, CPU s per byte it sends): least squares of the host's
    all-reduce CPU per round = R (R - 1) a + R sent b, sent being `estimated_bytes` of one replica,
    neither below 0 (a cost; where the free fit makes one negative, the other is fitted alone)."""
    rows = [(c.replicas * (c.replicas - 1), c.replicas * c.sent_bytes, c.allreduce_cpu_s) for c in costs]
    sxx = sum(x * x for x, _, _ in rows)
    sxy = sum(x * y for x, y, _ in rows)
    syy = sum(y * y for _, y, _ in rows)
    sxz = sum(x * z for x, _, z in rows)
    syz = sum(y * z for _, y, z in rows)
    det = sxx * syy - sxy * sxy
    per_peer, per_byte = (sxz * syy - syz * sxy) / det, (syz * sxx - sxz * sxy) / det
    if per_peer >= 0 and per_byte >= 0:
        return per_peer, per_byte
    alone = [(max(0.0, sxz / sxx), 0.0), (0.0, max(0.0, syz / syy))]
    return min(alone, key=lambda ab: sum((z - ab[0] * x - ab[1] * y) ** 2 for x, y, z in rows))


def at_replicas(costs: list[Cost], figure: str) -> list[list[float]]:
    """[R, the figure's mean over that R's runs] for every R measured, R increasing (a simulator table)."""
    by_r: dict[int, list[float]] = {}
    for cost in costs:
        by_r.setdefault(cost.replicas, []).append(getattr(cost, figure))
    return [[float(r), statistics.fmean(values)] for r, values in sorted(by_r.items())]


def report(costs: list[Cost], per_peer: float, per_byte: float, command: str, fit_up_to: int,
           load_start: float) -> str:
    lines = ["# An all-reduce's CPU (bench/allreduce_cost.py)", "",
             f"`{command}` on {time.strftime('%Y-%m-%d %H:%M')}; {platform.node()}, {os.cpu_count()} cores, "
             f"1-minute load {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (its own "
             "replicas: three processes each on the host's cores). R replicas (SwarmDHT on loopback, insecure; "
             "SliceAverager with tiny's sync settings), every round started by all at once with the group "
             "size as target. CPU: this process and its children, less their idle rate; with weight 0 the "
             "group forms and no all-reduce runs.", "",
             "| R | vector bytes | sent / replica | rounds | committed | host CPU s / round | without all-reduce | "
             "all-reduce | formation p50 s | round p50 s | matchmaking CPU ms / replica | DHT op CPU ms | "
             "idle CPU ms / s / replica |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in costs:
        lines.append(f"| {c.replicas} | {c.vector_bytes:,} | {c.sent_bytes:,} | {c.rounds} | {c.committed} | "
                     f"{c.cpu_s_per_round:.4f} | {c.cpu_s_per_round_no_allreduce:.4f} | {c.allreduce_cpu_s:.4f} | "
                     f"{c.formation_p50_s:.4f} | {c.duration_p50_s:.4f} | {c.matchmaking_cpu_ms:.1f} | "
                     f"{c.dht_op_cpu_ms:.1f} | {c.idle_cpu_ms_per_s:.1f} |")
    lines += ["", f"Fitted over the rows of R <= {fit_up_to}: one replica's all-reduce costs {per_peer * 1000:.2f} "
              "ms of CPU per peer "
              f"it exchanges with and {per_byte * 1e9:.1f} ns per byte it sends (host CPU per round = "
              "R (R - 1) x the first + R x sent x the second).", "",
              "Matchmaking CPU: a replica's share of the host's CPU per round with weight 0 (hivemind's "
              "declaration, its read of the declared averagers, the join requests, the refusals). DHT op CPU: "
              "the host's CPU per operation while every replica stores its round record and reads the stage's "
              f"round and worker records, each key holding R entries, one operation every {DHT_OP_PACE_S:g} s. "
              f"Idle: what one replica's processes burn a second with nothing to do, over {IDLE_S:g} s."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "allreduce_cost.md")
    parser.add_argument("--fit-up-to", type=int, default=4, metavar="R",
                        help="fit the all-reduce's CPU over the runs of at most R replicas: above, a round's "
                             "matchmaking CPU varies by more than its all-reduce costs")
    args = parser.parse_args(argv)
    if any(r < 2 for r in args.replicas) or args.rounds < 1:
        parser.error("--replicas: each at least 2; --rounds at least 1")
    if not any(r <= args.fit_up_to for r in args.replicas):
        parser.error(f"--fit-up-to {args.fit_up_to}: no --replicas at or below it to fit over")
    load_start = os.getloadavg()[0]
    full_values = tiny_middle_stage_bytes() // 4
    costs = []
    for replicas in args.replicas:
        for values in (full_values, SMALL_VALUES):
            costs.append(measure(replicas, values, args.rounds))
            print(json.dumps(dataclasses.asdict(costs[-1])), flush=True)
    per_peer, per_byte = fit([c for c in costs if c.replicas <= args.fit_up_to])
    command = "python -m agora.bench.allreduce_cost " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.write_text(report(costs, per_peer, per_byte, command, args.fit_up_to, load_start))
    args.out.with_suffix(".json").write_text(json.dumps(
        {"costs": [dataclasses.asdict(c) for c in costs], "cpu_s_per_peer": per_peer,
         "cpu_s_per_byte_sent": per_byte, "matchmaking_cpu_ms_at": at_replicas(costs, "matchmaking_cpu_ms"),
         "dht_op_cpu_ms_at": at_replicas(costs, "dht_op_cpu_ms"),
         "idle_cpu_ms_per_s_at": at_replicas(costs, "idle_cpu_ms_per_s")}, indent=1) + "\n")
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
