"""What the many-node validation takes from dht_scale's rows and allreduce_cost's tables as the simulator's inputs."""

import json

import pytest

from agora.bench.allreduce_cost import Cost, at_replicas, fit
from agora.bench.simulate_scale_validation import HarnessCPU, averaging_scenario, newcomer_scenario
from agora.node.simulate.scenario import scenario_from_dict


def _row(nodes: int, cpu: float, rest: float, requests: float) -> dict:
    return {"nodes": nodes, "cpu_s_per_node_min": cpu, "rest_cpu_s_per_node_min": rest,
            "requests_per_node_min": requests}


def test_a_newcomers_scenario_takes_the_rows_geometry_latencies_and_dht_start():
    row = {**_row(16, 13.0, 0.1, 300.0), "geometry": "3x5 + 1t", "newcomer_joined_s": 2.0,
           "by_family": {"get workers": {"p50_ms": 350.0}, "store workers": {"p50_ms": 750.0}}}
    scenario = scenario_from_dict(newcomer_scenario(row))
    assert (scenario.run.stages, scenario.workers.replicas) == (3, 5)
    assert scenario.dht.get_ms_at == ((16.0, 350.0),) and scenario.dht.store_ms_at == ((16.0, 750.0),)
    assert scenario.churn.admission_s == 2.0
    # Its first reads, the stage keys then the ban list's, each over connections it opens first.
    assert scenario.churn.join_dht_ops == 2 and scenario.churn.dial_rtts == 4


def test_the_harness_cpu_is_read_from_allreduce_costs_tables_and_fit(tmp_path):
    costs = [_cost(r, v, 0.001, 20e-9) for r in (2, 4) for v in (261_632, 4096)]
    for cost, op_ms in zip(costs, (3.0, 5.0, 6.0, 8.0)):
        cost.dht_op_cpu_ms = op_ms
    (tmp_path / "allreduce_cost.json").write_text(json.dumps({
        "cpu_s_per_peer": 0.001, "cpu_s_per_byte_sent": 20e-9,
        "matchmaking_cpu_ms_at": at_replicas(costs, "matchmaking_cpu_ms"),
        "dht_op_cpu_ms_at": at_replicas(costs, "dht_op_cpu_ms"),
        "idle_cpu_ms_per_s_at": at_replicas(costs, "idle_cpu_ms_per_s")}))
    cpu = HarnessCPU.read(tmp_path)
    assert cpu.dht_op_ms_at == ((2.0, 4.0), (4.0, 7.0))  # each R's two runs, averaged
    assert [size for size, _ in cpu.matchmaking_ms_at] == [2.0, 4.0]
    assert [ms for _, ms in cpu.matchmaking_ms_at] == pytest.approx([25.0, 12.5])  # 0.05 s a round over R
    assert cpu.allreduce == pytest.approx((1.0, 20.0))
    # The host's idle 0.01 CPU s a second, over R replicas, in ms a second each.
    assert [size for size, _ in cpu.idle_ms_per_s_at] == [2.0, 4.0]
    assert [ms for _, ms in cpu.idle_ms_per_s_at] == pytest.approx([5.0, 2.5])
    # A table written before idle was kept: no background.
    (tmp_path / "allreduce_cost.json").write_text(json.dumps({
        "cpu_s_per_peer": 0.001, "cpu_s_per_byte_sent": 20e-9, "matchmaking_cpu_ms_at": [[2.0, 1.0]],
        "dht_op_cpu_ms_at": [[2.0, 1.0]]}))
    assert HarnessCPU.read(tmp_path).idle_ms_per_s_at == ()


def test_the_averaging_scenario_takes_the_harness_cpu_and_the_replicas_traffic_between_rounds():
    cpu = HarnessCPU(((2.0, 3.0), (8.0, 10.0)), ((2.0, 20.0), (8.0, 90.0)), (1.5, 20.0))
    scenario = scenario_from_dict(averaging_scenario(4, 3, cpu, 1000))
    assert scenario.dht.cpu_ms_at == ((2.0, 3.0), (8.0, 10.0))
    assert scenario.averaging.matchmaking_cpu_ms_at == ((2.0, 20.0), (8.0, 90.0))
    assert scenario.averaging.matchmaking_dht_ops == 0  # the loop's own by its rules; hivemind's is the CPU
    assert scenario.averaging.allreduce_cpu_ms_per_peer == 1.5
    assert scenario.averaging.allreduce_cpu_ns_per_byte == 20.0
    assert scenario.averaging.between_rounds and scenario.workers.heartbeat_s == 5.0
    assert not scenario.workers.heartbeat_reads_bans  # the harness's DHT is insecure: no ban list
    assert scenario.workers.background_cpu_ms_per_s_at == ()  # none measured in this HarnessCPU
    idle = HarnessCPU(cpu.dht_op_ms_at, cpu.matchmaking_ms_at, cpu.allreduce, ((2.0, 3.5), (8.0, 6.0)))
    assert scenario_from_dict(averaging_scenario(4, 3, idle, 1000)).workers.background_cpu_ms_per_s_at == (
        (2.0, 3.5), (8.0, 6.0))


def _cost(replicas: int, vector_bytes: int, per_peer: float, per_byte: float) -> Cost:
    """A run whose host all-reduce CPU per round is exactly R (R - 1) per_peer + R sent per_byte."""
    sent = 2 * vector_bytes * (replicas - 1) / replicas
    allreduce = replicas * (replicas - 1) * per_peer + replicas * int(sent) * per_byte
    return Cost(replicas, vector_bytes, 30, 30 * replicas, 0.05 + allreduce, 0.05, 0.01, 0.03, 0.04)


def test_the_fit_recovers_the_cost_per_peer_and_per_byte():
    costs = [_cost(r, v, 0.001, 20e-9) for r in (2, 3, 4) for v in (261_632, 4096)]
    per_peer, per_byte = fit(costs)
    assert per_peer == pytest.approx(0.001) and per_byte == pytest.approx(20e-9)


def test_the_fit_never_makes_a_cost_negative():
    """Noise that the free fit reads as a negative cost per peer: that cost is 0 and the cost per
    byte is fitted alone (a scenario refuses a negative CPU)."""
    costs = [_cost(r, v, -0.0005, 30e-9) for r in (2, 4) for v in (261_632, 4096)]
    per_peer, per_byte = fit(costs)
    assert per_peer == 0.0 and 0 < per_byte < 30e-9


def test_the_averaging_table_sets_the_hosts_cpu_beside_what_the_simulated_jobs_add_up_to():
    from agora.bench.simulate_scale_validation import validate_averaging

    cpu = HarnessCPU(((2.0, 3.0), (8.0, 10.0)), ((2.0, 20.0), (8.0, 90.0)), (1.5, 20.0))
    row = {"replicas": 2, "rounds_due": 3, "load_start": 0.1, "load_end": 0.2, "start_offsets_s": [0.0, 0.01],
           "formation_p50_s": 0.05, "formation_p95_s": 0.06, "duration_p50_s": 0.07, "duration_p95_s": 0.08}
    lines, errors = validate_averaging([{**row, "cpu_s_per_round": 0.5}, row], cpu)
    measured, simulated = lines[2].split("|")[-3].split(" / ")
    # A round's matchmaking (20 ms and two DHT operations of 3 ms) and all-reduce (1.5 ms a peer and
    # 20 ns a byte: 6.7 ms) on each of two replicas, and their probes and beats between rounds.
    assert float(measured) == 0.5 and 2 * (0.020 + 2 * 0.003 + 0.0067) < float(simulated) < 0.3
    assert lines[3].endswith("| - | - |")  # a row taken before the harness read its CPU
    assert all(len(values) == 2 for values in errors.values())  # the CPU is shown, not counted
