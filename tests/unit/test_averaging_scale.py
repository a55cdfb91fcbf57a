"""bench/averaging_scale.py's pure part: the replicas' reports summed into one row of the table."""

import math

from agora.bench.averaging_scale import Pace, aggregate, percentile, report

PACE = Pace(rounds=3, step_s=0.5, every_steps=4, matchmaking_s=2.0)


def replica(rounds, skipped=0):
    """A replica's report: its round rows, and the loop's counts of them as the stats give them."""
    by_outcome = {name: 0 for name in ("committed", "alone", "failed", "rejected", "cancelled")}
    rows = []
    for number, (outcome, group, formation, duration) in enumerate(rounds, start=1):
        by_outcome[outcome] += 1
        rows.append({"round": number, "outcome": outcome, "group_size": group, "formation_s": formation,
                     "duration_s": duration, "received_fraction": 1.0, "error": None})
    return {"rounds": rows, "stats": {"rounds_by_outcome": by_outcome, "skipped": skipped}}


def test_percentile_is_the_nearest_rank_and_nan_for_nothing():
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.95) == 4.0
    assert percentile([5.0], 0.95) == 5.0
    assert math.isnan(percentile([], 0.5))


def test_outcomes_ratios_groups_and_times_over_every_replica():
    reports = [
        replica([("committed", 3, 0.2, 0.5), ("committed", 3, 0.4, 0.7), ("alone", 0, None, 2.1)]),
        replica([("committed", 3, 0.3, 0.6), ("committed", 2, 2.5, 2.9)], skipped=1),
        replica([("committed", 3, 0.1, 0.4), ("failed", 0, None, 4.0), ("committed", 2, 1.0, 1.5)]),
    ]
    row = aggregate(3, reports, PACE)
    assert row.reported == 3 and row.rounds_due == 3
    assert row.outcomes == {"committed": 6, "alone": 1, "failed": 1, "rejected": 0, "cancelled": 0}
    assert row.attempted_per_replica == 8 / 3 and row.attempted_min == 2 and row.skipped == 1
    assert row.success_ratio == 6 / 8 and row.committed_of_due == 6 / 9
    assert row.group_mean == 16 / 6 and row.full_group_ratio == 4 / 6
    # Formation only where a group formed; one of six took longer than the 2 s window.
    assert row.formation_p50_s == 0.3 and row.formation_p95_s == 2.5 and row.formed_in_window_ratio == 5 / 6
    assert row.duration_p50_s == 0.7 and row.duration_p95_s == 4.0  # every attempted round
    assert row.matchmaking_s == 2.0 and row.round_every_s == 2.0


def test_each_start_is_set_behind_the_first_start_of_its_round():
    reports = [replica([("committed", 3, 0.2, 0.5), ("committed", 3, 0.4, 0.7)]) for _ in range(3)]
    for report_, starts in zip(reports, ((6.10, 14.30), (6.16, 14.10), (6.40, 14.12))):
        for row, start in zip(report_["rounds"], starts):
            row["started_s"] = start
    reports[2]["rounds"].append({**reports[2]["rounds"][1], "round": 3, "started_s": 22.5})  # alone: no spread
    row = aggregate(3, reports, PACE)
    assert sorted(row.start_offsets_s) == [0.0, 0.0, 0.02, 0.06, 0.2, 0.3]
    assert row.start_offset_p50_s == 0.02 and row.start_offset_p95_s == 0.3
    # Reports recorded before starts were leave the figures out, not wrong.
    assert math.isnan(aggregate(3, [replica([("committed", 3, 0.2, 0.5)])] * 3, PACE).start_offset_p50_s)


def test_each_replicas_own_dht_requests_are_counted_per_replica_and_round_due():
    reports = [replica([("committed", 2, 0.2, 0.5)]) for _ in range(3)]
    reports[0]["dht_requests"] = {"get rounds": 24, "store workers": 6}
    reports[1]["dht_requests"] = {"get rounds": 30, "store rounds": 3}
    row = aggregate(3, reports, PACE)  # the third replica's report came from before the counts were kept
    assert row.dht_requests_per_round == {"get rounds": 9.0, "store rounds": 0.5, "store workers": 1.0}
    assert aggregate(3, [replica([("committed", 2, 0.2, 0.5)])] * 3, PACE).dht_requests_per_round == {}


def test_a_window_without_a_formed_group_gives_nan_figures_not_an_error():
    row = aggregate(2, [replica([("alone", 0, None, 2.0)]), replica([("alone", 0, None, 2.0)])], PACE)
    assert row.success_ratio == 0.0 and math.isnan(row.group_mean) and math.isnan(row.formation_p50_s)
    assert "| 2 |" in report([row], PACE, "python bench/averaging_scale.py") and "| - |" in report([row], PACE, "x")


def test_the_table_has_a_row_per_r_and_a_growth_row():
    rows = [aggregate(r, [replica([("committed", r, 0.1 * r, 0.2 * r)] * 3)] * r, PACE) for r in (2, 4, 8)]
    for row in rows:
        row.load_start = row.load_end = 1.0
        row.startup_s = row.pss_mib_per_replica = 10.0
    table = report(rows, PACE, "python bench/averaging_scale.py --replicas 2 4 8")
    lines = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()
             if line.startswith("| ")]
    header, body = lines[0], lines[1:]
    assert [cells[0] for cells in body] == ["2", "4", "8", "growth"]
    fitted = dict(zip(header, body[-1]))
    # Formation and round times grow as R in these reports; the rounds attempted stay 3.
    assert fitted["formation p50 s"] == "R" and fitted["round p50 s"] == "R"
    assert fitted["attempted / replica"] == "constant"


def test_the_results_row_judges_the_largest_r_against_the_goal(tmp_path):
    import dataclasses
    import json

    from agora.bench.averaging_scale import summary_row

    path = tmp_path / "averaging_scale.json"
    assert "not measured" in summary_row(path)
    rows = [aggregate(r, [replica([("committed", r, 0.1 * r, 0.2 * r)] * 3)] * r, PACE) for r in (2, 16)]
    path.write_text(json.dumps([dataclasses.asdict(row) for row in rows]))
    row = summary_row(path)
    assert "R=16: 100% of attempted rounds committed" in row and "R=2/16: 0.20, 1.60 s" in row
    assert row.endswith("| yes |")
    late = dataclasses.replace(rows[-1], formation_p95_s=2.5, formed_in_window_ratio=0.9)  # past PACE's 2 s window
    path.write_text(json.dumps([dataclasses.asdict(row) for row in (rows[0], late)]))
    assert summary_row(path).endswith("| no |")


def test_results_md_gets_the_table_per_r_from_the_last_run(tmp_path):
    import dataclasses
    import json

    from agora.bench.averaging_scale import section

    path = tmp_path / "averaging_scale.json"
    assert section(path) == []
    rows = [aggregate(r, [replica([("committed", r, 0.1 * r, 0.2 * r)] * 3)] * r, PACE) for r in (2, 4, 8)]
    path.write_text(json.dumps([dataclasses.asdict(row) for row in rows]))
    lines = section(path)
    assert lines[0].startswith("## 11. ")
    assert [line.split(" | ")[0] for line in lines if line.startswith("| ")][1:] == ["| 2", "| 4", "| 8", "| growth"]
