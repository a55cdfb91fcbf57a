"""The simulator against the many-node harnesses: a stage's rounds at R replicas, a newcomer at N peers.

bench/simulate_validation.py writes these tables beside rows 3 and 7; each predicted figure is set
beside the measured one, and the inputs are measured things other than the figure predicted.

Averaging (bench/results/averaging_scale.json, bench/averaging_scale.py): R replicas of one stage
on one 2-core host over loopback, stepping every 2 s, a round every 4 steps, a 3 s window, no
trainers. Inputs: the harness's pace and window (its settings), the averaged vector's bytes (tiny's
middle stage as node/averaging/sparta.py sizes it), loopback's measured round trip and rates (row 3's
lan), the host's 2 cores, and four CPU costs bench/allreduce_cost.py measured on R replicas of the
harness's own kind (an insecure SwarmDHT and a SliceAverager each, on this host; bench/results/
allreduce_cost.json, read between its R by network.py's `at_size`): what one of the averaging loop's
DHT operations costs the host (a store of a round record, reads of the stage's round and worker
records of R entries), what the rest of a replica's matchmaking costs (its share of the host's CPU
in rounds with every weight 0: hivemind's declaration, its read of the declared averagers, the join
requests), and the all-reduce's CPU per other member and per byte a member sends (the difference
between weight 1 and weight 0, fitted over R and two vector sizes), and what an idle replica's
processes burn a second (hivemind's and p2pd's upkeep). A round's matchmaking is what
node/averaging/loop.py's `run_round` does, each DHT operation its CPU on the shared cores and one
loopback round trip: the round's two announcers store their announcement beside it, and a replica
whose count of the live replicas is due reads it first; then hivemind's part, its CPU on the shared
cores and one round trip. The all-reduce after the group formed takes each member's CPU on the
shared cores. Between rounds each replica probes the round board on the loop's schedule, closes
the rounds it announced and beats every 5 s (the harness's heartbeat: a store, no ban list on an
insecure DHT), each operation's CPU on the shared cores, and burns the idle rate
(node/simulate/background.py). Each replica's start of each round is delayed by one
of the harness's measured start offsets (behind the round's first replica's start), drawn at random:
the replicas step together, and what sets their starts apart is the order in which the shared cores
serve their probes and steps, which the simulator's processor sharing does not give (its replicas
finish the same work together). dht_scale's CPU per operation is not the input: its
peers are admitted (signed records, a ban list, a CA), the harness's are not. Predicted: group
formation (each replica's start to its group's forming) and round duration, p50 and p95 over every
replica's rounds, as the harness takes them. Beside them, not counted: the host's CPU per round due,
as the harness read it from every replica's processes and as the simulated jobs add up, a check of
the CPU inputs taken whole.

Newcomer (bench/results/dht_scale.json, bench/dht_newcomer.py): one more worker of stage 0 joining
N admitted peers on agora-floor under the traffic model. Inputs: its measured "DHT joined" (the
process's DHT start through the bootstrap is not a DHT operation the simulator models), and the
latency of a read and a store of a stage's worker records at that N (dht_scale's p50 of the
`get workers` and `store workers` families, under the same traffic). Predicted: "donor found" (the
simulated newcomer's first reads, every stage's worker key and then the ban list's, each first opening
its connections, `DIAL_RTTS` round trips, since the newcomer has talked to none of the key's holders;
then `plan_donors`) and "visible to others": its first record at a
holder (node/simulate/network.py's `first_holder_s`: a read's lookup and half a round trip, as
hivemind's store reaches the key's holders at once after its lookup), then the harness's monitor,
which reads the stage and sleeps 0.25 s in turn: the first read to start after the holder has the
record starts half such a cycle later on average, and sees it when it ends, one read later (a read
takes its view as it starts: its first hop asks the peers nearest the key that it knows).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from agora.bench.averaging_scale import percentile
from agora.node.averaging.sparta import SlicePartition, averaged_vector_size, stage_parameter_numels
from agora.node.simulate.network import at_size, dht_cpu_s
from agora.node.simulate.scenario import scenario_from_dict
from agora.node.simulate.swarm import SimSwarm
from agora.pipeline.config import PRESETS

__all__ = ["HarnessCPU", "averaging_scenario", "newcomer_scenario", "validate_averaging",
           "validate_newcomers", "scale_sections"]

RESULTS = Path(__file__).resolve().parent / "results"
LAN = (0.06, 22279.9, 20906.8)  # row 3's lan: RTT ms, up and down Mbit/s
AGORA_FLOOR = (80.68, 192.3, 191.2)
HOST_CORES = 2
STEP_S, EVERY_STEPS, WINDOW_S = 2.0, 4, 3.0  # bench/averaging_scale.py's defaults, the run's settings
# Besides the loop's own (simulated by the loop's rules: its announcers' store, the live count's read when
# due), none: hivemind's part of the matchmaking is its measured CPU.
MATCHMAKING_DHT_OPS = 0
HEARTBEAT_S = 5.0  # bench/averaging_replica.py's --heartbeat-s, which the harness leaves at its default
MONITOR_READ_EVERY_S = 0.25  # bench/dht_peer.py's WATCH_S
# The newcomer's first read (bench/dht_newcomer.py's `find_donor`) is two DHT reads one after the other:
# every stage's worker key at once, then, to leave out banned workers, the ban list's key
# (dht/swarm.py's `all_workers` and `refresh_bans`).
NEWCOMER_FIRST_READS = 2
# What a first request to a peer costs before it is sent, over libp2p on TCP (p2pd): the TCP handshake,
# the security protocol's negotiation, noise's handshake and the muxer's negotiation, a round trip each.
# A newcomer's first reads go to peers it has not talked to; the swarm's own reads, the `get workers`
# p50 given as input, go over open connections.
DIAL_RTTS = 4
NEWCOMER_AT_S = 10.0


def tiny_middle_stage_bytes() -> int:
    """The averaged vector of tiny's middle stage (of 3), as the harness's replicas size it."""
    config = PRESETS["tiny"].with_stages(3)
    buffer = SlicePartition(stage_parameter_numels(config.model, 1), config.sync.n_slices, config.seed).buffer_size
    return 4 * averaged_vector_size(config.sync, buffer)


@dataclass(frozen=True)
class HarnessCPU:
    """What bench/allreduce_cost.py measured on the averaging harness's kind of replica: [R, ms] of one
    DHT operation and of a replica's matchmaking besides its DHT operations, and the all-reduce's
    (ms per other member, ns per byte sent)."""

    dht_op_ms_at: tuple[tuple[float, float], ...]
    matchmaking_ms_at: tuple[tuple[float, float], ...]
    allreduce: tuple[float, float]
    idle_ms_per_s_at: tuple[tuple[float, float], ...] = ()  # [R, ms a second] one idle replica burns

    @classmethod
    def read(cls, results: Path = RESULTS) -> "HarnessCPU":
        measured = json.loads((results / "allreduce_cost.json").read_text())
        return cls(tuple(map(tuple, measured["dht_op_cpu_ms_at"])),
                   tuple(map(tuple, measured["matchmaking_cpu_ms_at"])),
                   (measured["cpu_s_per_peer"] * 1000.0, measured["cpu_s_per_byte_sent"] * 1e9),
                   tuple(map(tuple, measured.get("idle_cpu_ms_per_s_at", ()))))


def averaging_scenario(replicas: int, rounds: int, cpu: HarnessCPU, vector_bytes: int,
                       start_offsets_s: tuple[float, ...] = ()) -> dict:
    rtt, up, down = LAN
    return {
        "run": {"seconds": (rounds + 0.5) * STEP_S * EVERY_STEPS, "stages": 1, "batch_s": STEP_S},
        "compute": {"ms": [1.0], "shared_cores": HOST_CORES},
        "links": [{"name": "lan", "up_mbit": up, "down_mbit": down, "rtt_ms": rtt}],
        "workers": {"replicas": replicas, "heartbeat_s": HEARTBEAT_S, "heartbeat_reads_bans": False,
                    "background_cpu_ms_per_s_at": [list(pair) for pair in cpu.idle_ms_per_s_at]},
        "dht": {"base_ms": rtt, "cpu_ms_at": [list(pair) for pair in cpu.dht_op_ms_at]},
        "averaging": {"method": "sparta", "every_steps": EVERY_STEPS, "fraction": 0.25, "vector_bytes": vector_bytes,
                      "matchmaking_dht_ops": MATCHMAKING_DHT_OPS, "matchmaking_s": WINDOW_S, "between_rounds": True,
                      "matchmaking_cpu_ms_at": [list(pair) for pair in cpu.matchmaking_ms_at],
                      "allreduce_cpu_ms_per_peer": cpu.allreduce[0], "allreduce_cpu_ns_per_byte": cpu.allreduce[1],
                      "start_offsets_s": list(start_offsets_s)},
    }


def _off(predicted: float, measured: float) -> tuple[str, float]:
    error = predicted / measured - 1
    return f"{error * 100:+.0f}%", abs(error)


def within(errors: dict[str, list[float]], target: float = 0.20) -> str:
    """Per figure: how many of its rows came within `target` of the measured one."""
    return "; ".join(f"{name} {sum(e <= target for e in values)} of {len(values)} within {target:.0%}"
                     for name, values in errors.items())


AVERAGING_FIGURES = ("formation p50", "formation p95", "round p50", "round p95")


def validate_averaging(rows: list[dict], cpu: HarnessCPU) -> tuple[list[str], dict[str, list[float]]]:
    lines = ["| R | load start/end | DHT op CPU ms (input) | matchmaking CPU ms (input) | all-reduce CPU ms / member "
             "(input) | start behind the round's first, p50 / p95 s (input) | formation p50 s: measured / simulated "
             "| off | p95 | off | round p50 s: measured / simulated | off | p95 | off | host CPU s / round: measured / "
             "simulated | off |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    errors, vector_bytes = {name: [] for name in AVERAGING_FIGURES}, tiny_middle_stage_bytes()
    for row in rows:
        offsets = tuple(row.get("start_offsets_s") or ())  # none in rows recorded before starts were
        swarm = SimSwarm(scenario_from_dict(averaging_scenario(row["replicas"], row["rounds_due"], cpu, vector_bytes,
                                                               offsets)))
        swarm.run()
        formations = [f for r in swarm.rounds.log for f in r.formations]
        durations = [d for r in swarm.rounds.log for d in r.durations]
        cells = [f"| {row['replicas']} | {row['load_start']:.1f}/{row['load_end']:.1f} | "
                 f"{swarm_cpu_ms(swarm):.1f} | {at_size(cpu.matchmaking_ms_at, row['replicas']):.1f} | "
                 f"{swarm.rounds.allreduce_cpu_s(row['replicas']) * 1000:.1f} | "
                 + (f"{percentile(list(offsets), 0.5):.3f} / {percentile(list(offsets), 0.95):.3f} |" if offsets
                    else "- |")]
        for name, measured, simulated in zip(AVERAGING_FIGURES, (
                row["formation_p50_s"], row["formation_p95_s"], row["duration_p50_s"], row["duration_p95_s"]), (
                percentile(formations, 0.5), percentile(formations, 0.95),
                percentile(durations, 0.5), percentile(durations, 0.95))):
            text, error = _off(simulated, measured)
            errors[name].append(error)
            cells.append(f" {measured:.3f} / {simulated:.3f} | {text} |")
        cells.append(_host_cpu_cells(row, swarm))
        lines.append("".join(cells))
    return lines, errors


def _host_cpu_cells(row: dict, swarm: SimSwarm) -> str:
    """The host's CPU per round due, measured whole (every replica's processes) and as the simulated
    jobs add up: a check of the CPU inputs, not a prediction counted against the simulator."""
    measured = row.get("cpu_s_per_round")
    if measured is None or not math.isfinite(measured) or swarm.cores is None:
        return " - | - |"  # rows recorded before the harness read its CPU
    simulated = swarm.cores.cpu_s / row["rounds_due"]
    return f" {measured:.3f} / {simulated:.3f} | {_off(simulated, measured)[0]} |"


def swarm_cpu_ms(swarm: SimSwarm) -> float:
    """The CPU of one DHT operation at the simulated swarm's size (the table read at R)."""
    return dht_cpu_s(swarm.scenario.dht, swarm.nodes()) * 1000.0


def _geometry(text: str) -> tuple[int, int]:
    stages, replicas = re.match(r"(\d+)x(\d+)", text).groups()
    return int(stages), int(replicas)


def newcomer_scenario(row: dict) -> dict:
    stages, replicas = _geometry(row["geometry"])
    rtt, up, down = AGORA_FLOOR
    families = row["by_family"]
    return {
        "run": {"seconds": NEWCOMER_AT_S + row["newcomer_joined_s"] + 30.0, "stages": stages, "batch_s": 1.0},
        "compute": {"ms": [1.0] * stages},
        "links": [{"name": "agora-floor", "up_mbit": up, "down_mbit": down, "rtt_ms": rtt}],
        "workers": {"replicas": replicas},
        "dht": {"get_ms_at": [[float(row["nodes"]), families["get workers"]["p50_ms"]]],
                "store_ms_at": [[float(row["nodes"]), families["store workers"]["p50_ms"]]]},
        "averaging": {"method": "none"},
        "churn": {"admission_s": row["newcomer_joined_s"], "join_dht_ops": NEWCOMER_FIRST_READS,
                  "dial_rtts": DIAL_RTTS, "join_at_s": [NEWCOMER_AT_S], "state_bytes": 1_000_000},
    }


def validate_newcomers(rows: list[dict]) -> tuple[list[str], dict[str, list[float]]]:
    lines = ["| N | load start/end | DHT joined s (input) | get / store ms (input) | donor found s: measured / "
             "simulated | off | visible to others s: measured / simulated | off |",
             "|---:|---|---:|---|---:|---:|---:|---:|"]
    errors: dict[str, list[float]] = {"donor found": [], "visible to others": []}
    for row in rows:
        swarm = SimSwarm(scenario_from_dict(newcomer_scenario(row)))
        newcomer = swarm.run().newcomers[0]
        get_s = row["by_family"]["get workers"]["p50_ms"] / 1000.0
        visible = newcomer.to_visible_s + (get_s + MONITOR_READ_EVERY_S) / 2 + get_s
        donor_text, donor_error = _off(newcomer.to_donor_s, row["newcomer_donor_s"])
        visible_text, visible_error = _off(visible, row["newcomer_visible_s"])
        errors["donor found"].append(donor_error)
        errors["visible to others"].append(visible_error)
        lines.append(f"| {row['nodes']} | {row['load_start']:.1f}/{row['load_end']:.1f} | "
                     f"{row['newcomer_joined_s']:.2f} | {get_s * 1000:.0f} / "
                     f"{row['by_family']['store workers']['p50_ms']:.0f} | {row['newcomer_donor_s']:.2f} / "
                     f"{newcomer.to_donor_s:.2f} | {donor_text} | {row['newcomer_visible_s']:.2f} / {visible:.2f} | "
                     f"{visible_text} |")
    return lines, errors


def scale_sections(results: Path = RESULTS) -> tuple[list[str], str]:
    """The two tables with their summaries (markdown lines), and a one-line summary."""
    dht_rows = json.loads((results / "dht_scale.json").read_text())["rows"]
    averaging_rows = json.loads((results / "averaging_scale.json").read_text())
    averaging, averaging_errors = validate_averaging(averaging_rows, HarnessCPU.read(results))
    newcomers, newcomer_errors = validate_newcomers(dht_rows)
    summary = (f"Averaging against R (4 R): {within(averaging_errors)}. "
               f"A newcomer against N (4 N): {within(newcomer_errors)}.")
    lines = ["## Averaging rounds against R (bench/results/averaging_scale.md)\n",
             f"{within(averaging_errors)}.\n", *averaging, "",
             "## A newcomer against N (bench/results/dht_scale.md)\n",
             f"{within(newcomer_errors)}.\n", *newcomers, ""]
    return lines, summary
