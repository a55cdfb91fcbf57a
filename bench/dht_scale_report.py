"""bench/dht_scale.py's figures, table and plot: pure, from what the harness read at each N.

The harness hands over, per N, every request its peers logged (`Call`), and per peer the bytes of
its namespace's eth0 and the CPU seconds of its processes over the window and over a stretch at rest
before the traffic started, and the memory at the window's end. `figures` turns them into one row:
latencies as measured (exact quantiles of every request in the window), every per-time figure per
logical minute (`Dilation.per_logical_minute`: the background measured at rest is not stretched back,
the traffic is). `report` renders the rows, each figure's growth against N (bench/growth.py), the
goals, and the traffic model's check against the demo's N = 8 rates.

Apart from the role peers' means: the monitor (one peer whatever N: its whole polls' times, its bytes
and CPU, as the bootstrap's), the trainers' roster reads, and the newcomer's steps (`Newcomer`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

from agora.bench.dht_traffic import Dilation
from agora.bench.growth import growth
from agora.bench.results_files import pyplot

__all__ = ["COLUMNS", "JOIN_COLUMNS", "Call", "Figures", "Newcomer", "PeerUsage", "figures", "goals", "plot",
           "quantile", "read_calls", "read_errors", "read_polls", "report"]

LOAD_LIMIT = 2.0  # a 1-minute load above this on 2 cores: the figures include waiting for a core
KIB = 1024.0


@dataclass(frozen=True)
class Call:
    """One DHT request a peer sent: when it ended (wall time), what it was, how long, whether it failed."""

    end: float
    operation: str
    family: str
    seconds: float
    failed: bool

    @classmethod
    def from_line(cls, fields: list) -> "Call":
        end, operation, family, seconds, failed = fields
        return cls(float(end), str(operation), str(family), float(seconds), bool(failed))


@dataclass(frozen=True)
class PeerUsage:
    """What one peer's namespace and processes spent: at rest over `idle_s`, and over the window."""

    idle_bytes: int = 0
    window_bytes: int = 0
    idle_cpu_s: float = 0.0
    window_cpu_s: float = 0.0
    pss_mib: float = 0.0


@dataclass(frozen=True)
class Newcomer:
    """Wall times of the newcomer's steps (bench/dht_newcomer.py): launched (just before its DHT
    starts), joined, a donor planned (None: none), its record stored, and the end of the first read
    by another peer (the monitor) that returned it (None: none did)."""

    start: float
    joined: float
    donor: float | None
    announced: float | None
    visible: float | None
    donors: int = 0

    def seconds(self) -> dict[str, float]:
        """Each step's seconds from the start (NaN: it did not happen)."""
        def since(at):
            return round(at - self.start, 3) if at is not None else math.nan
        return {"newcomer_joined_s": since(self.joined), "newcomer_donor_s": since(self.donor),
                "newcomer_visible_s": since(self.visible)}


@dataclass
class Figures:
    nodes: int
    geometry: str
    profile: str
    dilation: float
    load_start: float
    load_end: float
    window_s: float
    peers_answered: int  # role peers with a request in the window
    get_p50_ms: float
    get_p95_ms: float
    store_p50_ms: float
    store_p95_ms: float
    requests_per_node_min: float
    failures: int
    action_errors: int
    kib_per_node_min: float
    rest_kib_per_node_min: float  # at rest, before the traffic (per real minute)
    cpu_s_per_node_min: float
    cpu_s_per_node_real_min: float  # as measured on this host (the dilated load)
    rest_cpu_s_per_node_min: float  # at rest, before the traffic
    pss_mib_per_node: float
    bootstrap_kib_min: float
    bootstrap_cpu_s_min: float
    start_s: float  # from the first peer launched to every peer ready
    wall_s: float = math.nan  # the whole N: credentials, namespaces, start, rest, warm-up, window, stop
    # per "operation family": requests per node per logical minute, p50 and p95 ms
    by_family: dict = field(default_factory=dict)
    # per record family, the entries the role peers' DHT processes received (dht/entry_traffic.py):
    # KiB and entries per node per logical minute, bytes an entry
    received: dict = field(default_factory=dict)
    # per "method family", the requests they sent: calls, KiB out and KiB back per node per logical minute
    sent: dict = field(default_factory=dict)
    # the monitor: its whole polls from the traffic's start to the window's end (seconds, as measured),
    # and its bytes and CPU per logical minute
    monitor_polls: int = 0
    monitor_poll_p50_s: float = math.nan
    monitor_poll_p95_s: float = math.nan
    monitor_kib_min: float = math.nan
    monitor_cpu_s_min: float = math.nan
    roster_reads_per_trainer_s: float = math.nan  # per logical second: its `all_workers` reads
    newcomer_joined_s: float = math.nan  # from the newcomer's launch (its `SwarmDHT.start`)
    newcomer_donor_s: float = math.nan
    newcomer_visible_s: float = math.nan
    newcomer_donors: int = 0

    @property
    def loaded(self) -> bool:
        return max(self.load_start, self.load_end) > LOAD_LIMIT


def _json_lines(path: Path) -> list:
    """Each non-blank line of a peer's JSON-lines file, parsed; none if the peer wrote no file."""
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def read_calls(folder: Path, names: Iterable[str]) -> dict[str, list[Call]]:
    """Every peer's request log (bench/dht_peer.py writes `<name>.jsonl`), a missing one empty."""
    return {name: [Call.from_line(line) for line in _json_lines(folder / f"{name}.jsonl")] for name in names}


def read_traffic(folder: Path, names: Iterable[str]) -> dict[str, list[tuple[float, dict]]]:
    """Every peer's snapshots of what its DHT process carried so far (bench/dht_peer.py's
    `<name>.jsonl.traffic.jsonl`: [wall time, {"received": ..., "sent": ...}] a line), a missing file empty."""
    return {name: [(float(wall), counts) for wall, counts in _json_lines(folder / f"{name}.jsonl.traffic.jsonl")]
            for name in names}


def carried_between(snapshots: list[tuple[float, dict]], part: str, start: float, end: float) -> dict[str, tuple]:
    """One part ("received" or "sent") of the snapshots, by name: its counts between the last snapshot
    at or before `start` (none: from nothing) and the last at or before `end`."""
    def last(at: float) -> dict:
        taken = [counts.get(part, {}) for wall, counts in snapshots if wall <= at]
        return taken[-1] if taken else {}

    before, after = last(start), last(end)
    return {name: tuple(now - was for now, was in zip(counts, before.get(name, [0] * len(counts))))
            for name, counts in after.items()}


def _carried(dilation: Dilation, traffic: Mapping[str, list[tuple[float, dict]]], peers: list[str],
             window: tuple[float, float]) -> tuple[dict[str, dict], dict[str, dict]]:
    """(received, sent) per node per logical minute: by family, KiB, entries and bytes an entry; by
    "method family", calls and KiB out and back."""
    window_s, per_node = window[1] - window[0], len(peers) or 1

    def per_min(amount: float) -> float:
        return dilation.per_logical_minute(amount, window_s) / per_node

    parts = {}
    for part in ("received", "sent"):
        totals: dict[str, list[int]] = {}
        for name in peers:
            for key, counts in carried_between(traffic.get(name, []), part, *window).items():
                total = totals.setdefault(key, [0] * len(counts))
                for i, count in enumerate(counts):
                    total[i] += count
        parts[part] = dict(sorted(totals.items()))
    received = {family: {"kib_per_node_min": round(per_min(size) / KIB, 2),
                         "entries_per_node_min": round(per_min(entries), 2),
                         "bytes_per_entry": round(size / entries) if entries else 0}
                for family, (entries, size) in parts["received"].items()}
    sent = {name: {"calls_per_node_min": round(per_min(calls), 2), "kib_out_per_node_min": round(per_min(out) / KIB, 2),
                   "kib_back_per_node_min": round(per_min(back) / KIB, 2)}
            for name, (calls, out, back) in parts["sent"].items()}
    return received, sent


def read_errors(folder: Path, names: Iterable[str]) -> int:
    """Actions that failed, over every peer's summary (a peer without one counts as one failure)."""
    failed = 0
    for name in names:
        try:
            failed += sum(json.loads((folder / f"{name}.jsonl.summary.json").read_text())["errors"].values())
        except (OSError, ValueError, KeyError):
            failed += 1
    return failed


def read_polls(folder: Path, name: str) -> list[tuple[float, float]]:
    """The monitor's polls ([end wall time, seconds] each) from its summary; none if it wrote none."""
    try:
        polls = json.loads((folder / f"{name}.jsonl.summary.json").read_text())["polls"]
    except (OSError, ValueError, KeyError):
        return []
    return [(float(end), float(seconds)) for end, seconds in polls]


def quantile(values: list[float], q: float) -> float:
    """The `q` quantile (0..1) of `values`, interpolated between ranks; NaN if there are none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(values: list[float], q: float) -> float:
    return 1000.0 * quantile(values, q)


def _rate(dilation: Dilation, usage: Iterable[PeerUsage], window_s: float, idle_s: float, kind: str) -> float:
    """Mean over `usage` of one peer's bytes or CPU seconds per logical minute."""
    usage = list(usage)
    if not usage:
        return math.nan
    total = 0.0
    for peer in usage:
        idle, window = (peer.idle_bytes, peer.window_bytes) if kind == "bytes" else (peer.idle_cpu_s, peer.window_cpu_s)
        total += dilation.per_logical_minute(window, window_s, idle / idle_s if idle_s > 0 else 0.0)
    return total / len(usage)


def figures(*, nodes: int, geometry: str, profile: str, dilation: Dilation, calls: Mapping[str, list[Call]],
            usage: Mapping[str, PeerUsage], bootstrap: str, window: tuple[float, float], idle_s: float,
            loads: tuple[float, float], action_errors: int = 0, start_s: float = math.nan, monitor: str = "",
            polls: Iterable[tuple[float, float]] = (), stages: int = 0, newcomer: Newcomer | None = None,
            traffic: Mapping[str, list[tuple[float, dict]]] | None = None) -> Figures:
    """One N's row. `calls` and `usage` by peer name (the bootstrap's included, named `bootstrap`, and
    the monitor's, named `monitor`); `window`: its wall-clock start and end; the role peers' figures are
    means over them. `polls`: the monitor's ([end wall time, seconds] each); `stages`: S, to count the
    trainers' roster reads (S gets each, names starting "trainer"); `traffic`: each peer's snapshots of
    what its DHT process carried (`read_traffic`)."""
    start, end = window
    window_s = end - start
    peers = [name for name in usage if name not in (bootstrap, monitor)]
    inside = {name: [c for c in calls.get(name, []) if start <= c.end <= end] for name in peers}
    every = [c for name in peers for c in inside[name]]
    gets = [c.seconds for c in every if c.operation == "get"]
    stores = [c.seconds for c in every if c.operation == "store"]
    per_node = len(peers) or 1
    by_family: dict[str, dict] = {}
    for name in sorted({f"{c.operation} {c.family}" for c in every}):
        chosen = [c.seconds for c in every if f"{c.operation} {c.family}" == name]
        by_family[name] = {"per_node_min": round(dilation.per_logical_minute(len(chosen), window_s) / per_node, 3),
                           "p50_ms": round(_ms(chosen, 0.5), 2), "p95_ms": round(_ms(chosen, 0.95), 2)}
    boot = usage.get(bootstrap, PeerUsage())
    cpu_real = sum(usage[name].window_cpu_s for name in peers) / per_node / window_s * 60.0
    at_rest = 60.0 / per_node / idle_s if idle_s > 0 else math.nan
    received, sent = _carried(dilation, traffic or {}, peers, window)
    return Figures(
        nodes=nodes, geometry=geometry, profile=profile, dilation=dilation.factor, load_start=round(loads[0], 2),
        load_end=round(loads[1], 2), window_s=round(window_s, 1),
        peers_answered=sum(1 for name in peers if inside[name]),
        get_p50_ms=_ms(gets, 0.5), get_p95_ms=_ms(gets, 0.95), store_p50_ms=_ms(stores, 0.5),
        store_p95_ms=_ms(stores, 0.95),
        requests_per_node_min=dilation.per_logical_minute(len(every), window_s) / per_node,
        failures=sum(1 for c in every if c.failed), action_errors=action_errors,
        kib_per_node_min=_rate(dilation, (usage[n] for n in peers), window_s, idle_s, "bytes") / KIB,
        cpu_s_per_node_min=_rate(dilation, (usage[n] for n in peers), window_s, idle_s, "cpu"),
        rest_kib_per_node_min=sum(usage[name].idle_bytes for name in peers) * at_rest / KIB,
        cpu_s_per_node_real_min=cpu_real, rest_cpu_s_per_node_min=sum(usage[n].idle_cpu_s for n in peers) * at_rest,
        pss_mib_per_node=sum(usage[name].pss_mib for name in peers) / per_node,
        bootstrap_kib_min=_rate(dilation, [boot], window_s, idle_s, "bytes") / KIB,
        bootstrap_cpu_s_min=_rate(dilation, [boot], window_s, idle_s, "cpu"),
        start_s=start_s, by_family=by_family, received=received, sent=sent,
        **_monitor_figures(dilation, usage.get(monitor), [seconds for ended, seconds in polls if ended <= end],
                           window_s, idle_s),
        roster_reads_per_trainer_s=_roster_reads(dilation, inside, stages, window_s),
        **(newcomer.seconds() if newcomer is not None else {}),
        newcomer_donors=newcomer.donors if newcomer is not None else 0)


def _monitor_figures(dilation: Dilation, usage: PeerUsage | None, polls: list[float], window_s: float,
                     idle_s: float) -> dict:
    if usage is None:
        return {}
    return {"monitor_polls": len(polls), "monitor_poll_p50_s": quantile(polls, 0.5),
            "monitor_poll_p95_s": quantile(polls, 0.95),
            "monitor_kib_min": _rate(dilation, [usage], window_s, idle_s, "bytes") / KIB,
            "monitor_cpu_s_min": _rate(dilation, [usage], window_s, idle_s, "cpu")}


def _roster_reads(dilation: Dilation, inside: Mapping[str, list[Call]], stages: int, window_s: float) -> float:
    """A trainer's roster reads (`all_workers`: S gets of the workers' records) per logical second."""
    trainers = [name for name in inside if name.startswith("trainer")]
    if not trainers or stages < 1:
        return math.nan
    gets = sum(1 for name in trainers for c in inside[name] if (c.operation, c.family) == ("get", "workers"))
    return gets / stages / len(trainers) / (window_s / dilation.factor)


# ---- the report ------------------------------------------------------------------------------------

COLUMNS = [("get_p50_ms", "get p50 ms"), ("get_p95_ms", "get p95 ms"), ("store_p50_ms", "store p50 ms"),
           ("store_p95_ms", "store p95 ms"), ("requests_per_node_min", "requests/node/min"),
           ("kib_per_node_min", "KiB in+out/node/min"), ("rest_kib_per_node_min", "at rest KiB/real min"),
           ("cpu_s_per_node_min", "CPU s/node/min"),
           ("cpu_s_per_node_real_min", "CPU s/node/real min"), ("rest_cpu_s_per_node_min", "at rest CPU s/real min"),
           ("pss_mib_per_node", "PSS MiB/node"), ("bootstrap_kib_min", "bootstrap KiB/min"),
           ("bootstrap_cpu_s_min", "bootstrap CPU s/min"), ("failures", "failed requests"),
           ("action_errors", "failed actions")]

NOT_MEASURED = ("What this harness is not: no compute, no gRPC data plane (no Forward/Backward, no "
                "completed-batch reports, no state download), no averaging all-reduce and no hivemind "
                "matchmaking (the averager's own DHT keys), no authorizer; no churn besides one newcomer after "
                "the window (no peer leaves). It is the coordination plane alone: the record families' stores "
                "and reads at the demo's pace, and a monitor polling them. Every peer made each of its reads "
                "once during the warm-up (bench/dht_peer.py's first reads), as a peer of a swarm that has run a "
                "while has: the window is the steady state, and a key's first read, whole, is the newcomer's.")

JOIN_COLUMNS = [("monitor_poll_p50_s", "monitor poll p50 s"), ("monitor_poll_p95_s", "monitor poll p95 s"),
                ("monitor_polls", "polls"), ("monitor_kib_min", "monitor KiB/min"),
                ("monitor_cpu_s_min", "monitor CPU s/min"), ("roster_reads_per_trainer_s", "roster reads/trainer/s"),
                ("newcomer_joined_s", "newcomer: DHT joined s"), ("newcomer_donor_s", "donor found s"),
                ("newcomer_visible_s", "visible to others s"), ("newcomer_donors", "donors planned")]

JOIN_TEXT = ("The monitor and a newcomer. The monitor is one client peer with a `monitor` credential (its stores "
             "would be refused; it makes none) running monitor/service.py's `SwarmMonitor.poll` every dilated "
             "`poll_s` (2 logical s): a poll's time is the whole refresh, every stage's worker records and the "
             "trainers' records read concurrently and the view built, as measured, over the polls from the "
             "traffic's start to the window's end; its bytes and CPU per logical minute are apart from the "
             "role peers', as the bootstrap's. Roster reads: a trainer's `all_workers` reads per logical second "
             "(node/trainer/calls.py refreshes its roster at most every `roster_refresh_s`); a trainer's routing "
             "decisions are not a DHT quantity: it picks a worker per microbatch and stage from that cached "
             "roster (`Roster.choose`), no DHT request, so none is given here. The newcomer: after the window "
             "(its figures are the swarm's alone), one more worker of stage 0 starts in its own namespace while "
             "the traffic goes on, and does what node/worker/join.py does before it holds state "
             "(bench/dht_newcomer.py), each step in seconds from its DHT's start (its process's imports not "
             "counted): DHT joined (`SwarmDHT.start` through "
             "the bootstrap), donor found (every stage's records read and `plan_donors` naming one: the "
             "coordination part of \"to state\"; the download is the data plane, not measured), visible to "
             "others (the end of the first read of its stage's key by the monitor, every 0.25 s, that returns "
             "its record: the coordination part of \"to member\").")


def goals(rows: list[Figures]) -> list[str]:
    """The issue's goals read off the rows: p95 at the largest N within 2x of the smallest N's, and
    bytes and CPU per node growing no faster than log N."""
    if len(rows) < 2:
        return ["(one N: no growth to judge)"]
    first, last = rows[0], rows[-1]
    lines = []
    for name, title in (("get_p95_ms", "DHT get p95"), ("store_p95_ms", "DHT store p95")):
        ratio = getattr(last, name) / getattr(first, name)
        verdict = "met" if ratio <= 2 else "missed"
        lines.append(f"- {title} at N={last.nodes} is {ratio:.2f}x N={first.nodes}'s (goal: within 2x): {verdict}")
    log_ratio = math.log(last.nodes) / math.log(first.nodes)
    for name, title in (("kib_per_node_min", "bytes per node"), ("cpu_s_per_node_min", "CPU per node")):
        ratio, shape, within = _per_node_growth(rows, name)
        lines.append(f"- {title}: x{ratio:.2f} from N={first.nodes} to N={last.nodes} (log N: x{log_ratio:.2f}), "
                     f"best fit {shape} (goal: at most log N): {'met' if within else 'missed'}")
    if any(row.loaded for row in rows):
        lines.append(f"- rows with a 1-minute load above {LOAD_LIMIT:g} include waiting for a core: "
                     "read their latencies and CPU as this host's contention")
    return lines


def _per_node_growth(rows: list[Figures], name: str) -> tuple[float, str, bool]:
    """A per-node cost's ratio from the smallest N to the largest, its best-fitting growth, and whether
    it grows at most like log N: both the ratio (within log N's, 10% of slack) and the fit's shape,
    since a line with a large constant can stay under log N's ratio over a few doublings."""
    values = [getattr(row, name) for row in rows]
    shape = growth([row.nodes for row in rows], values)
    ratio = values[-1] / values[0]
    log_ratio = math.log(rows[-1].nodes) / math.log(rows[0].nodes)
    return ratio, shape, shape in ("constant", "log N", "-") and ratio <= log_ratio * 1.1


def _cell(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def tables(rows: list[Figures]) -> list[str]:
    """The figures per N with their fitted growth, then the monitor's and the newcomer's (JOIN_TEXT)."""
    nodes = [row.nodes for row in rows]
    lines = ["| N | geometry | load start/end | answered | " + " | ".join(title for _, title in COLUMNS) + " |",
             "|---:|---|---|---:|" + "---:|" * len(COLUMNS)]
    for row in rows:
        load = f"{row.load_start:.1f}/{row.load_end:.1f}" + (" (over 2)" if row.loaded else "")
        values = " | ".join(_cell(getattr(row, name)) for name, _ in COLUMNS)
        lines.append(f"| {row.nodes} | {row.geometry} | {load} | {row.peers_answered}/{row.nodes} | {values} |")
    lines.append("| growth | | | | " + " | ".join(growth(nodes, [float(getattr(r, name)) for r in rows])
                                                  for name, _ in COLUMNS) + " |")
    lines += ["", JOIN_TEXT, "", "| N | " + " | ".join(title for _, title in JOIN_COLUMNS) + " |",
              "|---:|" + "---:|" * len(JOIN_COLUMNS)]
    for row in rows:
        lines.append(f"| {row.nodes} | " + " | ".join(_cell(getattr(row, name)) for name, _ in JOIN_COLUMNS) + " |")
    lines.append("| growth | " + " | ".join(growth(nodes, [float(getattr(r, name)) for r in rows])
                                            for name, _ in JOIN_COLUMNS) + " |")
    return lines


def section(path: Path) -> list[str]:
    """RESULTS.md's section 10 from bench/dht_scale.py's JSON (nothing when it was never run)."""
    if not path.exists():
        return []
    recorded = json.loads(path.read_text())
    rows = [Figures(**row) for row in recorded["rows"]]
    return ["## 10. The coordination plane against the swarm's size (bench/dht_scale.py)", "",
            f"`{recorded.get('command', 'python bench/dht_scale.py')}`, as bench/results/dht_scale.md has it with "
            "its requests by record family, the reading and the plot. " + NOT_MEASURED, "", *tables(rows), "",
            *goals(rows)]


def report(rows: list[Figures], command: str, model_check: list[tuple[str, float, float]] | None = None) -> str:
    nodes = [row.nodes for row in rows]
    first = rows[0]
    lines = ["# DHT coordination cost against swarm size (bench/dht_scale.py)", "",
             f"`{command}` on {time.strftime('%Y-%m-%d %H:%M')}; {platform.node()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}. Each N is N admitted DHT peers (S stages x R replicas of workers "
             f"and trainers) and a bootstrap, each in its own network namespace on profile `{first.profile}`, "
             f"playing bench/dht_traffic.py's traffic dilated {first.dilation:g}x; latencies as measured (each "
             "peer serving 1/K of the logical load: a swarm at full pace may queue more), every per-time figure per "
             "logical minute (traffic x K plus the background measured at rest).", "",
             NOT_MEASURED, "", *tables(rows), "", "Goals:", "", *goals(rows)]
    families = sorted({name for row in rows for name in row.by_family})
    lines += ["", "Requests by operation and record family: per node per logical minute (p50 / p95 ms).", "",
              "| request | " + " | ".join(f"N={n}" for n in nodes) + " | growth of p95 |",
              "|---|" + "---:|" * (len(nodes) + 1)]
    for name in families:
        cells = [row.by_family.get(name) for row in rows]
        shown = " | ".join("-" if c is None else f"{c['per_node_min']:.3g} ({c['p50_ms']:.3g} / {c['p95_ms']:.3g})"
                           for c in cells)
        p95 = [math.nan if c is None else c["p95_ms"] for c in cells]
        lines.append(f"| {name} | {shown} | {growth(nodes, p95)} |")
    lines += received_table(rows) + sent_table(rows)
    if model_check:
        lines += ["", "The traffic model against the demo's nodes at N = 8 (bench/results/many_nodes.json), "
                  "requests per DHT peer per second, as the nodes' metrics count them:", "",
                  "| request | model | measured | model / measured |", "|---|---:|---:|---:|"]
        for name, modelled, measured in model_check:
            ratio = modelled / measured if measured else math.nan
            lines.append(f"| {name} | {modelled:.3g} | {measured:.3g} | {_cell(ratio)} |")
    return "\n".join(lines) + "\n"


def received_table(rows: list[Figures]) -> list[str]:
    """What the role peers received, by record family (dht/entry_traffic.py), with each family's growth."""
    def cell(row: Figures, family: str) -> tuple[float, str] | None:
        found = _received_cell(row.received, family)
        return None if found is None else (found[0], f"{found[0]:.4g} ({found[1]:.3g}; {found[2]:.0f})")

    return _carried_table(rows, sorted({family for row in rows for family in row.received}), "family", cell,
                          "Entries received by record family (dht/entry_traffic.py: the stores a peer held and the "
                          "entries its reads' answers brought, whole as they came, its own excluded): KiB per node per "
                          "logical minute (entries a minute; bytes an entry). Message framing, digests and hivemind's "
                          "routing are not entries; the bytes column above counts them all, in and out.")


def sent_table(rows: list[Figures]) -> list[str]:
    """The requests the role peers' DHT processes sent, by method and family, with the growth of their bytes."""
    def cell(row: Figures, name: str) -> tuple[float, str] | None:
        chosen = [c for key, c in row.sent.items() if name == "all" or key == name]
        if not chosen:
            return None
        kib = sum(c["kib_out_per_node_min"] + c["kib_back_per_node_min"] for c in chosen)
        return kib, f"{sum(c['calls_per_node_min'] for c in chosen):.3g} ({kib:.4g})"

    return _carried_table(rows, sorted({name for row in rows for name in row.sent}), "RPC family", cell,
                          "Requests sent by RPC and record family (dht/entry_traffic.py: each request and its response "
                          "as protobuf encodes them, authorization included; `-`: no key): per node per logical minute, "
                          "calls (KiB out + back). Every request is counted once, by its sender; a node's interface "
                          "carries its own and those it answers.")


def _carried_table(rows: list[Figures], names: list[str], head: str,
                   cell: Callable[[Figures, str], tuple[float, str] | None], intro: str) -> list[str]:
    """A row per name and one for "all": each N's cell (its KiB, as shown), the KiB's ratio from the
    smallest N to the largest and its fitted growth; nothing when no N has a name."""
    if not names:
        return []
    nodes = [row.nodes for row in rows]
    lines = ["", intro, "", f"| {head} | " + " | ".join(f"N={n}" for n in nodes)
             + f" | x N={nodes[0]}->{nodes[-1]} | growth |", "|---|" + "---:|" * (len(nodes) + 2)]
    for name in [*names, "all"]:
        cells = [cell(row, name) for row in rows]
        kib = [math.nan if c is None else c[0] for c in cells]
        ratio = kib[-1] / kib[0] if kib[0] and not math.isnan(kib[0]) else math.nan
        shown = " | ".join("-" if c is None else c[1] for c in cells)
        lines.append(f"| {name} | {shown} | {_cell(ratio)} | {growth(nodes, kib)} |")
    return lines


def _received_cell(received: Mapping[str, dict], family: str) -> tuple[float, float, float] | None:
    chosen = list(received.values()) if family == "all" else [received[family]] if family in received else []
    if not chosen:
        return None
    kib = sum(c["kib_per_node_min"] for c in chosen)
    entries = sum(c["entries_per_node_min"] for c in chosen)
    return kib, entries, (kib * KIB / entries if entries else 0.0)


def plot(rows: list[Figures], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    nodes = [row.nodes for row in rows]
    for name in ("get_p50_ms", "get_p95_ms", "store_p50_ms", "store_p95_ms"):
        axes[0].plot(nodes, [getattr(r, name) for r in rows], marker="o", label=name.replace("_ms", ""))
    axes[0].set(title="DHT request latency (ms, as measured)", ylim=(0, None))
    pairs = ((axes[1], "kib_per_node_min", 1 / KIB, "MiB in+out per node", "requests_per_node_min",
              "requests per node"),
             (axes[2], "cpu_s_per_node_min", 1.0, "CPU s per node", "pss_mib_per_node", "PSS MiB per node"))
    for axis, left, scale, left_label, right, right_label in pairs:
        axis.plot(nodes, [getattr(r, left) * scale for r in rows], marker="o", color="C0")
        axis.set_ylabel(left_label, color="C0")
        twin = axis.twinx()
        twin.plot(nodes, [getattr(r, right) for r in rows], marker="s", color="C1")
        twin.set_ylabel(right_label, color="C1")
        twin.set_ylim(0, None)
        axis.set_ylim(0, None)
    axes[1].set(title="traffic per logical minute")
    axes[2].set(title="CPU per logical minute, memory")
    for axis in axes:
        axis.set(xlabel="peers N", xscale="log")
        axis.set_xticks(nodes, [str(n) for n in nodes])
        axis.minorticks_off()
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


SUMMARY_LABEL = ("| 10 | the coordination plane alone (bench/dht_scale.py): bytes and CPU per node, DHT p95, from the "
                 "smallest N to the largest |")


def _busy(rows: list[Figures]) -> str:
    """The rows taken while the host was busy (`Figures.loaded`): their latencies include waiting for
    a core, which the summary must not pass off as the DHT's."""
    busy = [f"N={row.nodes} at load {row.load_start:.1f}->{row.load_end:.1f}" for row in rows if row.loaded]
    return f"; taken busy: {', '.join(busy)}" if busy else ""


def summary_row(path: Path) -> str:
    """RESULTS.md's row from bench/dht_scale.py's JSON (or a line saying it was never run)."""
    if not path.exists():
        return (f"{SUMMARY_LABEL} not measured: `python bench/dht_scale.py --nodes 8 16 32 64 --dilation 32` | "
                "- | - |")
    recorded = json.loads(path.read_text())
    rows = [Figures(**row) for row in recorded["rows"]]
    first, last = rows[0], rows[-1]
    log_ratio = math.log(last.nodes) / math.log(first.nodes)
    ratios = {name: getattr(last, name) / getattr(first, name)
              for name in ("kib_per_node_min", "cpu_s_per_node_min", "get_p95_ms", "store_p95_ms")}
    failed = "; ".join(line.split(" (logs:")[0] for line in recorded["failed"])
    costs = {name: _per_node_growth(rows, name) for name in ("kib_per_node_min", "cpu_s_per_node_min")}
    measured = (f"N={first.nodes} to {last.nodes}: bytes x{ratios['kib_per_node_min']:.2f} (fits "
                f"{costs['kib_per_node_min'][1]}), CPU x{ratios['cpu_s_per_node_min']:.2f} (fits "
                f"{costs['cpu_s_per_node_min'][1]}) (log N: x{log_ratio:.2f}); get p95 x{ratios['get_p95_ms']:.2f}, "
                f"store p95 x{ratios['store_p95_ms']:.2f}" + (f"; {failed}" if failed else "") + _busy(rows)
                + " (bench/results/dht_scale.md)")
    met = (all(within for _, _, within in costs.values())
           and max(ratios["get_p95_ms"], ratios["store_p95_ms"]) <= 2 and not failed and last.nodes >= 64)
    return f"{SUMMARY_LABEL} {measured} | <= log N; p95 at 64 within 2x of 8 | {'yes' if met else 'no'} |"
