"""Multi-process swarms on loopback: every role is a real `agora-node <role>` process.

These are the end-to-end tests of the product: the demo is the exact command set a user runs.
Children run one torch thread each (`--threads 1`), readiness is signalled by ready files, and
the demo reaps every process it started (checked below via the exit codes it reports).
"""

import json
from pathlib import Path

import pytest

from agora.node.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _demo(tmp_path, *flags):
    summary_path, log_path = tmp_path / "summary.json", tmp_path / "log.jsonl"
    code = main(["demo", "--workdir", str(tmp_path / "work"), "--summary-json", str(summary_path),
                 "--log-json", str(log_path), *flags])
    summary = json.loads(summary_path.read_text())
    lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    return code, summary, lines


def _report_counts(tmp_path) -> dict:
    """Each trainer's completed-batch reports failed, refused and sent again, from its summary line."""
    counts = {}
    for log in sorted((tmp_path / "work").glob("trainer-*.log")):
        last = json.loads(log.read_text().splitlines()[-1])
        counts[log.stem] = {key: last.get(key) for key in ("batch_reports_failed", "batch_reports_refused",
                                                           "batch_reports_retried")}
    return counts


def test_demo_sync_reproduces_train_local(tmp_path):
    flags = ["--config", "tiny", "--stages", "3", "--steps", "12", "--seed", "5"]
    assert main(["train-local", *flags, "--log-json", str(tmp_path / "local.jsonl")]) == 0
    local = [json.loads(line) for line in (tmp_path / "local.jsonl").read_text().splitlines()]
    code, summary, swarm = _demo(tmp_path, *flags, "--sync", "--no-monitor")
    assert code == 0 and summary["outcome"] == "completed"
    assert [line["step"] for line in swarm] == [line["step"] for line in local] == list(range(1, 13))
    for ours, reference in zip(swarm, local):
        assert ours["loss"] == reference["loss"]  # bit for bit: every stage accumulates in index order
        assert ours["tokens"] == reference["tokens"]
        assert ours["lr"] == pytest.approx(reference["lr"], rel=1e-9)
    assert set(summary["exit_codes"].values()) == {0}  # every role left cleanly on SIGTERM


def test_async_demo_two_replicas_two_trainers_lowers_the_loss_and_every_worker_averages(tmp_path):
    """2 stages x 2 replicas and 2 trainers: the loss falls, and every worker averages with its
    stage's other replica for real (its own DHT and averager processes), each stage's rounds by
    outcome read from the stats file every worker writes when it leaves."""
    steps = 40
    code, summary, lines = _demo(tmp_path, "--stages", "2", "--replicas", "2", "--trainers", "2",
                                 "--steps", str(steps), "--seed", "3", "--no-monitor")
    assert code == 0 and summary["outcome"] == "completed" and summary["steps"] == steps
    assert set(summary["exit_codes"].values()) == {0}
    assert sorted(line["step"] for line in lines) == list(range(1, steps + 1))
    assert {line["trainer"] for line in lines} == {0, 1}
    first = sum(line["loss"] for line in lines[:4]) / 4
    assert summary["final_loss"] < first - 0.5
    assert summary["heldout_loss"] < first
    assert summary["workers_per_stage"] == {"0": 2, "1": 2}
    averaging = summary["averaging_by_stage"]
    assert sorted(averaging) == ["0", "1"]
    # Every stage's jobs, from its replicas' stats: their wall time and the compute thread's CPU in them.
    compute = summary["compute_by_stage"]
    assert sorted(compute) == ["0", "1"]
    for stage in compute.values():
        assert stage["jobs"] > 0 and 0 < stage["compute_cpu_s"] <= stage["compute_s"] + 0.01, stage
        assert 0 < stage["cpu_share"] <= 1.01, stage
        # Its Steps (a report each batch, on each replica) and Aborts, timed apart on the same thread.
        assert stage["control_jobs"] >= 2 * steps and 0 < stage["control_cpu_s"] <= stage["control_s"] + 0.01, stage
    # Every role's processes over the training (each trainer read its own run), and the host's busy time beside.
    cpu, host = summary["cpu_by_process"], summary["host_cpu"]
    assert {f"worker-s{s}-r{r}" for s in (0, 1) for r in (0, 1)} | {"trainer-0", "trainer-1", "bootstrap"} <= set(cpu)
    for name in (n for n in cpu if n.startswith(("worker", "trainer"))):
        assert cpu[name]["main"] > 0 and cpu[name]["p2pd"] > 0 and cpu[name]["children"] > 0, (name, cpu[name])
    workers_s = sum(sum(parts.values()) for name, parts in cpu.items() if name.startswith("worker"))
    # The trainers' time outside calls holds their waits for credits and for the reports their replicas were owed.
    split = summary["trainer_split"]
    assert 0 <= split["credit_wait_ms"] + split["report_wait_ms"] <= split["outside_calls_ms"] + 1e-3, split
    assert 0 < host["window_s"] < summary["wall_s"] and host["busy_s"] >= 0.9 * workers_s, host
    for stage in averaging.values():
        assert stage["method"] == "sparta" and stage["replicas_reporting"] == 2
        assert stage["rounds_by_outcome"]["committed"] >= 2  # each replica took part in at least one
        assert stage["rounds_by_outcome"]["failed"] == stage["rounds_by_outcome"]["rejected"] == 0
        assert stage["applied"] >= 2 and stage["bytes_sent"] > 0
        # The shared epoch: each replica stepped once per global batch (a report a worker did not
        # answer is sent again; the trainers' counts of those say why a replica fell short).
        assert stage["local_steps"] == 2 * steps, _report_counts(tmp_path)
        assert 0 <= stage["mean_lag_steps"] <= stage["max_lag_steps"]
    # Every round left its milestone line in the worker's log.
    logs = sorted((tmp_path / "work").glob("worker-s*-r*.log"))
    assert len(logs) == 4
    for log in logs:
        rounds = [line for line in log.read_text().splitlines() if "averaging round=" in line]
        assert any("outcome=committed" in line and "lag_steps=" in line for line in rounds), log.name


def test_a_global_batch_of_32_microbatches_trains_within_the_workers_credits(tmp_path):
    """The report's batch shape scaled down (32 microbatches of one sequence per global batch),
    which ended the trainer with six busy answers before flow control: every batch completes, and
    a lone trainer keeping to its credits never meets a busy answer."""
    code, summary, lines = _demo(tmp_path, "--stages", "3", "--batch-size", "32", "--microbatches", "32",
                                 "--steps", "6", "--seed", "3", "--no-monitor")
    assert code == 0 and summary["outcome"] == "completed"
    assert [line["step"] for line in lines] == list(range(1, 7))
    assert (summary["busy_retries"], summary["reroutes"], summary["bans"]) == (0, 0, 0)
    # Training: a Forward on each stage and a Backward on the head and the body (the evaluation's
    # held-out Forwards are counted apart).
    assert summary["calls"] >= 6 * 32 * 5
    depth = summary["in_flight"][0]
    assert depth["credit_cap"] == 64 and all(credits >= 2 for credits in depth["stage_credits"])


def test_three_trainers_share_one_worker_per_stage_fairly(tmp_path):
    """Three admitted trainers (three caller identities) through one worker per stage, 16
    microbatches per global batch each: the workers share their queues out as credits, so every
    batch completes with no trainer failure, ban or reroute, and busy answers stay under 1% of calls.
    Trainers take each other's units once their own are done (work stealing), so one that starts a
    few seconds late under load may find the nine taken: at least two must have shared them."""
    code, summary, lines = _demo(tmp_path, "--stages", "2", "--trainers", "3", "--batch-size", "16",
                                 "--microbatches", "16", "--steps", "9", "--seed", "6", "--no-monitor")
    assert code == 0 and summary["outcome"] == "completed"
    assert sorted(line["step"] for line in lines) == list(range(1, 10))
    assert len({line["trainer"] for line in lines}) >= 2, lines
    assert set(summary["exit_codes"].values()) == {0}
    assert (summary["reroutes"], summary["bans"]) == (0, 0)
    assert summary["busy_share"] <= 0.01


def test_killed_worker_is_routed_around_and_the_run_finishes(tmp_path):
    code, summary, lines = _demo(tmp_path, "--stages", "2", "--replicas", "2", "--steps", "16",
                                 "--seed", "4", "--kill-worker-at", "4", "--no-monitor")
    assert code == 0 and summary["outcome"] == "completed"
    assert summary["killed"] == ["worker-s1-r0"]
    assert [line["step"] for line in lines] == list(range(1, 17))
    assert summary["exit_codes"]["worker-s1-r0"] != 0  # it was killed, not asked to leave
    # Routed around, not merely left alone: calls to it failed and their microbatches ran elsewhere
    # (equal shares send the next global batch's microbatches to both replicas, the dead one too).
    assert summary["reroutes"] >= 1
