"""`WanTopology`: one network namespace per node, joined through the delay relay, shaped by tc.

Layout of one run (names carry the harness's pid and a random tag, so a run that crashed never
blocks the next, and `cleanup_leftovers` can tell its remains from a live run's):

    agw-<pid>-<tag>-<i>     node i: lo, and eth0 (10.77.x.y/16, MAC 02:77:...) with tbf = upload
    agw-<pid>-<tag>-hub     p<i>: the other end of node i's veth, tbf = node i's download;
                            the relay (bench/wan/relay.py) joins the p<i>, holding each frame
                            for its pair's one-way delay

Nothing else is connected: the hub has no address and no route, so traffic stays inside these
namespaces. Every node gets large TCP buffers (a 1 Gbit/s, 150 ms link holds 19 MB in flight;
Linux's default 4 MB send buffer would cap one flow at ~200 Mbit/s there), no IPv6 (its
neighbour discovery would only add frames to relay), and Reno congestion control. This machine
defaults to BBR, which paces even a small burst at the bandwidth it has estimated, and an RPC's
bursts are all it sees: a 16 KiB request and reply took 1.75 round trips at 80 ms instead of one.
CUBIC, most hosts' default, cannot be a namespace's default unless the host's
`tcp_allowed_congestion_control` lists it; Reno behaves like it on these flows (the same slow
start, no pacing) and, with the shapers' two-BDP queues, keeps a link full after a loss.
`slow_start_after_idle` stays Linux's default (on), as on a contributor's machine, unless the
topology is built with `slow_start_after_idle=False` ("tuned hosts": what node/rpc/server.py's
hint recommends), so the suite can show what the setting is worth.

Every node's ARP table is written in advance, one permanent entry per other node (the harness
chose every address and MAC). Linux keeps one neighbour table for all namespaces, and the entries
it learns count against one host-wide cap, `net.ipv4.neigh.default.gc_thresh3` (1024 by default):
a swarm where each node talks to most others needs N(N-1) of them, past the cap from about 33
nodes, and then a node cannot resolve a new neighbour ("neighbor table overflow!" in dmesg) and
its connections time out (at N = 64 every peer after the 35th to 38th failed to join the DHT).
Permanent entries are exempt from that cap (Linux 5.0 and later), so no size of topology depends
on the host's setting or takes entries from anything else on the machine, and no ARP broadcast
has to cross the relay.

`down` (also on any exception, Ctrl-C included, through the context manager) stops the relay
and every process left in the namespaces, then deletes them; it is idempotent. Everything that
touches the system goes through `ip` and `tc` (iproute2), run as root.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from agora.bench.wan.profiles import LinkSpec, tbf_arguments
from agora.bench.wan.relay import RelayPort
from agora.node.demo.processes import ChildFailed, ProcessGroup

__all__ = ["TopologyError", "WanNode", "WanTopology", "cleanup_leftovers", "NAME_PREFIX", "harness_available"]

logger = logging.getLogger("agora.bench.wan")

NAME_PREFIX = "agw-"
# TCP buffer ceilings in every node namespace (min, default, max bytes).
TCP_BUFFERS = "4096 131072 67108864"
# Every node's congestion control (see the module docstring).
CONGESTION_CONTROL = "reno"


class TopologyError(RuntimeError):
    pass


@dataclass(frozen=True)
class WanNode:
    name: str  # the process's name (worker-s0-r0, trainer-0, ...)
    link: LinkSpec
    namespace: str
    address: str  # eth0's IPv4 address
    mac: str
    hub_interface: str

    def prefix(self) -> list[str]:
        """The command prefix that runs a command inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace]


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(command), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise TopologyError(f"`{' '.join(command)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _run_batch(namespace: str, commands: list[str]) -> None:
    """Run `ip` commands (one per line, without the leading `ip`) inside `namespace` in one process."""
    result = subprocess.run(["ip", "-n", namespace, "-batch", "-"], input="\n".join(commands) + "\n",
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise TopologyError(f"`ip -n {namespace} -batch` failed ({result.returncode}): {result.stderr.strip()}")


def harness_available() -> str | None:
    """None when this machine can build a topology (root, iproute2, tc); else why not."""
    if os.geteuid() != 0:
        return "the WAN harness needs root (network namespaces, veth pairs, tc)"
    for tool in ("ip", "tc"):
        if _run("sh", "-c", f"command -v {tool}", check=False).returncode != 0:
            return f"the WAN harness needs `{tool}` (iproute2)"
    return None


def _namespaces() -> list[str]:
    listed = _run("ip", "netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.strip()]


def _kill_inside(namespace: str) -> None:
    for pid in _run("ip", "netns", "pids", namespace, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _owner_alive(pid: int) -> bool:
    """Whether the process that made a namespace may still be running (a reused pid keeps its
    remains until that process ends too: removing a live run's links would be worse)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_leftovers() -> list[str]:
    """Delete the namespaces of harness runs whose process is gone (a crash, a kill -9), with every
    process still inside them; the names removed. A live run's namespaces are left alone."""
    removed = []
    for namespace in _namespaces():
        if not namespace.startswith(NAME_PREFIX):
            continue
        try:
            pid = int(namespace.split("-")[1])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and _owner_alive(pid):
            continue
        _kill_inside(namespace)
        _run("ip", "netns", "delete", namespace, check=False)
        removed.append(namespace)
    if removed:
        logger.warning("removed %d namespaces left by an earlier harness run: %s", len(removed), " ".join(removed))
    return removed


class WanTopology:
    """Namespaces for `nodes` (name -> link), built by `up` and removed by `down`."""

    def __init__(self, nodes: dict[str, LinkSpec], workdir: Path, *, slow_start_after_idle: bool = True):
        if not nodes:
            raise ValueError("a topology needs at least one node")
        if len(nodes) > 250 * 250:
            raise ValueError("too many nodes for 10.77.0.0/16")
        self.workdir = Path(workdir)
        self.slow_start_after_idle = slow_start_after_idle
        self.tag = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.hub = f"{self.tag}-hub"
        self.nodes: dict[str, WanNode] = {}
        for index, (name, link) in enumerate(nodes.items()):
            high, low = divmod(index, 250)
            self.nodes[name] = WanNode(name=name, link=link, namespace=f"{self.tag}-{index}",
                                       address=f"10.77.{high}.{low + 1}", mac=f"02:77:00:00:{high:02x}:{low + 1:02x}",
                                       hub_interface=f"p{index}")
        self._group: ProcessGroup | None = None
        self._created: list[str] = []

    def node(self, name: str) -> WanNode:
        return self.nodes[name]

    # ------------------------------------------------------------------ lifecycle

    def up(self, ready_timeout_s: float = 30.0) -> "WanTopology":
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._namespace(self.hub)
            _run("ip", "netns", "exec", self.hub, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                 "net.ipv6.conf.default.disable_ipv6=1")
            for node in self.nodes.values():
                self._build_node(node)
            for node in self.nodes.values():
                self._pin_neighbours(node)
            self._start_relay(ready_timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def _namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build_node(self, node: WanNode) -> None:
        self._namespace(node.namespace)
        inside = node.prefix()
        _run(*inside, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
             f"net.ipv4.tcp_rmem={TCP_BUFFERS}", f"net.ipv4.tcp_wmem={TCP_BUFFERS}",
             f"net.ipv4.tcp_congestion_control={CONGESTION_CONTROL}",
             f"net.ipv4.tcp_slow_start_after_idle={int(self.slow_start_after_idle)}")
        _run("ip", "-n", self.hub, "link", "add", node.hub_interface, "type", "veth", "peer", "name", "eth0",
             "netns", node.namespace)
        _run("ip", "-n", node.namespace, "link", "set", "eth0", "address", node.mac)
        _run("ip", "-n", node.namespace, "addr", "add", f"{node.address}/16", "dev", "eth0")
        _run("ip", "-n", node.namespace, "link", "set", "eth0", "up")
        _run("ip", "-n", self.hub, "link", "set", node.hub_interface, "up")
        if node.link.upload_mbit is not None:
            _run(*inside, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", *tbf_arguments(node.link.upload_mbit, node.link.rtt_ms))
        if node.link.download_mbit is not None:
            _run("ip", "netns", "exec", self.hub, "tc", "qdisc", "add", "dev", node.hub_interface, "root", "tbf",
                 *tbf_arguments(node.link.download_mbit, node.link.rtt_ms))

    def _pin_neighbours(self, node: WanNode) -> None:
        """Every other node's MAC as a permanent ARP entry in `node` (see the module docstring)."""
        _run_batch(node.namespace, [f"neigh replace {other.address} lladdr {other.mac} dev eth0 nud permanent"
                                    for other in self.nodes.values() if other is not node])

    def _start_relay(self, ready_timeout_s: float) -> None:
        ports = [RelayPort(n.hub_interface, n.mac, n.link.rtt_ms / 1e3) for n in self.nodes.values()]
        ports_file = self.workdir / "relay-ports.json"
        ports_file.write_text(json.dumps([port.__dict__ for port in ports]))
        self._group = ProcessGroup(self.workdir)
        ready = self.workdir / "relay.ready"
        relay = self._group.spawn("relay", ["ip", "netns", "exec", self.hub, sys.executable, "-m",
                                            "agora.bench.wan.relay", "--ports", str(ports_file), "--ready-file",
                                            str(ready), "--stats-file", str(self.workdir / "relay-stats.json")],
                                  ready)
        try:
            self._group.wait_ready([relay], ready_timeout_s)
        except ChildFailed as error:
            raise TopologyError(f"the delay relay did not start: {error}") from None

    def spawn(self, name: str, node: str, command: list[str], ready_path: Path | None = None):
        """Start `command` inside `node`'s namespace as a child of this topology (stopped by `down`)."""
        return self._group.spawn(name, [*self.nodes[node].prefix(), *command], ready_path)

    @property
    def group(self) -> ProcessGroup:
        if self._group is None:
            raise RuntimeError("the topology is not up")
        return self._group

    def relay_stats(self) -> dict | None:
        try:
            return json.loads((self.workdir / "relay-stats.json").read_text())
        except (OSError, ValueError):
            return None

    def down(self) -> None:
        """Stop the relay and everything inside the namespaces, delete them (idempotent)."""
        if self._group is not None:
            self._group.shutdown(grace_s=5.0)
        for namespace in reversed(self._created):
            _kill_inside(namespace)
            _run("ip", "netns", "delete", namespace, check=False)
        self._created = []

    def __enter__(self) -> "WanTopology":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()
