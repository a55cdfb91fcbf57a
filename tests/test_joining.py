"""A replica joining mid-run, as real processes: `agora-node demo --join-at` starts a new contributor
(its own identity, an empty state directory, admitted by the run's authorizer) for stage 0 while
the run trains. It must go weight_sync -> optimizer_sync -> member, downloading the stage's state
from the live member over mutual TLS, and the run's loss must not jump when it starts taking
traffic (a fresh replica routed at once would put initial weights on the route).
"""

import json
import re

import pytest

from agora.node.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_replica_joining_mid_run_syncs_before_it_counts_and_the_loss_does_not_jump(tmp_path):
    work, summary_path, log_path = tmp_path / "work", tmp_path / "summary.json", tmp_path / "log.jsonl"
    join_at = 30
    code = main(["demo", "--stages", "2", "--replicas", "1", "--steps", "110", "--seed", "1", "--join-at", str(join_at),
                 "--averaging-every", "2", "--averaging-fraction", "0.5", "--optimizer-sync-steps", "8",
                 "--no-monitor", "--workdir", str(work), "--summary-json", str(summary_path),
                 "--log-json", str(log_path)])
    summary = json.loads(summary_path.read_text())
    assert code == 0 and summary["outcome"] == "completed" and summary["steps"] == 110
    assert set(summary["exit_codes"].values()) == {0}

    # The original replicas were members from the start; the joiner went through both sync phases.
    phases = summary["phases_by_worker"]
    assert phases["worker-s0-r0"] == [["member", phases["worker-s0-r0"][0][1]]]
    joiner = phases["worker-s0-r1"]
    assert [phase for phase, _ in joiner] == ["weight_sync", "optimizer_sync", "member"]
    assert joiner[0][1] <= joiner[1][1] <= joiner[2][1]

    log = (work / "worker-s0-r1.log").read_text()
    downloaded = re.search(r"state downloaded from \S+ at step (\d+) \((\d+) bytes", log)
    assert downloaded and int(downloaded.group(1)) >= join_at // 2 and int(downloaded.group(2)) > 0
    assert "every one of the 2 slices averaged since the download" in log
    # Weight sync and optimizer sync averaged with weight 0: the member's reducer counted it as syncing.
    rounds = [line for line in log.splitlines() if "averaging round=" in line]
    assert any("rejected=syncing:1" in line for line in rounds)
    # The donor served the download.
    donor = json.loads((work / "worker-s0-r0.stats.json").read_text())["state_served"]
    assert donor["completed"] >= 1 and donor["bytes"] >= int(downloaded.group(2))

    # The run's loss did not jump when the joiner started taking traffic.
    losses = [json.loads(line)["loss"] for line in log_path.read_text().splitlines()]
    before = sum(losses[join_at - 10:join_at]) / 10
    after = sum(losses[join_at:join_at + 40]) / 40
    assert after < before * 1.05, (before, after)
