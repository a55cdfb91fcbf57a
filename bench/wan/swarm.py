"""`run_wan_demo`: `agora-node demo` with every process in its own namespace behind a profile's links.

The swarm is the demo's (node/demo/demo.py: the same commands, supervision, logs and summary);
what changes is its `Placement`: each process (bootstrap, authorizer, every worker, every trainer)
runs as `ip netns exec <its namespace> agora-node <role> --host <its address> ...`, so every byte
between two of them, the authorizer's preflight and dial-back included, crosses two emulated
access links and the relay. The offline `authorizer issue` (it only writes files) runs outside.

Before the swarm starts, the links are measured and a profile more than 10% off is refused
(bench/wan/links.py). Namespaces left by an earlier run that crashed are removed first.
"""

from __future__ import annotations

import contextlib
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
from agora.node.demo.processes import Placement

__all__ = ["WanRun", "WanSession", "wan_session", "demo_process_names", "straggler_name", "node_links",
           "run_wan_demo"]


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


def node_links(profile: Profile, options: DemoOptions) -> dict[str, LinkSpec]:
    """Every node's link (the probe's included: unshaped, the profile's round trip)."""
    links = {name: profile.link for name in demo_process_names(options)}
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

    def placement(self) -> Placement:
        nodes = self.topology.nodes
        return Placement(prefix=lambda name: nodes[name].prefix() if name in nodes else [],
                         host=lambda name: nodes[name].address if name in nodes else "127.0.0.1")

    def run(self, options: DemoOptions, workdir: Path, *, quiet: bool = True) -> WanRun:
        """`run_demo(options)` on this topology: every process the demo starts must have a node here.
        The demo's monitor is not started (every process's metrics listen on its own namespace's
        loopback), and `--chaos` is refused (its newcomers would have no namespace)."""
        if options.chaos_s is not None:
            raise ValueError("--chaos: not on the WAN harness (a newcomer would have no namespace of its own)")
        options = replace(options, monitor=False)
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
                tuned_hosts: bool = False) -> Iterator[WanSession]:
    """The profile's topology with a node for every process `options` starts (runs with fewer
    replicas or trainers fit too), its links measured and checked; torn down on exit. `tuned_hosts`:
    nodes do not restart TCP slow start after idle (bench/wan/topology.py)."""
    workdir = Path(workdir).resolve()
    cleanup_leftovers()
    with WanTopology(node_links(profile, options), workdir / "net",
                     slow_start_after_idle=not tuned_hosts) as topology:
        representatives = ["bootstrap"] + ([straggler_name(options)] if profile.straggler is not None else [])
        measured, attempts = measure_faithful(topology, profile.name, representatives, rate_seconds=rate_seconds)
        yield WanSession(profile, topology, measured, attempts)


def run_wan_demo(profile: Profile, options: DemoOptions, workdir: Path, *, rate_seconds: float = 4.0,
                 quiet: bool = True) -> WanRun:
    """Build the profile's topology, measure and check its links, run the demo on it, tear it down."""
    with wan_session(profile, options, workdir, rate_seconds=rate_seconds) as session:
        run = session.run(options, Path(workdir), quiet=quiet)
    run.relay = session.topology.relay_stats()
    return run
