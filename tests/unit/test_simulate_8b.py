"""The Pluralis-8B predictions' inputs (bench/simulate_8b.py): the scenario its runs are built from."""

import json

from agora.bench.simulate_8b import ROOT, base_scenario, geometry
from agora.node.simulate.network import dht_op_s
from agora.node.simulate.scenario import scenario_from_dict


def test_the_dht_latency_is_the_many_node_harness_measurement_at_its_sizes_and_beyond():
    rows = json.loads((ROOT / "results" / "dht_scale.json").read_text())["rows"]
    scenario = scenario_from_dict(base_scenario(geometry(), replicas=10, trainers=10, seconds=20.0))
    for row in rows:  # at the sizes measured: the measured p50s themselves
        assert abs(dht_op_s(scenario.dht, row["nodes"]) * 1000 - row["get_p50_ms"]) < 1e-6
        assert abs(dht_op_s(scenario.dht, row["nodes"], "store") * 1000 - row["store_p50_ms"]) < 1e-6
    # 7 x 100 workers and 60 trainers: past the table, along its last two sizes
    measured = [row["get_p50_ms"] for row in rows]
    beyond = dht_op_s(scenario.dht, 7 * 100 + 60) * 1000
    assert 0.5 * min(measured) < beyond < 2 * max(measured), beyond


def test_a_table_merged_from_two_runs_reads_its_figures_from_their_points(tmp_path):
    from agora.bench.simulate_8b import main

    first, second = tmp_path / "a.md", tmp_path / "b.md"
    assert main(["--replicas", "2", "--trainers", "1", "--seconds", "5", "--churn-days", "0", "--out", str(first)]) == 0
    assert main(["--replicas", "3", "--trainers", "1", "--seconds", "5", "--churn-days", "0", "--out", str(second),
                 "--merge", str(first.with_suffix(".json"))]) == 0
    points = json.loads(first.with_suffix(".json").read_text())["points"]
    assert [(p["replicas"], p["trainers"]) for p in points] == [(2, 1)] and points[0]["tokens_per_s"] > 0
    whole = json.loads(second.with_suffix(".json").read_text())  # the merged table's points, mergeable again
    assert sorted((p["replicas"], p["trainers"]) for p in whole["points"]) == [(2, 1), (3, 1)]
    assert len(whole["commands"]) == 2
    table = second.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| 2 | 1 |") or line.startswith("| 3 | 1 |")]
    assert len(rows) == 2 and rows[0].startswith("| 2 |")  # both runs' points, by replicas
    assert "Simulated here: 2, 3 replicas per stage." in table and second.with_suffix(".png").exists()
