"""`run_wan_demo`: `agora-node demo` with every process in its own namespace behind a profile's links.

The swarm is the demo's (node/demo/demo.py: the same commands, supervision, logs and summary);
what changes is its `Placement`: each process (bootstrap, authorizer, every worker, every trainer)
runs in its own namespace (`agora-node <role> --host <its address> ...`, launched into it as `ip netns
exec` would: node/demo/launcher.py), so every byte between two of them, the authorizer's preflight
and dial-back included, crosses two emulated access links and the relay. The demo's operator
credential (it only writes files) is issued outside.

Before the swarm starts, the links are measured and a profile more than 10% off is refused
(bench/wan/links.py). Namespaces left by an earlier run that crashed are removed first.

`demo --chaos` starts newcomers under names nobody knew in advance ("worker-s1-r0.j1" replaces
worker-s1-r0, ".j2" replaces ".j1"): a session built with `spares` has that many more nodes on the
profile's link, and a newcomer (any worker or trainer without a node of its own) takes a free one
the first time its name is placed: a fresh machine joining, with an address of its own. The node of
the newcomer it replaced (killed before its successor starts) is free again, at the back of the
line, so the spare nodes a run needs are bounded by the processes chaos may kill (one live newcomer
per original name), not by how many kills a run lasts for.
"""

from __future__ import annotations

import contextlib
from collections import deque
import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

from agora.bench.wan.links import PROBE_NODE, measure_faithful
from agora.bench.wan.profiles import LinkMeasurement, LinkSpec, Profile
from agora.bench.wan.topology import WanTopology, cleanup_leftovers
from agora.node.demo.demo import DemoOptions, run_demo
from agora.node.demo.processes import ChildFailed, Placement

__all__ = ["WanRun", "WanSession", "wan_session", "demo_process_names", "straggler_name", "node_links",
           "run_wan_demo", "SPARE_PREFIX", "SpareNodes", "chaos_predecessor",
           "chaos_spares"]

SPARE_PREFIX = "spare-"


def chaos_predecessor(name: str) -> str | None:
    """The process a chaos newcomer replaced (node/demo/demo.py's names): worker-s1-r0.j2 replaced
    worker-s1-r0.j1, which replaced worker-s1-r0; None for a name chaos did not give."""
    base, marker, generation = name.rpartition(".j")
    if not marker or not generation.isdigit() or int(generation) < 1:
        return None
    return base if generation == "1" else f"{base}.j{int(generation) - 1}"


def chaos_spares(options: DemoOptions) -> int:
    """Spare nodes enough for any `demo --chaos` run of `options`: one per process chaos may kill
    (every worker and trainer), since each holds at most one at a time (SpareNodes)."""
    return (options.stages or 1) * options.replicas + options.trainers


class SpareNodes:
    """Which spare node each newcomer runs on: the one free longest. A chaos newcomer's predecessor
    was killed before it starts, so the predecessor's spare goes back to the end of the line (taken
    again only when no other is free)."""

    def __init__(self, spares: list[str]):
        self._spares = list(spares)
        self._free: deque[str] = deque(spares)
        self._taken: dict[str, str] = {}  # a newcomer's name -> its spare

    def __bool__(self) -> bool:
        return bool(self._spares)

    def reset(self) -> None:
        """A new run on the same topology: every spare free again."""
        self._free = deque(self._spares)
        self._taken.clear()

    def node_for(self, newcomer: str) -> str:
        if newcomer not in self._taken:
            predecessor = chaos_predecessor(newcomer)
            if predecessor in self._taken:
                self._free.append(self._taken.pop(predecessor))
            if not self._free:
                raise ChildFailed(f"{newcomer}: no spare node left for a newcomer (build the session with more spares)")
            self._taken[newcomer] = self._free.popleft()
        return self._taken[newcomer]


@dataclass
class WanRun:
    profile: str
    links: list[LinkMeasurement]
    summary: dict
    code: int
    load_before: tuple[float, float, float]
    relay: dict | None = None
    extra: dict = field(default_factory=dict)


def demo_process_names(options: DemoOptions) -> list[str]:
    """The demo's networked processes, by the names it gives them."""
    names = ["bootstrap"] + ([] if options.insecure else ["authorizer"])
    names += [f"worker-s{stage}-r{replica}" for stage in range(options.stages or 1)
              for replica in range(options.replicas)]
    return names + [f"trainer-{index}" for index in range(options.trainers)]


def straggler_name(options: DemoOptions) -> str:
    """The replica a straggler profile slows: the last replica of the middle stage."""
    return f"worker-s{(options.stages or 1) // 2}-r{options.replicas - 1}"


def node_links(profile: Profile, options: DemoOptions, spares: int = 0) -> dict[str, LinkSpec]:
    """Every node's link (the probe's included: unshaped, the profile's round trip; `spares` more
    nodes on the profile's link for chaos newcomers)."""
    links = {name: profile.link for name in demo_process_names(options)}
    links.update({f"{SPARE_PREFIX}{index}": profile.link for index in range(spares)})
    if profile.straggler is not None:
        links[straggler_name(options)] = profile.straggler
    links[PROBE_NODE] = LinkSpec(None, None, profile.link.rtt_ms)
    return links


class WanSession:
    """One profile's topology, measured and checked, for several demo runs in turn."""

    def __init__(self, profile: Profile, topology: WanTopology, links: list[LinkMeasurement], attempts: int):
        self.profile = profile
        self.topology = topology
        self.links = links
        self.link_check_attempts = attempts
        self._spares = SpareNodes([name for name in topology.nodes if name.startswith(SPARE_PREFIX)])

    def _node(self, name: str):
        nodes = self.topology.nodes
        if name in nodes:
            return nodes[name]
        if not name.startswith(("worker-", "trainer-")):
            return None  # not a networked process (the offline `authorizer issue`): this machine
        return nodes[self._spares.node_for(name)]

    def placement(self) -> Placement:
        def namespace(name: str) -> str | None:
            node = self._node(name)
            return None if node is None else node.namespace

        def host(name: str) -> str:
            node = self._node(name)
            return "127.0.0.1" if node is None else node.address

        return Placement(namespace=namespace, host=host)

    def run(self, options: DemoOptions, workdir: Path, *, quiet: bool = True) -> WanRun:
        """`run_demo(options)` on this topology: every process the demo starts must have a node here.
        The demo's monitor is not started (every process's metrics listen on its own namespace's
        loopback); `--chaos` needs spare nodes (see the module docstring)."""
        if options.chaos_s is not None and not self._spares:
            raise ValueError("--chaos: the session has no spare nodes for newcomers (wan_session(spares=N))")
        options = replace(options, monitor=False)
        self._spares.reset()
        missing = [name for name in demo_process_names(options) if name not in self.topology.nodes]
        if missing:
            raise ValueError(f"the topology has no node for {', '.join(missing)}: build it for these options")
        workdir = Path(workdir).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        summary_path = workdir / "summary.json"
        demo_options = replace(options, workdir=str(workdir / "demo"), summary_json=str(summary_path))
        load = os.getloadavg()
        started = time.monotonic()
        with open(workdir / "demo.out", "w") as out, (contextlib.redirect_stdout(out) if quiet
                                                      else contextlib.nullcontext()):
            code = run_demo(demo_options, self.placement())
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        summary.setdefault("wall_s", time.monotonic() - started)
        if summary.get("outcome") == "interrupted":
            raise KeyboardInterrupt
        return WanRun(self.profile.name, self.links, summary, code, load,
                      extra={"link_check_attempts": self.link_check_attempts, "load_after": os.getloadavg()})


@contextlib.contextmanager
def wan_session(profile: Profile, options: DemoOptions, workdir: Path, *, rate_seconds: float = 4.0,
                tuned_hosts: bool = False, spares: int = 0) -> Iterator[WanSession]:
    """The profile's topology with a node for every process `options` starts (runs with fewer
    replicas or trainers fit too), its links measured and checked; torn down on exit. `tuned_hosts`:
    nodes do not restart TCP slow start after idle (bench/wan/topology.py)."""
    workdir = Path(workdir).resolve()
    cleanup_leftovers()
    with WanTopology(node_links(profile, options, spares), workdir / "net",
                     slow_start_after_idle=not tuned_hosts) as topology:
        representatives = ["bootstrap"] + ([straggler_name(options)] if profile.straggler is not None else [])
        measured, attempts = measure_faithful(topology, profile.name, representatives, rate_seconds=rate_seconds)
        yield WanSession(profile, topology, measured, attempts)


def run_wan_demo(profile: Profile, options: DemoOptions, workdir: Path, *, rate_seconds: float = 4.0,
                 quiet: bool = True) -> WanRun:
    """Build the profile's topology (with spare nodes under `--chaos`), measure and check its links,
    run the demo on it, tear it down."""
    spares = chaos_spares(options) if options.chaos_s is not None else 0
    with wan_session(profile, options, workdir, rate_seconds=rate_seconds, spares=spares) as session:
        run = session.run(options, Path(workdir), quiet=quiet)
    run.relay = session.topology.relay_stats()
    return run
