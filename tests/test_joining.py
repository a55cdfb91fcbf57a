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
    steps = 150
    # The joiner is started after 10 global batches; starting a process (admission, DHT) takes a
    # few seconds, so it arrives some tens of batches later, which its log says.
    code = main(["demo", "--stages", "2", "--replicas", "1", "--steps", str(steps), "--seed", "1", "--join-at", "10",
                 "--averaging-every", "2", "--averaging-fraction", "0.5", "--optimizer-sync-steps", "8",
                 "--no-monitor", "--workdir", str(work), "--summary-json", str(summary_path),
                 "--log-json", str(log_path)])
    summary = json.loads(summary_path.read_text())
    assert code == 0 and summary["outcome"] == "completed" and summary["steps"] == steps
    assert set(summary["exit_codes"].values()) == {0}

    # The original replicas were members from the start; the joiner went through both sync phases.
    phases = summary["phases_by_worker"]
    assert [phase for phase, _ in phases["worker-s0-r0"]] == ["member"]
    joiner = phases["worker-s0-r1"]
    assert [phase for phase, _ in joiner] == ["weight_sync", "optimizer_sync", "member"], joiner
    assert joiner[0][1] <= joiner[1][1] <= joiner[2][1]

    log = (work / "worker-s0-r1.log").read_text()
    arrived = int(re.search(r"phase weight_sync \(the stage's members are at step (\d+)", log).group(1))
    downloaded = re.search(r"state downloaded from \S+ at step (\d+) \((\d+) bytes", log)
    assert downloaded and int(downloaded.group(1)) >= arrived > 0 and int(downloaded.group(2)) > 0
    assert arrived + 40 < steps, "the joiner arrived too late to watch it take traffic"
    # Weight sync and optimizer sync averaged with weight 0: the member's reducer counted it as syncing.
    rounds = [line for line in log.splitlines() if "averaging round=" in line]
    assert any("rejected=syncing:1" in line for line in rounds)
    # The donor served the download.
    donor = json.loads((work / "worker-s0-r0.stats.json").read_text())["state_served"]
    assert donor["completed"] >= 1 and donor["bytes"] >= int(downloaded.group(2))

    # The run's loss did not jump when the joiner started taking traffic.
    losses = {record["step"]: record["loss"] for record in map(json.loads, log_path.read_text().splitlines())}
    before = [losses[s] for s in range(arrived - 10, arrived)]
    after = [losses[s] for s in range(arrived, arrived + 40)]
    assert sum(after) / 40 < sum(before) / 10 * 1.05, (before, after)
