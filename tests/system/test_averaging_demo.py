"""`agora-node demo --replicas 2`: every worker averages with its stage's other replica, for real.

One short multi-process run (bootstrap, 2 stages x 2 workers, a trainer, each with its own DHT
and averager processes); the demo reaps them all and reports each stage's rounds by outcome
from the stats file every worker writes when it leaves.
"""

import json

import pytest

from agora.node.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_demo_with_two_replicas_reports_committed_rounds_per_stage(tmp_path):
    summary_path = tmp_path / "summary.json"
    code = main(["demo", "--stages", "2", "--replicas", "2", "--steps", "40", "--seed", "3",
                 "--workdir", str(tmp_path / "work"), "--summary-json", str(summary_path)])
    summary = json.loads(summary_path.read_text())
    assert code == 0 and summary["outcome"] == "completed" and summary["steps"] == 40
    assert set(summary["exit_codes"].values()) == {0}
    averaging = summary["averaging_by_stage"]
    assert sorted(averaging) == ["0", "1"]
    for stage in averaging.values():
        assert stage["method"] == "sparta" and stage["replicas_reporting"] == 2
        assert stage["rounds_by_outcome"]["committed"] >= 2  # each replica took part in at least one
        assert stage["rounds_by_outcome"]["failed"] == stage["rounds_by_outcome"]["rejected"] == 0
        assert stage["applied"] >= 2 and stage["bytes_sent"] > 0
        assert stage["local_steps"] == 2 * 40  # the shared epoch: each replica stepped once per global batch
        assert 0 <= stage["mean_lag_steps"] <= stage["max_lag_steps"]
    # Every round left its milestone line in the worker's log.
    logs = sorted((tmp_path / "work").glob("worker-s*-r*.log"))
    assert len(logs) == 4
    for log in logs:
        rounds = [line for line in log.read_text().splitlines() if "averaging round=" in line]
        assert any("outcome=committed" in line and "lag_steps=" in line for line in rounds), log.name
