"""Measure the links a `WanTopology` made, before anything runs on them.

For every distinct link of the profile, one node that has it is measured against the topology's
`probe` node (unshaped, the profile's round trip): the TCP round trip between them, the node's
upload (a bulk transfer from it to the probe) and its download (from the probe to it), each by
the receiver (bench/wan/probe.py). `check_links` refuses, in one error naming every problem, a
profile whose measured RTT or rate is more than 10% off its setting (bench/wan/profiles.py).

The links are kernel shapers and the relay's timer, but the probes measuring them are Python
processes on a machine shared with others: a probe starved of CPU under-reads a link. So
`measure_faithful` measures up to three times and keeps the first measurement within the
tolerance, logging the others; three misses fail the run.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from agora.bench.wan.profiles import LinkMeasurement, LinkSpec, judge_measurement
from agora.bench.wan.topology import WanTopology

__all__ = ["PROBE_NODE", "LinksUnfaithful", "measure_links", "check_links", "measure_faithful"]

logger = logging.getLogger("agora.bench.wan")

PROBE_NODE = "probe"


class LinksUnfaithful(RuntimeError):
    """The harness did not make what the profile asks for (measured more than 10% off)."""


def _probe(topology: WanTopology, node: str, *args: str, timeout_s: float) -> dict:
    command = [*topology.node(node).prefix(), sys.executable, "-m", "agora.bench.wan.probe", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise LinksUnfaithful(f"probe {' '.join(args)} from {node} failed: {result.stderr.strip()[-500:]}")
    return json.loads(result.stdout)


def measure_links(topology: WanTopology, representatives: list[str], *, rate_seconds: float = 4.0,
                  rtt_count: int = 20, ready_timeout_s: float = 30.0) -> list[LinkMeasurement]:
    """One measurement per node in `representatives`, against the topology's probe node."""
    probe = topology.node(PROBE_NODE)
    servers = {}
    for name in [PROBE_NODE, *representatives]:
        ready = topology.workdir / f"probe-server-{name}.ready"
        child = topology.spawn(f"probe-server-{name}", name, [sys.executable, "-m", "agora.bench.wan.probe", "serve",
                                                              "--host", topology.node(name).address,
                                                              "--ready-file", str(ready)], ready)
        servers[name] = child
    try:
        targets = {name: lines[0] for name, lines in topology.group.wait_ready(list(servers.values()),
                                                                               ready_timeout_s).items()}
        timeout = 60 + 4 * rate_seconds
        measured = []
        for name in representatives:
            node = topology.node(name)
            rtt = _probe(topology, name, "rtt", "--to", targets[f"probe-server-{PROBE_NODE}"],
                         "--count", str(rtt_count), timeout_s=timeout)
            up = _probe(topology, name, "rate", "--to", targets[f"probe-server-{PROBE_NODE}"],
                        "--seconds", str(rate_seconds), timeout_s=timeout)
            down = _probe(topology, PROBE_NODE, "rate", "--to", targets[f"probe-server-{name}"],
                          "--seconds", str(rate_seconds), timeout_s=timeout)
            # The round trip expected between the two: the mean of their access round trips.
            expected = LinkSpec(node.link.upload_mbit, node.link.download_mbit,
                                (node.link.rtt_ms + probe.link.rtt_ms) / 2)
            measured.append(LinkMeasurement(expected, rtt["rtt_ms"], up["rate_mbit"], down["rate_mbit"]))
        return measured
    finally:
        topology.group.stop(list(servers.values()), grace_s=2.0)


def check_links(profile_name: str, measured: list[LinkMeasurement]) -> None:
    """Raise LinksUnfaithful naming every link more than 10% off its setting."""
    problems = [f"{m.link.describe()}: {problem}" for m in measured for problem in judge_measurement(m)]
    if problems:
        raise LinksUnfaithful(f"profile {profile_name}: the emulated links are not what was asked for: "
                              + "; ".join(problems))


def measure_faithful(topology: WanTopology, profile_name: str, representatives: list[str], *,
                     rate_seconds: float = 4.0, attempts: int = 3) -> tuple[list[LinkMeasurement], int]:
    """The first of up to `attempts` measurements within the tolerance, and how many it took;
    LinksUnfaithful (the last verdict) if none was."""
    error: LinksUnfaithful | None = None
    for attempt in range(1, attempts + 1):
        measured = measure_links(topology, representatives, rate_seconds=rate_seconds)
        try:
            check_links(profile_name, measured)
            return measured, attempt
        except LinksUnfaithful as refused:
            error = refused
            logger.warning("link check %d/%d (load average %.2f): %s", attempt, attempts, os.getloadavg()[0], refused)
    raise error
