"""A process tree's CPU read from /proc (node/host_cpu.py) and the demo summary's CPU over the training
(node/demo/summary.py): real processes burning real CPU, read while they live and after one is reaped."""

import os
import subprocess
import sys
import time

import pytest

from agora.node.demo.summary import _cpu_line, _cpu_over_training
from agora.node.host_cpu import CpuWindow, host_busy_s, tree_cpu_by_part

pytestmark = pytest.mark.timeout(60)

# A parent that starts a child burning `BURN_S` of CPU, reaps it, and then waits for stdin to close.
_PARENT = """
import subprocess, sys
burn = "import time\\nend = time.process_time() + %s\\nwhile time.process_time() < end: pass"
child = subprocess.Popen([sys.executable, "-c", burn])
child.wait()
print("reaped", flush=True)
sys.stdin.read()
"""
BURN_S = 0.6


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_reaped_descendant_still_counts_in_its_tree_and_a_window_reads_it_beside_the_host():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT % BURN_S], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        window = CpuWindow({"parent": parent.pid, "me": os.getpid()})
        host_before = host_busy_s()
        _spin(0.3)
        assert parent.stdout.readline().strip() == "reaped"  # the burner is gone: its CPU is its parent's reaped time
        parts = tree_cpu_by_part(parent.pid)
        assert parts["children"] >= BURN_S - 0.05 and parts["p2pd"] == 0.0
        reading = window.end()
        assert reading["cores"] == os.cpu_count() and reading["window_s"] > 0
        assert reading["by_process"]["parent"]["children"] >= BURN_S - 0.05
        assert reading["by_process"]["me"]["main"] >= 0.25
        # The host was at least as busy as the two trees it holds (other processes only add to it).
        assert host_busy_s() - host_before >= 0.25
        assert reading["host_busy_s"] >= BURN_S + 0.25 - 0.1
    finally:
        parent.stdin.close()
        parent.wait(timeout=10)
    # Its root gone, a tree is left out of the reading rather than read as nothing.
    assert "parent" not in window.end()["by_process"]


def test_the_summary_adds_each_trainers_own_reading_to_the_supervisors():
    reading = {"window_s": 10.0, "host_busy_s": 15.0, "cores": 2,
               "by_process": {"worker-s0-r0": {"main": 4.0, "p2pd": 0.5, "children": 1.0}}}
    trainers = [{"name": "trainer-0", "process_cpu": {"main": 2.0, "p2pd": 0.25, "children": 0.75}},
                {"name": "trainer-1"}]  # a trainer that stopped before its run read nothing
    merged = _cpu_over_training(reading, trainers)
    assert merged["cpu_by_process"] == {"worker-s0-r0": {"main": 4.0, "p2pd": 0.5, "children": 1.0},
                                        "trainer-0": {"main": 2.0, "p2pd": 0.25, "children": 0.75}}
    assert merged["host_cpu"] == {"window_s": 10.0, "busy_s": 15.0, "cores": 2, "processes_s": 8.5}
    assert _cpu_over_training(None, trainers) == {"cpu_by_process": None, "host_cpu": None}


def test_the_summary_line_says_whose_cores_were_busy():
    host = {"window_s": 10.0, "busy_s": 18.0, "cores": 2, "processes_s": 16.0}
    by_process = {"worker-s0-r0": {"main": 6.0, "p2pd": 1.0, "children": 2.0},
                  "trainer-0": {"main": 3.0, "p2pd": 1.0, "children": 1.0}, "bootstrap": {"main": 0.0, "p2pd": 1.0,
                                                                                          "children": 1.0}}
    assert _cpu_line(host, by_process) == ("  host CPU over the training: 1.80 of 2 cores busy (workers 0.60, trainers "
                                           "0.30, every role's DHT processes and p2pd 0.70, the rest 0.20)")
