"""How the coordination plane's cost grows with the swarm's size: N admitted DHT peers, nothing else.

bench/many_nodes.py runs whole demos, so on two cores every figure past 8 nodes was contention. Here
each N is the control plane alone: N peers (S stages x R replicas of workers plus trainers,
bench/many_nodes.py's `geometry_for`) and a bootstrap, each one process (bench/dht_peer.py, a fork of
the launcher's server, node/demo/launcher.py) in its own network namespace behind the WAN harness's
links (bench/wan/topology.py; `--profile agora-floor` by default, 200 Mbit/s and 80 ms), each running a
real `SwarmDHT` admitted with a credential the run's `RunAuthority` minted for its role (DHTSecurity
on: every request signed and its token checked, every record signed and validated, as deployed),
joined through the bootstrap. Each plays its role's DHT traffic with the project's own records and
code paths at the many-node demo's pace (bench/dht_traffic.py has the model and its check against
that demo's rates at N = 8), every period stretched `--dilation` K times, so that 64 peers fit on two
cores without waiting for them.

A monitor peer (a `monitor` credential, client mode) polls the swarm as the real monitor does, and
after the window a newcomer joins (bench/dht_newcomer.py; bench/dht_scale_report.py's `JOIN_TEXT` says
what each of their figures measures).

Per N: the swarm is started (peers in waves, each wave ready before the next: a join has a 3 s
deadline), measured at rest for `--rest` seconds once the last joins settled (no traffic yet:
hivemind's and p2pd's own timers), then the traffic starts (the peers wait for a go file naming its
start), and after `--warmup` the window: `--window` real seconds between two readings of each
namespace's eth0 byte counters and of each peer's CPU time (its process, its hivemind DHT process and
p2pd, from /proc); the memory (proportional set size) at the window's end. Then the peers stop and
their request logs are read. Between the window's end and the stop, the newcomer: the monitor is
told to watch stage 0 (the stage's workers read, `<workdir>/watch.armed`), the newcomer is launched in
its own namespace through the bootstrap, and the harness waits until the monitor has seen its record
(`watch.seen`), at most `NEWCOMER_WAIT_S`.

Figures per N (bench/dht_scale_report.py): DHT get and store latency p50/p95 over every request in
the window, as measured; requests per node by family, bytes in+out per node and CPU seconds per node,
per logical minute (the traffic's share times K, plus the background measured at rest); PSS per
node; failed requests and actions; the bootstrap's and the monitor's bytes and CPU apart; the
monitor's poll time; the trainers' roster reads; the newcomer's seconds to joined, donor found and
visible; the 1-minute load at the start and end (a row above 2 says so; each N starts once the
load the previous one left has decayed to `--settle-load`). Each figure's growth against N is fitted
(constant, log N, N).

What it is not: no compute, no gRPC data plane, no averaging all-reduce nor hivemind's matchmaking
keys, no authorizer, no churn but the newcomer. Every namespace and process is removed on every path,
Ctrl-C and SIGTERM included (WanTopology's context manager; namespaces a crashed run left are removed
first). Needs root (namespaces, tc).

    python bench/dht_scale.py --nodes 8 16 32 64 --dilation 32 --window 320       # alone on the machine
    python bench/dht_scale.py --nodes 4 8 --dilation 4 --window 20 --out /tmp/dht_scale.md   # shows it works
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from agora.auth.authority import RunAuthority
from agora.bench.dht_scale_report import (Figures, Newcomer, PeerUsage, figures, plot, read_calls, read_errors,
                                          read_polls, read_traffic, report)
from agora.bench.dht_traffic import Dilation, TrafficModel, check_rows
from agora.bench.many_nodes import Geometry, geometry_for, settle_load
from agora.bench.results_files import write_results
from agora.bench.wan.profiles import PROFILES, profile_named
from agora.bench.wan.topology import WanTopology, cleanup_leftovers, harness_available
from agora.dht.key_families import WORKERS
from agora.node.demo.processes import ChildFailed, ChildProcess, Placement, ProcessGroup
from agora.node.host_cpu import process_parents, tree_usage as host_tree_usage
from agora.pipeline.files import atomic_write

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PEER_MODULE = "agora.bench.dht_peer"
NEWCOMER_MODULE = "agora.bench.dht_newcomer"
RUN_ID = "dht-scale"
BOOTSTRAP = "bootstrap"
MONITOR = "monitor"
NEWCOMER = "newcomer"
NEWCOMER_WAIT_S = 90.0  # from the monitor armed to the newcomer's record seen (its join has its own deadlines)
FILE_POLL_S = 0.1
READY_S = 300.0
# After the last wave joined, before the rest is measured: its joins' own traffic and CPU are not rest.
REST_SETTLE_S = 5.0


@dataclass(frozen=True)
class PeerSpec:
    name: str
    role: str
    stage: int = 0
    trainer_index: int = 0


def peer_specs(geometry: Geometry) -> list[PeerSpec]:
    """The role peers of a geometry, named as the demo names its processes."""
    workers = [PeerSpec(f"worker-s{s}-r{r}", "worker", stage=s) for r in range(geometry.replicas)
               for s in range(geometry.stages)]
    return workers + [PeerSpec(f"trainer-{i}", "trainer", trainer_index=i) for i in range(geometry.trainers)]


# ---- what the host reads --------------------------------------------------------------------------

def interface_bytes(namespace: str) -> int:
    """Bytes received and sent on a namespace's eth0 so far."""
    shown = subprocess.run(["ip", "-n", namespace, "-s", "-j", "link", "show", "dev", "eth0"], capture_output=True,
                           text=True, check=True)
    stats = json.loads(shown.stdout)[0]["stats64"]
    return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])


def tree_usage(roots: dict[str, int], *, memory: bool) -> dict[str, tuple[float, float]]:
    """(CPU seconds, PSS MiB or 0) of each root pid and its descendants, by name; one pass over /proc."""
    parents = process_parents()
    return {name: host_tree_usage(root, parents, memory=memory) for name, root in roots.items()}


@dataclass
class Reading:
    wall: float
    bytes: dict[str, int]
    usage: dict[str, tuple[float, float]]


def read_host(topology: WanTopology, children: dict[str, ChildProcess], *, memory: bool = False) -> Reading:
    wall = time.time()
    counters = {name: interface_bytes(topology.node(name).namespace) for name in children}
    return Reading(wall, counters, tree_usage({name: child.pid for name, child in children.items()}, memory=memory))


def usage_between(rest: tuple[Reading, Reading], window: tuple[Reading, Reading]) -> dict[str, PeerUsage]:
    (rest_a, rest_b), (window_a, window_b) = rest, window
    return {name: PeerUsage(idle_bytes=rest_b.bytes[name] - rest_a.bytes[name],
                            window_bytes=window_b.bytes[name] - window_a.bytes[name],
                            idle_cpu_s=rest_b.usage[name][0] - rest_a.usage[name][0],
                            window_cpu_s=window_b.usage[name][0] - window_a.usage[name][0],
                            pss_mib=window_b.usage[name][1]) for name in window_b.bytes}


# ---- one N ----------------------------------------------------------------------------------------

def peer_command(spec: PeerSpec, args: argparse.Namespace, geometry: Geometry, workdir: Path, host: str,
                 initial_peers: list[str], module: str = PEER_MODULE) -> list[str]:
    command = [sys.executable, "-m", module, "--role", spec.role, "--name", spec.name, "--run-id", RUN_ID,
               "--state-dir", str(workdir / "state" / spec.name), "--host", host,
               "--ready-file", str(workdir / f"{spec.name}.ready"), "--go-file", str(workdir / "go"),
               "--calls", str(workdir / "calls" / f"{spec.name}.jsonl"), "--stages", str(geometry.stages),
               "--stage", str(spec.stage), "--trainers", str(geometry.trainers),
               "--trainer-index", str(spec.trainer_index), "--dilation", str(args.dilation), "--seed", str(args.seed),
               "--first-reads-s", str(first_reads_s(args))]
    if initial_peers:
        command += ["--initial-peers", *initial_peers]
    if spec.role == BOOTSTRAP:
        command += ["--ca-dir", str(workdir / "ca")]
    if spec.role == MONITOR:
        command += ["--watch-file", str(workdir / "watch")]
    return command


def mint_credentials(workdir: Path, specs: list[PeerSpec]) -> None:
    """The run's authority, and a credential for each peer's role (the bootstrap: an operator's)."""
    authority = RunAuthority(workdir / "ca", run_id=RUN_ID)
    for spec in specs:
        role = "operator" if spec.role == BOOTSTRAP else spec.role
        authority.mint(workdir / "state" / spec.name, role=role, stage=spec.stage if role == "worker" else None)


def start_peers(group: ProcessGroup, topology: WanTopology, specs: list[PeerSpec], args, geometry: Geometry,
                workdir: Path) -> dict[str, ChildProcess]:
    """The bootstrap, then the others in waves of `--wave`, each ready before the next starts. Each
    joins through the bootstrap and `--join-through` - 1 workers of the earlier waves, drawn at random
    (trainers and the monitor are in client mode: nobody can dial them)."""
    boot_spec, others = specs[0], specs[1:]
    boot = group.spawn(BOOTSTRAP, peer_command(boot_spec, args, geometry, workdir, topology.node(BOOTSTRAP).address,
                                               []), workdir / f"{BOOTSTRAP}.ready")
    boot_maddrs = group.wait_ready([boot], READY_S)[BOOTSTRAP]
    joined: list[list[str]] = []  # the maddrs of every peer ready so far
    rng = random.Random(args.seed)
    children = {BOOTSTRAP: boot}
    for first in range(0, len(others), args.wave):
        wave = []
        for spec in others[first:first + args.wave]:
            through = rng.sample(joined, min(len(joined), args.join_through - 1))
            maddrs = boot_maddrs + [maddr for peer in through for maddr in peer]
            command = peer_command(spec, args, geometry, workdir, topology.node(spec.name).address, maddrs)
            wave.append(group.spawn(spec.name, command, workdir / f"{spec.name}.ready"))
        ready = group.wait_ready(wave, READY_S)
        joined += [ready[spec.name] for spec in others[first:first + args.wave] if spec.role == "worker"]
        children.update({child.name: child for child in wave})
    return children


def _wait_for(path: Path, timeout_s: float, child: ChildProcess | None = None) -> bool:
    """Whether `path` appeared within `timeout_s` (False at once if `child` died)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline or (child is not None and not child.alive()):
            return False
        time.sleep(FILE_POLL_S)
    return True


def join_newcomer(group: ProcessGroup, topology: WanTopology, spec: PeerSpec, args: argparse.Namespace,
                  geometry: Geometry, workdir: Path) -> Newcomer | None:
    """The newcomer's steps and the monitor's first read that saw it (the module docstring); None
    if it did not write its steps (its log says why)."""
    watch, result = workdir / "watch", workdir / f"{NEWCOMER}.json"
    atomic_write(watch, f"{spec.stage}\n".encode())
    if not _wait_for(Path(f"{watch}.armed"), NEWCOMER_WAIT_S):
        return None
    boot = (workdir / f"{BOOTSTRAP}.ready").read_text().split()
    command = peer_command(spec, args, geometry, workdir, topology.node(NEWCOMER).address, boot, NEWCOMER_MODULE)
    child = group.spawn(NEWCOMER, command + ["--result", str(result)], workdir / f"{NEWCOMER}.ready")
    seen_path = Path(f"{watch}.seen")
    if not _wait_for(result, NEWCOMER_WAIT_S, child):
        return None
    steps = json.loads(result.read_text())
    seen = json.loads(seen_path.read_text()) if _wait_for(seen_path, NEWCOMER_WAIT_S, child) else {}
    visible = seen["seen"] if seen.get("peer_id") == steps["peer_id"] else None
    return Newcomer(start=steps["start"], joined=steps["joined"], donor=steps["donor"], announced=steps["announced"],
                    visible=visible, donors=steps["donors"])


def warmup_s(args: argparse.Namespace) -> float:
    """From the go word to the window: `--warmup`, else a dilated heartbeat (every peer has beaten)."""
    if args.warmup is not None:
        return args.warmup
    return max(10.0, Dilation(args.dilation).real_s(TrafficModel().heartbeat_s))


def first_reads_s(args: argparse.Namespace) -> float:
    """The peers announce within this of the go word, then make their first reads within the next
    (bench/dht_peer.py): both spread over the warm-up's first 90%, before the window."""
    return warmup_s(args) / 2


def measure(nodes: int, args: argparse.Namespace, workdir: Path) -> Figures:
    geometry = geometry_for(nodes, args.stages)
    specs = [PeerSpec(BOOTSTRAP, BOOTSTRAP), *peer_specs(geometry), PeerSpec(MONITOR, MONITOR)]
    newcomer_spec = PeerSpec(NEWCOMER, "worker", stage=0)
    dilation = Dilation(args.dilation)
    warmup = warmup_s(args)
    load_start = os.getloadavg()[0]
    (workdir / "calls").mkdir(parents=True)
    mint_credentials(workdir, [*specs, newcomer_spec])
    profile = profile_named(args.profile)
    cleanup_leftovers()
    with WanTopology({spec.name: profile.link for spec in [*specs, newcomer_spec]}, workdir / "net") as topology:
        placement = Placement(namespace=lambda name: topology.node(name).namespace,
                              host=lambda name: topology.node(name).address)
        group = ProcessGroup(workdir, env={"OMP_NUM_THREADS": "1"}, placement=placement,
                             launched_modules=(PEER_MODULE, NEWCOMER_MODULE))
        try:
            started = time.monotonic()
            children = start_peers(group, topology, specs, args, geometry, workdir)
            start_s = time.monotonic() - started
            time.sleep(REST_SETTLE_S)
            rest = read_host(topology, children)
            time.sleep(args.rest)
            rest = (rest, read_host(topology, children))
            atomic_write(workdir / "go", f"{time.time():.3f}\n".encode())
            time.sleep(warmup)
            window = read_host(topology, children)
            time.sleep(args.window)
            window = (window, read_host(topology, children, memory=True))
            load_end = os.getloadavg()[0]
            newcomer = join_newcomer(group, topology, newcomer_spec, args, geometry, workdir)
        finally:
            group.shutdown(grace_s=15.0)
    names = [spec.name for spec in specs]
    return figures(nodes=nodes, geometry=f"{geometry.stages}x{geometry.replicas} + {geometry.trainers}t",
                   profile=profile.name, dilation=dilation, calls=read_calls(workdir / "calls", names),
                   usage=usage_between(rest, window), bootstrap=BOOTSTRAP, window=(window[0].wall, window[1].wall),
                   idle_s=rest[1].wall - rest[0].wall, loads=(load_start, load_end),
                   action_errors=read_errors(workdir / "calls", names), start_s=round(start_s, 1), monitor=MONITOR,
                   polls=read_polls(workdir / "calls", MONITOR), stages=geometry.stages, newcomer=newcomer,
                   traffic=read_traffic(workdir / "calls", names))


# ---- the run --------------------------------------------------------------------------------------

def model_check(path: Path = RESULTS / "many_nodes.json") -> list[tuple[str, float, float]] | None:
    """The traffic model against the demo's N = 8 row, if that file is here (bench/many_nodes.py wrote it)."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    row = next((r for r in rows if r.get("nodes") == 8), None)
    if row is None:
        return None
    measured = {name: figures["per_node_s"] for name, figures in row["by_family"].items()}
    services = row["scraped"] - 1 - 8  # DHT peers that are neither workers nor trainers (bootstrap, authorizer)
    return check_rows(measured, geometry_for(8, 3), TrafficModel(), services=services)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32, 64],
                        help="role peers N (besides the bootstrap)")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--dilation", type=float, default=32.0,
                        help="K: every period of the traffic K times longer (at most 38: a beat must renew its record)")
    parser.add_argument("--profile", default="agora-floor", choices=sorted(PROFILES), help="every peer's link")
    parser.add_argument("--rest", type=float, default=15.0, help="real seconds measured at rest, before the traffic")
    parser.add_argument("--warmup", type=float, default=None,
                        help="real seconds of traffic before the window (default: one dilated heartbeat, at least 10)")
    parser.add_argument("--window", type=float, default=320.0,
                        help="real seconds between the two readings (default: two dilated heartbeats at K = 32)")
    parser.add_argument("--wave", type=int, default=8, help="peers started together")
    parser.add_argument("--join-through", type=int, default=1,
                        help="initial peers each peer joins through: the bootstrap and this many - 1 peers already "
                             "joined (1: the bootstrap alone, as the authorizer's join file names it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle-load", type=float, default=1.5,
                        help="before each N, wait until the 1-minute load is at most this (the previous N's "
                             "processes gone; at most --settle-s); 0: do not wait")
    parser.add_argument("--settle-s", type=float, default=300.0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/agora-dht-scale"))
    parser.add_argument("--out", type=Path, default=RESULTS / "dht_scale.md")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(n < args.stages + 1 for n in args.nodes):
        parser.error(f"--nodes: each N needs at least --stages + 1 = {args.stages + 1} peers")
    if args.window <= 0 or args.rest <= 0 or args.wave < 1 or args.join_through < 1:
        parser.error("--window and --rest must be positive, --wave and --join-through at least 1")
    try:
        problem = Dilation(args.dilation).problem(TrafficModel(), WORKERS.max_ttl_s)
    except ValueError as error:
        problem = str(error)
    if problem:
        parser.error(problem)
    problem = harness_available()
    if problem:
        print(f"dht_scale: error: {problem}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    rows, failed = [], []
    try:
        for n in sorted(args.nodes):
            workdir = args.workdir / f"n{n}-{int(time.time())}"
            if args.settle_load > 0:
                settle_load(args.settle_load, args.settle_s)
            print(f"dht-scale: N={n} ({geometry_for(n, args.stages)}), dilation {args.dilation:g}, "
                  f"1-minute load {os.getloadavg()[0]:.2f}", flush=True)
            started = time.monotonic()
            try:
                rows.append(measure(n, args, workdir))
            except ChildFailed as error:  # a swarm that did not form is a finding, and the other N still count
                failed.append(f"N={n}: the swarm did not form: {str(error).splitlines()[0]} (logs: {workdir})")
                print(f"dht-scale: {failed[-1]}", flush=True)
                continue
            rows[-1].wall_s = round(time.monotonic() - started, 1)
            print(json.dumps(asdict(rows[-1])), flush=True)
    except KeyboardInterrupt:
        print("dht_scale: interrupted; every peer stopped and its namespace removed", file=sys.stderr)
        return 130
    if not rows:
        print("dht_scale: no N formed a swarm:\n" + "\n".join(failed), file=sys.stderr)
        return 1
    command = "python bench/dht_scale.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_results(args.out, report(rows, command, model_check()) + "".join(f"\n{line}\n" for line in failed),
                  {"command": command, "rows": [asdict(r) for r in rows], "failed": failed},
                  lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
