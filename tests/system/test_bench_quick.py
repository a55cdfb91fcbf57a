"""`agora-bench --quick`: every row of the suite runs end to end and the table is written.

Its figures are not results (a few steps each, on a shared machine); what is checked is that
every row produced data (the WAN rows need root and iproute2: without them they must say so),
that the summary names all eight items and the fixes, and that no namespace is left behind.
"""

import json
import os

import pytest

from agora.bench.wan.topology import NAME_PREFIX, _namespaces, harness_available
from agora.bench.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_quick_suite_runs_every_row_and_writes_the_table(tmp_path):
    out, raw = tmp_path / "RESULTS.md", tmp_path / "raw.json"
    code = main(["--quick", "--out", str(out), "--json", str(raw),
                 "--workdir", str(tmp_path / "work")])
    results = json.loads(raw.read_text())
    errors = {number: item["error"] for number, item in results["items"].items() if item.get("error")}
    if harness_available() is None:
        assert errors == {}
    else:  # no root here: the WAN rows say why they were not measured, the others ran
        assert set(errors) == {"3", "4", "7"} and all(e.startswith("not measured") for e in errors.values())
    assert code == 0
    table = out.read_text()
    if harness_available() is None:
        assert "| 3 |" in table and "| 4 |" in table and "## 7. Joining" in table
        assert results["items"]["7"]["data"]["profiles"]["agora-floor"]["kills"] >= 1
    assert "| 7 | join" in table
    for row in ("| 1 |", "| 2 |", "| 5 |", "| 6 |", "| 8 | one stage on a GPU", "| F1 |", "| F5 |"):
        assert row in table
    assert "## Closing note" in table
    if harness_available() is None:  # one run of row 3 measured again into the record, the rest kept
        before = json.loads(raw.read_text())
        assert main(["--row", "3", "--update", str(raw), "--run", "lan/tiny x1 adaptive", "--out", str(out),
                     "--workdir", str(tmp_path / "again")]) == 0
        after = json.loads(raw.read_text())
        rerun, = after["items"]["3"]["reruns"]
        assert rerun["runs"] == ["lan/tiny x1 adaptive"] and rerun["sessions"]["lan"]["links"]
        run, = after["items"]["3"]["data"]["profiles"]["lan"]["runs"]["tiny x1 adaptive"]
        assert run["rerun"] == {key: rerun[key] for key in ("command", "commit", "date", "load", "wall_s")}
        assert run["tokens_per_s"] > 0 and run["code"] == 0
        assert {n: i for n, i in after["items"].items() if n != "3"} == {
            n: i for n, i in before["items"].items() if n != "3"}
        assert "row 3's lan/tiny x1 adaptive on" in out.read_text()
    assert not [name for name in _namespaces() if name.startswith(f"{NAME_PREFIX}{os.getpid()}-")]


def test_the_join_row_shows_a_newcomer_that_never_became_a_member_and_missing_figures():
    from agora.bench.suite_report import _joins

    row = {"chaos_s": 15.0, "time_budget_s": 40.0, "profiles": {
        "lan": {"kills": 2, "worker_joins_s": [3.25, None], "worker_states_s": [1.5, 2.5],
                "units": {"committed": 9, "lost": 0, "duplicated": 1},
                "load": [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], "outcome": "completed"},
        "agora-floor": {"kills": None, "worker_joins_s": [], "worker_states_s": [], "units": None, "outcome": "failed"},
        "residential": {"kills": 1, "worker_joins_s": [4.0], "units": None, "outcome": "completed"}}}  # recorded before states
    lines, shown = _joins(row)
    assert "| lan | 2 | 1.5, 2.5 | 2.0 | 3.2, never | 3.2 | 9 / 0 / 1 | completed | 1.0->2.0 |" in lines
    assert "| agora-floor | - | - | - | - | - | - / - / - | failed |  |" in lines
    assert "| residential | 1 | - | - | 4.0 | 4.0 | - / - / - | completed |  |" in lines
    assert shown == ("lan: state 2.0 s, member 3.2 s (1 of 2 never a member); agora-floor: state -, member -; "
                     "residential: member 4.0 s")


def test_row_3_runs_lan_with_two_replicas_when_a_straggler_profile_needs_the_reference():
    from agora.bench.suite import plan_for
    from agora.bench.suite_items import profile_runs

    full = {name: (tuned, replicas, depth) for name, tuned, replicas, depth in profile_runs(plan_for(False))
            if not tuned}
    assert full["lan"][1] == [1, 2] and full["straggler"][1] == [2] and full["agora-floor"][1] == [1]
    assert full["lan"][2] == ("adaptive", "half a batch", "adaptive, staleness 4")
    assert full["residential"][2] == ("adaptive",)
    without = profile_runs(plan_for(False, profiles=["lan", "agora-floor"]))
    assert [(name, replicas) for name, _, replicas, _ in without] == [("lan", [1]), ("agora-floor", [1]),
                                                                     ("agora-floor", [1])]


def test_rows_2_and_3_carry_the_wide_and_the_report_shape():
    from agora.bench.suite import plan_for
    from agora.bench.suite_items import shapes, wide_key, wide_runs

    plan = plan_for(False)
    labels = [(s.label, s.flags(), s.local_steps) for s in shapes(plan)]
    assert labels[:2] == [("tiny", [], 120), ("small", [], 16)]
    assert labels[2:] == [("tiny wide", ["--batch-size", "32", "--microbatches", "32"], 24),
                          ("small wide", ["--batch-size", "32", "--microbatches", "32"], 6),
                          ("tiny report shape", ["--batch-size", "256", "--microbatches", "256"], 3)]
    keys = {profile: [wide_key(shape, n) for shape, n in wide_runs(plan, profile)]
            for profile in ("lan", "residential", "intercontinental")}
    assert keys["lan"] == ["tiny wide x1 adaptive", "tiny wide x1 adaptive, 2 trainers",
                           "tiny wide x1 adaptive, 4 trainers", "small wide x1 adaptive",
                           "tiny report shape x1 adaptive"]
    assert keys["residential"] == keys["lan"][:-1]
    assert keys["intercontinental"] == ["tiny wide x1 adaptive", "small wide x1 adaptive"]


def test_the_wide_goals_and_what_limits_a_missed_one_come_from_the_runs():
    from agora.bench.wan_report import wide_goals

    def run(rate, busy=0, calls=1000, wire=5.0):
        return {"tokens_per_s": rate, "heldout_loss": 3.0, "busy_retries": busy, "calls": calls,
                "time_split_by_stage": {"0": {"calls": 10, "round_trip_ms": 30.0, "compute_ms": 10.0, "queued_ms": 5.0,
                                              "wire_ms": wire, "credit_wait_ms": 2.0}},
                "in_flight": [{"last": 9, "max": 12, "cap": 32, "credit_cap": 64, "stage_credits": [10],
                               "latency_ms": 700.0, "stage_compute_ms": [40.0]}]}
    row = {"profiles": {
        "lan": {"runs": {"tiny x1 adaptive": [run(4000)], "tiny wide x1 adaptive": [run(2000)],
                         "tiny wide x1 adaptive, 4 trainers": [run(1800)]}},
        "agora-floor": {"runs": {"tiny x1 adaptive": [run(1000)], "tiny wide x1 adaptive": [run(1900, wire=90.0)],
                                 "tiny wide x1 adaptive, 4 trainers": [run(1500, busy=5, wire=95.0)]}},
        "residential": {"runs": {"tiny wide x1 adaptive": [run(1700)]}}}}
    local = {"tiny wide": {"runs": {"train-local": [{"tokens_per_s": 3000}], "async": [run(1900, busy=2)]}}}
    rows, notes = wide_goals(row, local)
    assert rows[0] == ("| 3 | many microbatches per batch: tokens/s at agora-floor / the same run on lan | tiny wide x1 "
                       "adaptive: 0.950; tiny wide x1 adaptive, 4 trainers: 0.833 | >= 0.9 (wide) | no |")
    assert rows[1].endswith("| tiny wide x1 adaptive: 0.850 | >= 0.8 (wide) | yes |")
    # Busy answers over every call made in the many-microbatch runs of both rows: 7 of 6,007.
    assert rows[2] == "| 3 | busy answers / calls made, every many-microbatch run of rows 2 and 3 | 0.117% (7 of 6,007) | <= 1% | yes |"
    assert len(notes) == 1 and notes[0].startswith("tiny wide x1 adaptive, 4 trainers at agora-floor: 0.833 of lan")
    assert "stage 0 10 compute + 5 queued + 95 wire, 2 waiting for credit" in notes[0]
    assert "9/12, 32 (credits 64; 10)" in notes[0]
