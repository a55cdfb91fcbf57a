"""`agora-bench --row 3 --update F --run PROFILE/RUN`: which runs row 3 has, what a wrong --run says,
and how runs measured again are spliced into the recorded row (the WAN runs themselves:
tests/system/test_bench_quick.py)."""

import json
from dataclasses import asdict

import pytest

from agora.bench.cli import main
from agora.bench.suite import plan_for, splice_runs
from agora.bench.suite_items import row3_run_names, row3_sessions
from agora.bench.suite_report import measured_again


def test_row_3_names_every_run_of_every_session_once():
    names = row3_run_names(plan_for(False))
    assert len(names) == len(set(names))
    for name in ("lan/tiny x1 adaptive", "lan/tiny x2 adaptive", "lan/tiny report shape x1 adaptive",
                 "agora-floor/small x1 adaptive, staleness 4", "agora-floor (tuned hosts)/small x1 half a batch",
                 "residential/tiny wide x1 adaptive, 4 trainers", "straggler/tiny x2 adaptive"):
        assert name in names
    assert "residential/tiny x1 half a batch" not in names  # the depth variants run on lan and agora-floor
    assert "agora-floor (tuned hosts)/tiny wide x1 adaptive" not in names  # no wide shape on tuned hosts
    lan = row3_sessions(plan_for(False))[0]
    assert (lan.label, lan.widest.replicas, lan.widest.trainers) == ("lan", 2, 4)


def test_the_quick_plan_runs_one_run_on_lan():
    assert row3_run_names(plan_for(True)) == ["lan/tiny x1 adaptive"]


@pytest.fixture
def recorded(tmp_path):
    path = tmp_path / "suite.json"
    path.write_text(json.dumps({"command": "agora-bench", "commit": "abc1234", "date": "2026-12-01 10:00",
                                "quick": False, "plan": asdict(plan_for(False)), "machine": {}, "items": {}}))
    return path


@pytest.mark.parametrize("argv, message", [
    (["--run", "lan/tiny x1 adaptive"], "--run: measures runs of row 3 again into a recorded run"),
    (["--row", "3", "--row", "4", "--run", "lan/tiny x1 adaptive", "--update", "{F}"], "give --row 3 --update F"),
    (["--row", "3", "--run", "lan/tiny x9 adaptive", "--update", "{F}"],
     "--run 'lan/tiny x9 adaptive': not a run of row 3 in"),
])
def test_a_wrong_run_is_one_line_and_exit_2(recorded, capsys, argv, message):
    assert main([arg.replace("{F}", str(recorded)) for arg in argv]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
    if "not a run" in message:
        assert "lan/tiny report shape x1 adaptive" in error  # the runs it could have named


def _run(rate: float) -> dict:
    return {"tokens_per_s": rate, "heldout_loss": 3.0, "load": [[0.1, 0.1, 0.1], [1.0, 1.0, 1.0]], "code": 0}


def test_runs_measured_again_replace_theirs_and_keep_the_rest():
    recorded = {"data": {"profiles": {"lan": {"links": ["lan's"], "runs": {"tiny x1 adaptive": [_run(1000.0)],
                                                                          "small x1 adaptive": [_run(500.0)]}},
                                      "agora-floor": {"runs": {"tiny x1 adaptive": [_run(400.0)]}}}},
                "rerun": {"command": "agora-bench --row 3", "commit": "0123abc", "date": "2026-12-02 10:00",
                          "load": [0.1, 0.3]}}
    stamp = {"command": "agora-bench --row 3 --run lan/tiny x1 adaptive", "commit": "def5678",
             "date": "2026-12-06 04:00", "load": [0.2, 1.5]}
    measured = {"profiles": {"lan": {"links": ["again"], "relay": {"frames": 3},
                                     "runs": {"tiny x1 adaptive": [_run(1200.0)]}}}}
    splice_runs(recorded, measured, stamp)
    lan = recorded["data"]["profiles"]["lan"]
    assert lan["runs"]["tiny x1 adaptive"] == [{**_run(1200.0), "rerun": stamp}]
    assert lan["runs"]["small x1 adaptive"] == [_run(500.0)] and lan["links"] == ["lan's"]
    assert recorded["data"]["profiles"]["agora-floor"]["runs"]["tiny x1 adaptive"] == [_run(400.0)]
    assert recorded["rerun"]["date"] == "2026-12-02 10:00"  # the row's own run, as it was
    assert recorded["reruns"] == [{**stamp, "runs": ["lan/tiny x1 adaptive"],
                                   "sessions": {"lan": {"links": ["again"], "relay": {"frames": 3}}}}]
    assert measured_again({"3": recorded}) == [
        "row 3 on 2026-12-02 10:00, commit 0123abc (`agora-bench --row 3`, load 0.1->0.3)",
        "row 3's lan/tiny x1 adaptive on 2026-12-06 04:00, commit def5678 (`agora-bench --row 3 --run "
        "lan/tiny x1 adaptive`, load 0.2->1.5)"]


def test_a_ratio_of_runs_from_different_sessions_is_marked_and_counts_for_no_goal():
    """Runs measured again replace only themselves, so a profile's run and lan's same run can come from
    sessions hours apart, when this host's speed was not the same (lan tiny x1's compute per call 25 ms
    one morning, 39 ms at noon): such a ratio is marked, and a goal is judged on the pairs measured together."""
    from agora.bench.wan_report import section, wide_goals

    stamp = {"command": "agora-bench --row 3 --run ...", "commit": "def5678", "date": "2026-12-07 11:30", "load": [1.6]}
    again = lambda rate: {**_run(rate), "rerun": stamp}  # noqa: E731
    row = {"profiles": {
        "lan": {"links": [], "runs": {"tiny wide x1 adaptive": [again(2000.0)], "small wide x1 adaptive": [again(800.0)]}},
        "agora-floor": {"links": [], "runs": {"tiny wide x1 adaptive": [again(1900.0)],
                                              "small wide x1 adaptive": [_run(400.0)]}}}}
    lines, ratios = section(row)
    assert ratios[("agora-floor", "tiny wide x1 adaptive")] == (0.95, False)
    assert ratios[("agora-floor", "small wide x1 adaptive")] == (0.5, True)
    assert any("| agora-floor | small wide x1 adaptive | 400 | 0.500 (sessions apart) |" in line for line in lines)
    rows, notes = wide_goals(row, None)
    floor, = [line for line in rows if "at agora-floor" in line]
    assert "tiny wide x1 adaptive: 0.950; small wide x1 adaptive: 0.500 (sessions apart)" in floor
    assert floor.endswith("| >= 0.9 (wide) | yes |") and notes == []
