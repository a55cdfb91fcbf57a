"""A short chaos run in CI: 2 stages x 2 replicas and 2 trainers, a random worker or trainer
killed -9 every few seconds and a newcomer started in its place; the run finishes,
every unit is committed and none lost, no process is left behind, and the held-out loss stays near the
same recipe trained in one process (the churned run against a fault-free one: bench/chaos.py)."""

from __future__ import annotations

import json
import re

import pytest

from agora.node.cli import main
from agora.node.demo.chaos import join_seconds
from agora.node.demo.demo import DemoOptions
from agora.node.demo.summary import churn_summary, merge_logs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 60  # with a kill every 8 s: several kills (40 batches took 24.5 s once, one kill)
RUN = ["--stages", "2", "--steps", str(STEPS), "--seed", "3"]
SWARM = ["--replicas", "2", "--trainers", "2", "--no-monitor"]
# The chaos run's held-out loss over the same recipe trained exactly in one process (train-local).
# The fault-free swarm itself sits 5-8% above it (two replicas, two trainers, asynchronous), and a
# kill every 8 s in a 2-stage run (each kill a quarter of the workers) adds several percent more
# (1.14 in all, measured); a stage that lost its state to churn (a newcomer's fresh weights averaged
# into a trained replica) ends near the untrained loss, twice the reference. The churned run against
# the fault-free one, to 3%, is a benchmark figure (bench/chaos.py): two asynchronous runs this
# short differ by several percent either way with the machine's timing, too noisy to gate CI on.
MAX_LOSS_OVER_LOCAL = 1.3


def test_a_chaos_run_finishes_with_every_unit_committed_and_the_loss_kept(tmp_path, capsys):
    assert main(["train-local", "--config", "tiny", *RUN]) == 0
    local_heldout = float(re.search(r"heldout=([0-9.]+)", capsys.readouterr().out).group(1))
    summary = tmp_path / "chaos.json"
    code = main(["demo", *RUN, *SWARM, "--chaos", "8", "--workdir", str(tmp_path / "chaos"),
                 "--summary-json", str(summary)])
    chaos = json.loads(summary.read_text())
    assert code == 0 and chaos["outcome"] == "completed"
    churn = chaos["churn"]
    assert churn["kills"] >= 2 and len(churn["joins"]) == churn["kills"]
    for join in churn["joins"]:  # a member holds the stage's state, so it had it first
        assert join["seconds_to_member"] is None or 0 < join["seconds_to_state"] <= join["seconds_to_member"], join
    assert churn["units"] == {"total": STEPS, "committed": STEPS, "lost": 0, "duplicated": churn["units"]["duplicated"]}
    # Every process still running at the end left cleanly; the killed ones are the only non-zeros.
    left = {name: code for name, code in chaos["exit_codes"].items() if name not in chaos["killed"]}
    assert set(left.values()) == {0}, left
    # Every worker here is honest: newcomers with fresh weights syncing, stages losing replicas and
    # averaging moving weights under the trainers' verifiers must not get one flagged.
    assert chaos["flagged"] == {}, chaos["flagged"]
    ratio = chaos["heldout_loss"] / local_heldout
    assert ratio < MAX_LOSS_OVER_LOCAL, (chaos["heldout_loss"], local_heldout, ratio)


@pytest.mark.timeout(240)
def test_a_newcomer_trainer_trains_for_what_is_left_of_the_runs_time_budget(tmp_path):
    # One replica per stage: chaos may kill only the trainer, so every kill is one. Had each
    # newcomer a whole budget of its own, a trainer killed every 3 s would never reach its end.
    summary = tmp_path / "summary.json"
    code = main(["demo", "--insecure", "--stages", "2", "--steps", "4000", "--time-budget", "8", "--chaos", "3",
                 "--seed", "1", "--no-monitor", "--workdir", str(tmp_path / "run"), "--summary-json", str(summary)])
    result = json.loads(summary.read_text())
    assert code == 0 and result["outcome"] == "completed", result
    events = result["churn"]["events"]
    assert events and {event["role"] for event in events} == {"trainer"}, events
    # The killed ones wrote nothing; the last newcomer ran to the end and says what it was given.
    last = json.loads((tmp_path / "run" / f"{events[-1]['replacement']}.summary.json").read_text())
    assert 0 < last["time_budget_s"] < 8.0, (last["time_budget_s"], events)


def test_under_a_time_budget_the_units_end_at_the_last_committed(tmp_path):
    lines = [{"step": step} for step in (1, 2, 4, 4, 5)]
    budgeted = churn_summary(DemoOptions(steps=4000, time_budget_s=30.0), lines, [], [], tmp_path, None)
    assert budgeted["units"] == {"total": 5, "committed": 4, "duplicated": 1, "lost": 1}
    by_steps = churn_summary(DemoOptions(steps=6), lines, [], [], tmp_path, None)
    assert by_steps["units"] == {"total": 6, "committed": 4, "duplicated": 1, "lost": 2}


def test_a_trainer_log_line_still_being_written_is_left_for_the_next_read(tmp_path):
    log = tmp_path / "trainer-0.jsonl"
    log.write_text('{"step": 2, "trainer": 0}\n{"step": 1, "trainer": 0}\n{"step": 3, "loss": 2.62925')
    assert [line["step"] for line in merge_logs([log, tmp_path / "absent.jsonl"])] == [1, 2]
    with log.open("a") as more:
        more.write('38}\n')
    assert [line["step"] for line in merge_logs([log])] == [1, 2, 3]


START = "2026-12-02 02:49:16,907"
SYNCED = [  # a newcomer's log lines as node/membership/phases.py, join.py and worker.py write them
    "2026-12-02 02:49:21,870 INFO agora.node.worker: stage 1/3 worker of run 'demo' serving on 10.77.0.13:38615",
    "2026-12-02 02:49:22,084 INFO agora.node.join: stage 1: phase weight_sync (the stage's members are at step 60, "
    "this replica at 0)",
    "weight sync (stage 1): 3.0/3.0 MiB step 61",
    "2026-12-02 02:49:23,573 INFO agora.node.join: stage 1: state downloaded from 10.77.0.5:33411 at step 61 "
    "(3145212 bytes in 0.98 s, 0 resumes)",
    "2026-12-02 02:49:23,585 INFO agora.node.join: joined run 'demo' as stage 1 at 10.77.0.13:38615 (peer Qm...)",
    "2026-12-02 02:49:59,000 INFO agora.node.join: stage 1: phase optimizer_sync (every one of the 4 slices averaged "
    "since the download)",
    "2026-12-02 02:49:59,001 INFO agora.node.worker: stage 1 worker: phase weight_sync -> optimizer_sync",
    "2026-12-02 02:50:10,500 INFO agora.node.worker: stage 1 worker: phase optimizer_sync -> member",
]


@pytest.mark.parametrize("lines, expected", [
    (SYNCED, (6.666, 53.593)),
    (SYNCED[:-1], (6.666, None)),  # still syncing at the end: serving ("joined run") is not membership
    (SYNCED[:2], (None, None)),  # killed before its download finished
    (["2026-12-02 02:49:20,000 INFO agora.node.join: stage 1: phase member (no other member of the stage announces "
      "itself: this replica is its state)"], (3.093, 3.093)),  # alone in its stage: its own state, member at once
    (["2026-12-02 02:49:20,000 INFO agora.node.join: stage 1: phase member (join --no-sync-phases)",
      "2026-12-02 02:49:21,000 INFO agora.node.join: stage 1: state downloaded from 10.77.0.5:1 at step 2"], (3.093, 3.093)),
])
def test_a_newcomers_seconds_to_state_and_to_member_are_read_from_its_log(tmp_path, lines, expected):
    from datetime import datetime

    log = tmp_path / "worker-s1-r1.j2.log"
    log.write_text("\n".join(lines) + "\n")
    state, member = join_seconds(log, datetime.strptime(START, "%Y-%m-%d %H:%M:%S,%f"))
    assert (state, member) == pytest.approx(expected)
    assert join_seconds(tmp_path / "absent.log", datetime.now()) == (None, None)


def test_the_summary_says_how_long_newcomers_took_and_how_many_never_became_members():
    from agora.node.demo.summary import format_summary

    summary = {"outcome": "completed", "steps": 10, "wall_s": 30.0, "mode": "async", "security": "admitted",
               "final_loss": 2.5, "heldout_loss": 2.6, "tokens_per_s": 1000.0, "churn": {
                   "kills": 3, "joins": [
                       {"name": "worker-s1-r1.j1", "seconds_to_state": 8.04, "seconds_to_member": 51.0},
                       {"name": "worker-s0-r0.j1", "seconds_to_state": 11.5, "seconds_to_member": None},
                       {"name": "trainer-0.j1", "seconds_to_state": None, "seconds_to_member": None}],
                   "units": {"total": 10, "committed": 10, "lost": 0, "duplicated": 0}}}
    churn = [line for line in format_summary(summary).splitlines() if "churn" in line]
    assert churn == ["  churn: 3 killed, 3 joined (the stage's state after 8.0-11.5 s; member after 51.0 s; 1 killed "
                     "or still syncing before member); units 10/10 committed, 0 lost, 0 run twice"]


def test_the_summary_says_how_many_global_batches_ran_a_second_time():
    from agora.node.demo.summary import format_summary

    summary = {"outcome": "completed", "steps": 40, "run_twice": 16, "wall_s": 180.0, "mode": "async",
               "security": "admitted", "final_loss": 3.3, "heldout_loss": 3.1, "tokens_per_s": 1000.0}
    assert format_summary(summary).splitlines()[0] == ("demo completed: 40 global batches (16 of them a second time) "
                                                       "in 180.0 s (async, admitted)")
    assert format_summary({**summary, "steps": 24, "run_twice": 0}).splitlines()[0] == \
        "demo completed: 24 global batches in 180.0 s (async, admitted)"


def test_the_summary_says_how_close_the_verifier_came_to_flagging_and_where():
    from agora.node.demo.summary import _peak_at, format_summary

    trainers = [{"verification": {"enabled": True, "threshold": 30.0,
                                  "peak_cusum": {"1/input_grad/QmAbcdefghij": 16.1, "0/output/QmZyxwvut": 0.6},
                                  "peak_feature": {"1/input_grad/QmAbcdefghij": "variation high",
                                                   "0/output/QmZyxwvut": "log_rms low"}}},
                {"verification": {"enabled": True, "threshold": 30.0,
                                  "peak_cusum": {"1/input_grad/QmAbcdefghij": 20.25}}}]  # a trainer without features
    assert _peak_at(trainers) == "1/input_grad/QmAbcdefghij"
    trainers[1]["verification"]["peak_feature"] = {"1/input_grad/QmAbcdefghij": "alignment low"}
    assert _peak_at(trainers) == "1/input_grad/QmAbcdefghij: alignment low"
    assert _peak_at([{"verification": {"enabled": False}}]) is None
    summary = {"outcome": "completed", "steps": 40, "wall_s": 50.0, "mode": "async", "security": "admitted",
               "final_loss": 3.3, "heldout_loss": 3.1, "tokens_per_s": 1000.0, "flagged": {},
               "verification_peak": 20.25, "verification_bar": 30.0, "verification_peak_at": _peak_at(trainers)}
    assert "  verifier: nobody flagged; the largest CUSUM 20.2 against its bar of 30 (stage 1 input_grad of " \
           "QmAbcdef, alignment low)" in format_summary(summary).splitlines()
    assert not [line for line in format_summary({**summary, "verification_peak": None}).splitlines()
                if "verifier" in line]
