"""bench/dht_scale.py's pure parts: the peers of a geometry, one N's figures from its peers' request
logs and counters, the goals, and the table."""

import dataclasses
import json
import math

import pytest

from agora.bench.dht_scale import PeerSpec, Reading, peer_specs, usage_between
from agora.bench.dht_scale_report import (Call, Newcomer, PeerUsage, figures, goals, plot, quantile, read_calls,
                                          read_errors, read_polls, read_traffic, carried_between, received_table,
                                          report, sent_table)
from agora.bench.dht_traffic import Dilation
from agora.bench.many_nodes import geometry_for

WINDOW = (1000.0, 1100.0)  # 100 real seconds


def test_the_peers_of_a_geometry_are_its_workers_then_its_trainers():
    specs = peer_specs(geometry_for(8, 3))
    assert [s.name for s in specs[:3]] == ["worker-s0-r0", "worker-s1-r0", "worker-s2-r0"]
    assert sum(s.role == "worker" for s in specs) == 6 and specs[-1] == PeerSpec("trainer-1", "trainer",
                                                                                 trainer_index=1)


def test_quantiles_interpolate_between_ranks():
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([0.0, 10.0], 0.95) == pytest.approx(9.5)
    assert math.isnan(quantile([], 0.5))


def _calls(count: int, operation: str, family: str, seconds: float, start: float = 1000.0) -> list[Call]:
    return [Call(start + 1 + i, operation, family, seconds, False) for i in range(count)]


def _figures(**overrides):
    calls = {"a": _calls(20, "get", "units", 0.1) + _calls(10, "store", "workers", 0.3)
             + [Call(990.0, "get", "units", 9.0, False), Call(1050.0, "get", "rounds", 5.0, True)],
             "b": _calls(10, "get", "units", 0.2), "bootstrap": _calls(5, "call", "bans", 0.01)}
    usage = {"a": PeerUsage(idle_bytes=1000, window_bytes=30_000, idle_cpu_s=1.0, window_cpu_s=12.0, pss_mib=80.0),
             "b": PeerUsage(idle_bytes=1000, window_bytes=10_000, idle_cpu_s=1.0, window_cpu_s=6.0, pss_mib=60.0),
             "bootstrap": PeerUsage(idle_bytes=0, window_bytes=102_400, window_cpu_s=1.0)}
    arguments = dict(nodes=2, geometry="1x1 + 1t", profile="lan", dilation=Dilation(4), calls=calls, usage=usage,
                     bootstrap="bootstrap", window=WINDOW, idle_s=10.0, loads=(0.5, 1.5))
    return figures(**{**arguments, **overrides})


def test_one_ns_figures_come_from_the_role_peers_requests_inside_the_window():
    row = _figures()
    assert row.peers_answered == 2 and row.failures == 1  # the request before the window is not counted
    assert row.get_p50_ms == pytest.approx(100.0) and row.store_p95_ms == pytest.approx(300.0)
    # 41 requests over 2 peers in 100 real s = 25 logical s at K=4
    assert row.requests_per_node_min == pytest.approx(41 / 2 / 25 * 60)
    assert row.by_family["get units"]["per_node_min"] == pytest.approx(30 / 2 / 25 * 60, abs=1e-3)
    assert "call bans" not in row.by_family  # the bootstrap's are its own
    assert row.pss_mib_per_node == 70.0 and not row.loaded


def test_bytes_and_cpu_are_the_rest_background_plus_k_times_the_traffic_per_logical_minute():
    row = _figures()
    # peer a: 100 B/s at rest, 300 B/s in the window -> (200 x 4 + 100) x 60; b: (0 x 4 + 100) x 60
    assert row.kib_per_node_min == pytest.approx(((200 * 4 + 100) * 60 + 100 * 60) / 2 / 1024)
    # a: 0.1 s/s at rest, 0.12 in the window; b: 0.1 and 0.06 (below rest: its traffic counts nothing)
    assert row.cpu_s_per_node_min == pytest.approx(((0.02 * 4 + 0.1) * 60 + 0.1 * 60) / 2)
    assert row.cpu_s_per_node_real_min == pytest.approx(18.0 / 2 / 100 * 60)
    assert row.rest_cpu_s_per_node_min == pytest.approx(6.0) and row.rest_kib_per_node_min == pytest.approx(6000 / 1024)
    assert row.bootstrap_kib_min == pytest.approx(1024 * 4 * 60 / 1024)


def test_a_peer_without_a_request_in_the_window_did_not_answer():
    row = _figures(calls={"a": _calls(3, "get", "units", 0.1)})
    assert row.peers_answered == 1 and math.isnan(row.store_p50_ms)


def test_usage_between_two_readings_at_rest_and_two_in_the_window():
    def reading(wall, counters, cpu, pss=0.0):
        return Reading(wall, {"a": counters}, {"a": (cpu, pss)})

    usage = usage_between((reading(0, 100, 1.0), reading(10, 150, 1.5)),
                          (reading(20, 400, 3.0), reading(120, 1400, 9.0, 75.0)))
    assert usage["a"] == PeerUsage(idle_bytes=50, window_bytes=1000, idle_cpu_s=0.5, window_cpu_s=6.0, pss_mib=75.0)


def test_the_peers_logs_and_summaries_are_read_back(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps([1000.5, "get", "units", 0.1, False]) + "\n")
    (tmp_path / "a.jsonl.summary.json").write_text(json.dumps({"runs": {"units": 3}, "errors": {"units": 2}}))
    calls = read_calls(tmp_path, ["a", "gone"])
    assert calls == {"a": [Call(1000.5, "get", "units", 0.1, False)], "gone": []}
    assert read_errors(tmp_path, ["a", "gone"]) == 3  # a peer that wrote no summary counts as a failure


def test_what_a_peer_carried_is_the_snapshots_difference_over_the_window_per_node_per_logical_minute(tmp_path):
    lines = [[990.0, {"received": {"rounds": [10, 30_000]}, "sent": {"find rounds": [4, 4096, 8192]}}],
             [1001.0, {"received": {"rounds": [12, 36_000]}, "sent": {"find rounds": [5, 5120, 10_240]}}],
             [1099.0, {"received": {"rounds": [112, 336_000], "units": [5, 10_240]},
                       "sent": {"find rounds": [104, 106_496, 212_992], "ping -": [2, 100, 100]}}],
             [1105.0, {"received": {"rounds": [999, 9_999_999]}, "sent": {}}]]
    (tmp_path / "a.jsonl.traffic.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    traffic = read_traffic(tmp_path, ["a", "gone"])
    assert traffic["gone"] == [] and len(traffic["a"]) == 4
    # from the last snapshot at or before the window's start to the last at or before its end
    assert carried_between(traffic["a"], "received", *WINDOW) == {"rounds": (102, 306_000), "units": (5, 10_240)}
    assert carried_between(traffic["a"], "sent", *WINDOW) == {"find rounds": (100, 102_400, 204_800),
                                                              "ping -": (2, 100, 100)}
    assert carried_between([], "sent", *WINDOW) == {}
    row = _figures(traffic={**traffic, "bootstrap": [(1099.0, {"received": {"bans": [50, 50_000]}, "sent": {}})]})
    # 2 peers over 25 logical s (100 real s at K=4); the bootstrap's are its own
    assert row.received["rounds"] == {"kib_per_node_min": pytest.approx(306_000 / 1024 / 2 / 25 * 60, abs=0.01),
                                      "entries_per_node_min": pytest.approx(102 / 2 / 25 * 60, abs=0.01),
                                      "bytes_per_entry": 3000}
    assert set(row.received) == {"rounds", "units"}
    assert row.sent["find rounds"] == {"calls_per_node_min": 120.0, "kib_out_per_node_min": 120.0,
                                       "kib_back_per_node_min": 240.0}
    small, large = dataclasses.replace(row, nodes=8), dataclasses.replace(row, nodes=64, received={
        name: {**cell, "kib_per_node_min": cell["kib_per_node_min"] * 4} for name, cell in row.received.items()})
    table = "\n".join(received_table([small, large]))
    assert "| rounds | 358.6 (122; 3000) | 1434 (122; 12000) | 4 |" in table
    assert "| all | " in table and received_table([dataclasses.replace(row, received={})]) == []
    sent = "\n".join(sent_table([small, large]))
    assert "| find rounds | 120 (360) | 120 (360) | 1 |" in sent and "| all | 122 (" in sent


def _with_monitor_and_newcomer(newcomer=None):
    calls = {"a": _calls(4, "get", "units", 0.1), "trainer-0": _calls(6, "get", "workers", 0.2),
             "monitor": _calls(30, "get", "workers", 0.5)}
    usage = {"a": PeerUsage(window_bytes=1000, window_cpu_s=1.0), "trainer-0": PeerUsage(window_bytes=1000),
             "monitor": PeerUsage(idle_bytes=1000, window_bytes=61_000, idle_cpu_s=1.0, window_cpu_s=20.0),
             "bootstrap": PeerUsage()}
    polls = [(1004.0, 0.3), (1050.0, 0.5), (1099.0, 0.9), (1101.0, 9.0)]  # the last after the window
    return _figures(calls=calls, usage=usage, monitor="monitor", polls=polls, stages=3, newcomer=newcomer)


def test_the_monitor_is_apart_from_the_role_peers_and_its_polls_are_timed_to_the_windows_end():
    row = _with_monitor_and_newcomer()
    assert row.peers_answered == 2 and row.get_p95_ms < 200.1  # the monitor's 0.5 s gets are not the peers'
    assert row.monitor_polls == 3 and row.monitor_poll_p50_s == 0.5
    assert row.monitor_poll_p95_s == pytest.approx(0.5 + 0.4 * 0.9)
    # 100 B/s at rest, 610 in the window -> (510 x 4 + 100) x 60; CPU 0.1 and 0.2 s/s -> (0.1 x 4 + 0.1) x 60
    assert row.monitor_kib_min == pytest.approx((510 * 4 + 100) * 60 / 1024)
    assert row.monitor_cpu_s_min == pytest.approx(30.0)


def test_a_trainers_roster_reads_are_its_all_workers_gets_over_the_stages_per_logical_second():
    row = _with_monitor_and_newcomer()
    assert row.roster_reads_per_trainer_s == pytest.approx(6 / 3 / 25)  # 100 real s at K = 4: 25 logical s
    assert math.isnan(_figures().roster_reads_per_trainer_s)  # no trainer: no figure


def test_the_newcomers_steps_are_seconds_from_its_launch_and_a_missing_step_is_no_figure():
    row = _with_monitor_and_newcomer(Newcomer(start=2000.0, joined=2001.5, donor=2001.75, announced=2001.9,
                                              visible=2002.25, donors=2))
    assert (row.newcomer_joined_s, row.newcomer_donor_s, row.newcomer_visible_s) == (1.5, 1.75, 2.25)
    assert row.newcomer_donors == 2
    unseen = Newcomer(start=2000.0, joined=2003.0, donor=None, announced=2004.0, visible=None).seconds()
    assert unseen["newcomer_joined_s"] == 3.0 and math.isnan(unseen["newcomer_donor_s"])
    assert math.isnan(unseen["newcomer_visible_s"])
    assert math.isnan(_figures().newcomer_joined_s)  # no newcomer: no figure


def test_the_monitors_polls_are_read_from_its_summary(tmp_path):
    (tmp_path / "monitor.jsonl.summary.json").write_text(json.dumps({"runs": {}, "errors": {},
                                                                     "polls": [[1000.5, 0.25]]}))
    assert read_polls(tmp_path, "monitor") == [(1000.5, 0.25)]
    assert read_polls(tmp_path, "gone") == []


def test_the_report_has_the_monitor_and_newcomer_table_and_says_routing_is_not_a_dht_figure():
    rows = [_with_monitor_and_newcomer(Newcomer(2000.0, 2001.0, 2002.0, 2002.5, 2003.0, 1)),
            dataclasses.replace(_with_monitor_and_newcomer(), nodes=8)]
    text = report(rows, "python bench/dht_scale.py --nodes 2 8")
    assert "| N | monitor poll p50 s | monitor poll p95 s | polls |" in text
    assert "| 2 | 0.5 | 0.86 | 3 |" in text and "| 1 | 2 | 3 | 1 |" in text  # the newcomer's seconds
    assert "routing decisions are not a DHT quantity" in text and "the download is the data plane" in text


def _row(nodes, p95, kib, cpu, load=0.5):
    return dataclasses.replace(_figures(nodes=nodes), get_p95_ms=p95, store_p95_ms=p95, kib_per_node_min=kib,
                               cpu_s_per_node_min=cpu, load_end=load)


def test_goals_judge_p95_within_2x_and_per_node_cost_against_log_n():
    met = goals([_row(8, 100.0, 10.0, 1.0), _row(16, 120.0, 11.0, 1.1), _row(32, 150.0, 12.0, 1.2),
                 _row(64, 190.0, 13.0, 1.3)])
    assert all(line.endswith(": met") for line in met)
    missed = goals([_row(8, 100.0, 10.0, 1.0), _row(16, 200.0, 20.0, 2.0), _row(32, 400.0, 40.0, 4.0),
                    _row(64, 800.0, 80.0, 8.0, load=3.0)])
    assert sum(line.endswith(": missed") for line in missed) == 4
    assert "contention" in missed[-1]


def test_the_report_has_every_n_the_growth_the_goals_and_the_models_check():
    rows = [_row(8, 100.0, 10.0, 1.0), _row(16, 120.0, 11.0, 1.1), _row(32, 150.0, 12.0, 1.2, load=2.5)]
    text = report(rows, "python bench/dht_scale.py --nodes 8 16 32", [("store units", 0.44, 0.438)])
    assert "| 8 | 1x1 + 1t | 0.5/0.5 | 2/8 |" in text and "(over 2)" in text
    assert "| growth |" in text and "Goals:" in text and "no averaging all-reduce" in text
    assert "| store units | 0.44 | 0.438 | 1 |" in text
    assert "| get units | " in text


def test_the_plot_is_written_where_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "dht_scale.png"
    assert plot([_row(8, 100.0, 10.0, 1.0), _row(16, 120.0, 11.0, 1.1)], path)
    assert path.stat().st_size > 10_000


def test_the_results_row_gives_the_growth_from_the_smallest_n_to_the_largest_and_what_did_not_form(tmp_path):
    from agora.bench.dht_scale_report import summary_row

    path = tmp_path / "dht_scale.json"
    assert "not measured" in summary_row(path)
    small = dataclasses.replace(_figures(), nodes=8)
    large = dataclasses.replace(small, nodes=32, kib_per_node_min=small.kib_per_node_min * 1.5,
                                cpu_s_per_node_min=small.cpu_s_per_node_min * 3, get_p95_ms=small.get_p95_ms * 4)
    path.write_text(json.dumps({"command": "x", "rows": [dataclasses.asdict(small), dataclasses.asdict(large)],
                                "failed": ["N=64: the swarm did not form: a peer exited (logs: /tmp/w)"]}))
    row = summary_row(path)
    assert "N=8 to 32: bytes x1.50 (fits -), CPU x3.00 (fits -) (log N: x1.67); get p95 x4.00, store p95 x1.00" in row
    assert "N=64: the swarm did not form: a peer exited (bench/results" in row and row.endswith("| no |")
    busy = dataclasses.replace(large, load_start=9.9, load_end=16.8)
    path.write_text(json.dumps({"command": "x", "rows": [dataclasses.asdict(small), dataclasses.asdict(busy)],
                                "failed": []}))
    assert "store p95 x1.00; taken busy: N=32 at load 9.9->16.8 (bench/results" in summary_row(path)


def test_a_cost_under_log_ns_ratio_that_a_line_fits_best_is_no_in_the_results_row_as_in_the_goals(tmp_path):
    from agora.bench.dht_scale_report import summary_row

    # 9 + 0.16 N: x1.87 from 8 to 64 (log N's x2.00), but a line.
    rows = [_row(nodes, 100.0, 9.0 + 0.16 * nodes, 1.0) for nodes in (8, 16, 32, 64)]
    assert [line for line in goals(rows) if line.startswith("- bytes")][0].endswith("best fit N (goal: at most log N): missed")
    path = tmp_path / "dht_scale.json"
    path.write_text(json.dumps({"command": "x", "rows": [dataclasses.asdict(row) for row in rows], "failed": []}))
    row = summary_row(path)
    assert "bytes x1.87 (fits N)" in row and row.endswith("| no |")


def test_results_md_gets_the_table_per_n_and_the_goals_from_the_last_run(tmp_path):
    from agora.bench.dht_scale_report import section

    path = tmp_path / "dht_scale.json"
    assert section(path) == []  # never run: no section, the summary row says so
    small = dataclasses.replace(_figures(), nodes=8)
    large = dataclasses.replace(small, nodes=16, kib_per_node_min=small.kib_per_node_min * 2)
    path.write_text(json.dumps({"command": "python bench/dht_scale.py --nodes 8 16", "failed": [],
                                "rows": [dataclasses.asdict(small), dataclasses.asdict(large)]}))
    lines = section(path)
    assert lines[0].startswith("## 10. ") and "`python bench/dht_scale.py --nodes 8 16`" in lines[2]
    assert [line.split(" | ")[0] for line in lines if line.startswith("| 8 | ") or line.startswith("| 16 | ")] \
        == ["| 8", "| 16", "| 8", "| 16"]  # the figures' table, then the monitor's and the newcomer's
    assert any(line.startswith("- bytes per node: x2.00 from N=8 to N=16") for line in lines)
