"""How coordination cost grows with a swarm's size: `agora-node demo` at N nodes, measured from the nodes.

Each N runs one whole admitted swarm on this machine (`agora-node demo`: authorizer, bootstrap,
monitor, S stages x R replicas of workers and T trainers, each its own process with its own DHT
peer), on a model so small that compute is negligible next to coordination: tiny's blocks, one short
microbatch per batch. The heartbeat is `join`'s default (5 s), as a deployed swarm's is. After a
warm-up every node's `/metrics` (the monitor's `/sd` lists them) is read twice, `--window` seconds
apart, with the CPU time of the swarm's whole process tree (every node's Python process, its DHT
process and its p2pd); the figures are the differences:

- DHT requests (dht/op_timings.py, `agora_dht_request_seconds`): p50 and p95 of gets and of stores
  over every node's requests in the window, and requests per second per node;
- CPU seconds per node per minute (the whole tree over N nodes; the authorizer, bootstrap and monitor
  are included, as a deployment's would be elsewhere), and memory (proportional set size) per node;
- averaging: rounds per stage per minute, the share that committed, round duration p50/p95;
- the monitor's poll p95 and the trainers' calls per second.

Each figure is fitted against N as a constant, a + b log N and a + b N; the fit with the smallest
squared error is named (on three or four N values this says which shape the figures follow, not a
law). Writes bench/results/many_nodes.md and .json, and a plot when matplotlib is installed.

Runs alone: the machine's load average is recorded at each N's start and end, and on a two-core
machine the processes of a large N compete for the cores, so its latencies include that wait: read
them beside the load and the CPU per node.

    python bench/many_nodes.py --nodes 8 16 32 --window 60
    python bench/many_nodes.py --nodes 6 --window 15 --warmup 10     # shows it works
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from agora.bench.growth import growth
from agora.bench.results_files import pyplot, write_results
from agora.dht.op_timings import BUCKETS_S, OperationStats, quantile
from agora.node.host_cpu import tree_usage

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SERVICES = 3  # authorizer, bootstrap, monitor: processes of the swarm that are not nodes


@dataclass(frozen=True)
class Geometry:
    stages: int
    replicas: int
    trainers: int

    @property
    def nodes(self) -> int:
        return self.stages * self.replicas + self.trainers


def geometry_for(nodes: int, stages: int) -> Geometry:
    """`nodes` as S stages x R replicas plus a trainer per 16 nodes (at least one): as many workers
    per stage as fit, the rest trainers."""
    trainers = max(1, nodes // 16)
    replicas = max(1, (nodes - trainers) // stages)
    return Geometry(stages, replicas, nodes - stages * replicas)


@dataclass
class Figures:
    nodes: int
    geometry: str
    load_start: float
    load_end: float
    window_s: float
    get_p50_ms: float
    get_p95_ms: float
    store_p50_ms: float
    store_p95_ms: float
    dht_requests_per_node_s: float
    dht_failures: int
    cpu_s_per_node_min: float
    pss_mib_per_node: float
    rounds_per_stage_min: float
    rounds_committed_ratio: float
    round_p50_s: float
    round_p95_s: float
    monitor_poll_p95_s: float
    trainer_calls_s: float
    scraped: int
    # DHT requests per node per second, and their p95 in ms, by "method kind" (what grows, and where)
    by_family: dict = field(default_factory=dict)


# ---- reading the nodes -----------------------------------------------------------------------------

def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return answer.read()


def scrape_targets(monitor: str) -> dict[str, str]:
    """Every metrics endpoint the monitor's `/sd` lists (workers, trainers, the authorizer and the
    bootstrap peer), with its role."""
    groups = json.loads(_get(f"http://{monitor}/sd"))
    return {target: group["labels"]["role"] for group in groups for target in group["targets"]}


def scrape(targets: list[str]) -> dict[str, list]:
    """Each target's metric families; one that does not answer is left out."""
    pages = {}
    for target in targets:
        try:
            pages[target] = list(text_string_to_metric_families(_get(f"http://{target}/metrics").decode()))
        except OSError:
            continue
    return pages


def histograms(pages: dict[str, list], name: str, **match: str) -> OperationStats:
    """Every node's `name` histogram series whose labels include `match`, merged."""
    merged = OperationStats()
    for families in pages.values():
        for family in families:
            if family.name != name:
                continue
            series: dict[tuple, dict] = {}
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k != "le"}
                if any(labels.get(k) != v for k, v in match.items()):
                    continue
                key = tuple(sorted(labels.items()))
                entry = series.setdefault(key, {"buckets": {}, "sum": 0.0})
                if sample.name.endswith("_bucket"):
                    entry["buckets"][float(sample.labels["le"])] = sample.value
                elif sample.name.endswith("_sum"):
                    entry["sum"] = sample.value
            for entry in series.values():
                merged = merged.merged(_as_stats(entry["buckets"], entry["sum"]))
    return merged


def _as_stats(cumulative_by_bound: dict[float, float], total_s: float) -> OperationStats:
    """A scraped histogram in `BUCKETS_S` form (bounds it lacks are read at the next bound below)."""
    bounds = sorted(cumulative_by_bound)
    cumulative = []
    for bound in [*BUCKETS_S, math.inf]:
        below = [cumulative_by_bound[b] for b in bounds if b <= bound]
        cumulative.append(int(below[-1]) if below else 0)
    buckets = [cumulative[0]] + [b - a for a, b in zip(cumulative, cumulative[1:])]
    return OperationStats(buckets, cumulative[-1], total_s, 0)


def difference(after: OperationStats, before: OperationStats) -> OperationStats:
    return OperationStats([a - b for a, b in zip(after.buckets, before.buckets)], after.count - before.count,
                          after.total_s - before.total_s, after.failures - before.failures)


def counter_sum(pages: dict[str, list], name: str, **match: str) -> float:
    total = 0.0
    for families in pages.values():
        for family in families:
            if family.name != name:
                continue
            for sample in family.samples:
                if sample.name.endswith("_created") or any(sample.labels.get(k) != v for k, v in match.items()):
                    continue
                total += sample.value
    return total


def settle_load(load: float, most_s: float) -> None:
    """Wait until the 1-minute load is at most ``load``, at most ``most_s`` seconds: a harness's
    previous size (its 64 peers, say) leaves a load that takes a minute or two to decay, and a row
    started on it is marked."""
    deadline = time.monotonic() + most_s
    while os.getloadavg()[0] > load and time.monotonic() < deadline:
        time.sleep(5.0)


# ---- one N -----------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def demo_command(geometry: Geometry, monitor_port: int, workdir: Path, seconds: float) -> list[str]:
    return [sys.executable, "-m", "agora.node", "demo", "--config", "tiny", "--stages", str(geometry.stages),
            "--replicas", str(geometry.replicas), "--trainers", str(geometry.trainers), "--steps", "100000",
            "--time-budget", str(seconds), "--heartbeat", "5", "--monitor-port", str(monitor_port),
            "--workdir", str(workdir), "--train.batch-size", "2", "--train.microbatches", "1",
            "--train.seq-len", "32", "--train.eval-every", "0"]


def wait_for_targets(monitor: str, geometry: Geometry, process: subprocess.Popen, deadline_s: float) -> list[str]:
    """Every `/sd` target, and the monitor's own, once every worker and trainer is listed (a
    readiness handshake through the monitor)."""
    expected = {"worker": geometry.stages * geometry.replicas, "trainer": geometry.trainers}
    deadline = time.monotonic() + deadline_s
    listed: dict[str, int] = {}
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the demo exited ({process.returncode}) before its nodes were listed")
        try:
            targets = scrape_targets(monitor)
        except OSError:
            targets = {}
        listed = {role: sum(1 for r in targets.values() if r == role) for role in expected}
        if all(listed[role] >= n for role, n in expected.items()):
            return sorted(targets) + [monitor]
        time.sleep(1.0)
    raise RuntimeError(f"listed {listed} of {expected} after {deadline_s:.0f} s")


def measure(nodes: int, stages: int, warmup_s: float, window_s: float, workdir: Path) -> Figures:
    geometry = geometry_for(nodes, stages)
    load_start = os.getloadavg()[0]
    port = _free_port()
    monitor = f"127.0.0.1:{port}"
    shutil.rmtree(workdir, ignore_errors=True)  # a swarm of another geometry's checkpoints would be refused
    workdir.mkdir(parents=True)
    budget = warmup_s + window_s + 600  # the trainers stop on their own well after the window
    log = (workdir / "demo.out").open("w")
    process = subprocess.Popen(demo_command(geometry, port, workdir / "swarm", budget), stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        targets = wait_for_targets(monitor, geometry, process, deadline_s=900)
        time.sleep(warmup_s)
        before, (cpu_before, _) = scrape(targets), tree_usage(process.pid)
        started = time.monotonic()
        time.sleep(window_s)
        after, (cpu_after, pss) = scrape(targets), tree_usage(process.pid)
        elapsed = time.monotonic() - started
    finally:
        _stop(process)
        log.close()
    return _figures(nodes, geometry, before, after, elapsed, cpu_after - cpu_before, pss, load_start)


def _stop(process: subprocess.Popen) -> None:
    """Ctrl-C to the demo (it stops its swarm in order), then kill what is left of its session."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _figures(nodes: int, geometry: Geometry, before: dict, after: dict, elapsed: float, cpu_s: float, pss: float,
             load_start: float) -> Figures:
    both = sorted(set(before) & set(after))
    before, after = {t: before[t] for t in both}, {t: after[t] for t in both}

    def window(name: str, **match: str) -> OperationStats:
        return difference(histograms(after, name, **match), histograms(before, name, **match))

    gets, stores = window("agora_dht_request_seconds", method="get"), window("agora_dht_request_seconds",
                                                                            method="store")
    everything = window("agora_dht_request_seconds")
    rounds = window("agora_averaging_round_duration_seconds")
    total_rounds = counter_sum(after, "agora_averaging_rounds") - counter_sum(before, "agora_averaging_rounds")
    committed = (counter_sum(after, "agora_averaging_rounds", outcome="committed")
                 - counter_sum(before, "agora_averaging_rounds", outcome="committed"))
    polls = window("agora_monitor_poll_duration_seconds")
    calls = window("agora_trainer_call_seconds")
    failures = (counter_sum(after, "agora_dht_request_failures") - counter_sum(before, "agora_dht_request_failures"))
    processes = nodes + SERVICES
    return Figures(
        nodes=nodes, geometry=f"{geometry.stages}x{geometry.replicas} + {geometry.trainers}t",
        load_start=round(load_start, 2), load_end=round(os.getloadavg()[0], 2), window_s=round(elapsed, 1),
        get_p50_ms=1000 * quantile(0.5, gets.cumulative()), get_p95_ms=1000 * quantile(0.95, gets.cumulative()),
        store_p50_ms=1000 * quantile(0.5, stores.cumulative()),
        store_p95_ms=1000 * quantile(0.95, stores.cumulative()),
        dht_requests_per_node_s=everything.count / max(1, len(both) - 1) / elapsed,  # the monitor: no DHT peer
        dht_failures=int(failures),
        cpu_s_per_node_min=cpu_s / processes / (elapsed / 60), pss_mib_per_node=pss / processes,
        rounds_per_stage_min=total_rounds / geometry.stages / (elapsed / 60),
        rounds_committed_ratio=committed / total_rounds if total_rounds else math.nan,
        round_p50_s=quantile(0.5, rounds.cumulative()), round_p95_s=quantile(0.95, rounds.cumulative()),
        monitor_poll_p95_s=quantile(0.95, polls.cumulative()), trainer_calls_s=calls.count / elapsed,
        scraped=len(both), by_family=_by_family(window, len(both) - 1, elapsed))


def _by_family(window, peers: int, elapsed: float) -> dict:
    """Requests per node per second and p95 (ms) of each (method, kind) of DHT request."""
    out = {}
    for method in ("get", "store", "delete", "call"):
        for kind in ("workers", "trainers", "moves", "rounds", "units", "bans", "other"):
            stats = window("agora_dht_request_seconds", method=method, kind=kind)
            if stats.count:
                out[f"{method} {kind}"] = {"per_node_s": round(stats.count / max(1, peers) / elapsed, 4),
                                           "p95_ms": round(1000 * quantile(0.95, stats.cumulative()), 2)}
    return out


# ---- the report ----------------------------------------------------------------------------------

COLUMNS = [("get_p50_ms", "DHT get p50 ms"), ("get_p95_ms", "DHT get p95 ms"), ("store_p50_ms", "store p50 ms"),
           ("store_p95_ms", "store p95 ms"), ("dht_requests_per_node_s", "DHT requests/s per node"),
           ("cpu_s_per_node_min", "CPU s per node per min"), ("pss_mib_per_node", "PSS MiB per node"),
           ("rounds_per_stage_min", "rounds per stage per min"), ("rounds_committed_ratio", "rounds committed"),
           ("round_p50_s", "round p50 s"), ("round_p95_s", "round p95 s"),
           ("monitor_poll_p95_s", "monitor poll p95 s"), ("trainer_calls_s", "trainer calls/s")]


def report(rows: list[Figures], command: str) -> str:
    nodes = [row.nodes for row in rows]
    lines = ["# Coordination cost against swarm size (bench/many_nodes.py)", "",
             f"`{command}` on {time.strftime('%Y-%m-%d %H:%M')}; {platform.node()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}. Every N is a whole admitted swarm on loopback (tiny's blocks, "
             "one 32-token microbatch per batch, heartbeat 5 s); figures are differences over the window.", "",
             "| N | geometry | load start/end | scraped | " + " | ".join(title for _, title in COLUMNS) + " |",
             "|---:|---|---|---:|" + "---:|" * len(COLUMNS)]
    for row in rows:
        values = " | ".join(_cell(getattr(row, name)) for name, _ in COLUMNS)
        lines.append(f"| {row.nodes} | {row.geometry} | {row.load_start:.1f}/{row.load_end:.1f} | {row.scraped} | "
                     f"{values} |")
    lines.append("| growth | | | | " + " | ".join(growth(nodes, [getattr(r, name) for r in rows])
                                                  for name, _ in COLUMNS) + " |")
    families = sorted({name for row in rows for name in row.by_family})
    lines += ["", "DHT requests by operation and record family: per node per second (p95 ms).", "",
              "| request | " + " | ".join(f"N={n}" for n in nodes) + " | growth |", "|---|" + "---:|" * (len(nodes) + 1)]
    for name in families:
        cells = [row.by_family.get(name) for row in rows]
        shown = " | ".join("-" if c is None else f"{c['per_node_s']:.3g} ({c['p95_ms']:.3g})" for c in cells)
        rates = [math.nan if c is None else c["per_node_s"] for c in cells]
        lines.append(f"| {name} | {shown} | {growth(nodes, rates)} |")
    return "\n".join(lines) + "\n"


def _cell(value: float) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def plot(rows: list[Figures], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    nodes = [row.nodes for row in rows]
    for name in ("get_p50_ms", "get_p95_ms", "store_p95_ms"):
        axes[0].plot(nodes, [getattr(r, name) for r in rows], marker="o", label=name)
    axes[0].set(title="DHT request latency (ms)", xlabel="nodes", xscale="log")
    axes[1].plot(nodes, [r.dht_requests_per_node_s for r in rows], marker="o", label="DHT requests/s per node")
    axes[1].plot(nodes, [r.cpu_s_per_node_min for r in rows], marker="o", label="CPU s per node per min")
    axes[1].set(title="per-node cost", xlabel="nodes", xscale="log")
    axes[2].plot(nodes, [r.round_p50_s for r in rows], marker="o", label="round p50 s")
    axes[2].plot(nodes, [r.rounds_committed_ratio for r in rows], marker="o", label="rounds committed")
    axes[2].set(title="averaging", xlabel="nodes", xscale="log")
    for axis in axes:
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--stages", type=int, default=3, help="3: R = 2 to 20 replicas per stage over N = 8 to 64")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds after every node is listed")
    parser.add_argument("--window", type=float, default=60.0, help="seconds between the two readings")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/agora-many-nodes"))
    parser.add_argument("--out", type=Path, default=RESULTS / "many_nodes.md")
    args = parser.parse_args(argv)
    if any(n < args.stages + 1 for n in args.nodes):
        parser.error(f"--nodes: each N needs at least --stages + 1 = {args.stages + 1} nodes")
    rows = []
    for n in args.nodes:
        print(f"many-nodes: N={n} ({geometry_for(n, args.stages)})", flush=True)
        rows.append(measure(n, args.stages, args.warmup, args.window, args.workdir / f"n{n}"))
        print(json.dumps(asdict(rows[-1])), flush=True)
    command = "python bench/many_nodes.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_results(args.out, report(rows, command), [asdict(r) for r in rows], lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
