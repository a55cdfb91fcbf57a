"""bench/dht_scale.py for real at N = 4: admitted DHT peers in namespaces behind the relay play their
roles' traffic, real figures come back for every peer, the monitor's polls and the newcomer's steps
are timed, and nothing is left behind (needs root)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agora.bench.wan.topology import NAME_PREFIX, _namespaces, harness_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150),
              pytest.mark.skipif(harness_available() is not None, reason=str(harness_available()))]

ROOT = Path(__file__).resolve().parents[2]


def test_four_admitted_peers_report_real_figures_and_leave_no_namespace(tmp_path):
    out = tmp_path / "dht_scale.md"
    harness = subprocess.Popen([sys.executable, str(ROOT / "bench" / "dht_scale.py"), "--nodes", "4", "--dilation", "4",
                                "--rest", "3", "--warmup", "4", "--window", "8", "--workdir", str(tmp_path / "work"),
                                "--settle-load", "0",  # the suite's own load never settles: start at once
                                "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = harness.communicate(timeout=140)
    finally:
        if harness.poll() is None:
            harness.kill()
    assert harness.returncode == 0, stderr[-3000:]
    assert not [name for name in _namespaces() if name.startswith(f"{NAME_PREFIX}{harness.pid}-")]
    recorded = json.loads(out.with_suffix(".json").read_text())
    [row], failed = recorded["rows"], recorded["failed"]
    assert failed == []
    assert row["nodes"] == 4 and row["peers_answered"] == 4  # every role peer's requests came back
    assert row["kib_per_node_min"] > 0 and row["bootstrap_kib_min"] > 0  # bytes on every namespace's eth0
    assert row["cpu_s_per_node_min"] > 0 and row["pss_mib_per_node"] > 0
    assert 0 < row["get_p50_ms"] <= row["get_p95_ms"] and 0 < row["store_p50_ms"] <= row["store_p95_ms"]
    assert {"get units", "store units", "get rounds"} <= set(row["by_family"])
    assert "| 4 | 3x1 + 1t |" in out.read_text()
    assert row["monitor_polls"] >= 1 and 0 < row["monitor_poll_p50_s"] <= row["monitor_poll_p95_s"] < 10
    assert row["monitor_kib_min"] > 0 and row["roster_reads_per_trainer_s"] > 0
    # the newcomer joined, found stage 0's one worker as its donor, and the monitor read its record, in order
    assert row["newcomer_donors"] == 1
    assert 0 < row["newcomer_joined_s"] < row["newcomer_donor_s"] < row["newcomer_visible_s"] < 60
