"""The WAN harness for real: namespaces, veths, tc and the delay relay (needs root and iproute2).

What is checked is what the harness promises beyond its own 10% verdict: frames really are held
(a round trip is never shorter than its setting), shaped links carry traffic, and nothing is left
behind, whether the run ends, fails, is stopped by a signal, or was killed outright earlier.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from agora.bench.wan.links import PROBE_NODE, measure_links
from agora.bench.wan.profiles import LinkSpec
from agora.bench.wan.topology import NAME_PREFIX, WanTopology, _namespaces, cleanup_leftovers, harness_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.skipif(harness_available() is not None, reason=str(harness_available()))]


def _ours(topology: WanTopology) -> list[str]:
    return [name for name in _namespaces() if name.startswith(topology.tag)]


def test_links_are_held_and_shaped_and_everything_is_removed(tmp_path):
    link = LinkSpec(50, 50, 30.0)
    topology = WanTopology({"a": link, PROBE_NODE: LinkSpec(None, None, 30.0)}, tmp_path)
    with topology:
        assert len(_ours(topology)) == 3  # a, the probe, the hub
        [measured] = measure_links(topology, ["a"], rate_seconds=2.0, rtt_count=10)
        relayed = topology.node("a").address
    assert measured.rtt_ms >= 30.0  # the relay never delivers a frame before it is due
    assert measured.upload_mbit and measured.upload_mbit < 60  # shaped (not the relay's gigabits)
    assert measured.download_mbit and measured.download_mbit < 60
    assert _ours(topology) == []
    assert topology.relay_stats()["frames"] > 0 and relayed.startswith("10.77.")


def test_every_node_knows_every_other_nodes_mac_permanently(tmp_path):
    # Learnt ARP entries share one host-wide cap (gc_thresh3) that a swarm of ~33 nodes exhausts.
    links = {name: LinkSpec(None, None, 0.0) for name in ("a", "b", "c")}
    with WanTopology(links, tmp_path) as topology:
        for node in topology.nodes.values():
            shown = subprocess.run(["ip", "-n", node.namespace, "neigh", "show", "nud", "permanent"],
                                   capture_output=True, text=True, check=True).stdout
            entries = {(line.split()[0], line.split()[4]) for line in shown.splitlines()}
            assert entries == {(other.address, other.mac) for other in topology.nodes.values() if other is not node}


def test_a_failure_inside_the_run_still_tears_down(tmp_path):
    topology = WanTopology({"a": LinkSpec(None, None, 0.0)}, tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        with topology:
            assert _ours(topology)
            raise RuntimeError("boom")
    assert _ours(topology) == []


def test_leftovers_of_a_dead_run_are_removed_with_their_processes():
    dead_pid = 2**22 + 12345  # above pid_max's default: never a live process
    namespace = f"{NAME_PREFIX}{dead_pid}-test-0"
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", namespace, "sleep", "300"])
    try:
        deadline = time.monotonic() + 10
        while not subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.strip():
            assert time.monotonic() < deadline, "the sleeper never entered its namespace"
            time.sleep(0.05)
        assert namespace in cleanup_leftovers()
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        assert namespace not in _namespaces()
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)


def test_sigterm_to_the_harness_removes_its_namespaces(tmp_path):
    harness = subprocess.Popen([sys.executable, "-m", "agora.bench.wan", "check", "--profile", "agora-floor",
                                "--seconds", "20", "--workdir", str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prefix = f"{NAME_PREFIX}{harness.pid}-"
    try:
        deadline = time.monotonic() + 60
        # Readiness: the relay is up (its ready file), so every namespace exists.
        while not (tmp_path / "relay.ready").exists():
            assert harness.poll() is None and time.monotonic() < deadline, harness.stderr.read()
            time.sleep(0.05)
        assert [name for name in _namespaces() if name.startswith(prefix)]
        harness.send_signal(signal.SIGTERM)
        _, stderr = harness.communicate(timeout=60)
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait()
    assert harness.returncode == 130 and "interrupted" in stderr
    assert [name for name in _namespaces() if name.startswith(prefix)] == []
    assert os.path.exists(tmp_path / "relay-stats.json")  # the relay left on SIGTERM, not SIGKILL
