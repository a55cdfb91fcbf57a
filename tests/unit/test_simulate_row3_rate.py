"""Row 3's simulated tokens/s is taken as the demo takes it (over the run's own global batches from its
start), with a DHT request as long as the run's own trainer measured its lease requests, and the host's
CPU as the run read it where it did."""

from types import SimpleNamespace

import pytest

from agora.bench.simulate_validation import run_tokens_per_s, steps_of


def test_the_rate_is_each_trainers_batches_over_its_last_commit_summed_once_the_runs_batches_are_in():
    one = SimpleNamespace(committed=[2.0, 3.0, 4.0, 9.0])
    two = SimpleNamespace(committed=[2.5, 5.0, 8.0])
    # 5 batches of 1,000 tokens are in at 5.0: 3 of the first's by 4.0, 2 of the second's by 5.0.
    assert run_tokens_per_s([one, two], 5, 1000) == 3 * 1000 / 4.0 + 2 * 1000 / 5.0
    assert run_tokens_per_s([one], 4, 1000) == 4 * 1000 / 9.0  # a ramp at the start counts, as it does there
    assert run_tokens_per_s([one, two], 8, 1000) is None  # not all of the run's batches committed


def test_each_shape_runs_the_suite_plans_batches():
    assert [steps_of(name) for name in ("tiny x1 adaptive", "small x1 half a batch", "tiny wide x1 adaptive, 4 trainers",
                                        "small wide x1 adaptive", "tiny report shape x1 adaptive")] == [40, 8, 24, 6, 3]


def test_row_3s_runs_are_read_from_the_raw_figures_with_their_trainers_mean_lease_request_where_recorded():
    from agora.bench.simulate_validation import row3_runs, scenario_for

    trainer = {"get units": {"requests": 30, "failed": 0, "mean_ms": 120.0, "p50_ms": 90.0},
               "store units": {"requests": 10, "failed": 0, "mean_ms": 80.0, "p50_ms": 75.0},
               "get workers": {"requests": 5, "failed": 0, "mean_ms": 400.0, "p50_ms": 300.0}}
    split = {str(stage): {"compute_ms": 10.0 + stage, "wire_ms": 5.0} for stage in range(3)}

    def repeat(rate: float, latency: float, cpu: float, **more) -> dict:
        return {"tokens_per_s": rate, "in_flight": [{"latency_ms": latency}], "time_split_by_stage": split,
                "trainer_split": {"cpu_ms": cpu}, **more}

    def links(*rtts: float) -> list:
        return [{"rtt_ms": rtt, "upload_mbit": 190.0, "download_mbit": 191.0} for rtt in rtts]
    runs = row3_runs({"items": {"3": {"data": {"profiles": {
        "agora-floor": {"links": links(80.5), "runs": {
            "tiny x1 adaptive": [repeat(900.0, 400.0, 7.0), repeat(1100.0, 600.0, 8.0, dht_requests=[trainer])],
            "tiny x1 no calls": [{"tokens_per_s": 5.0}]}},  # no per-call table: not a run
        "lan": {"links": links(0.06), "runs": {"tiny x1 adaptive": [repeat(1000.0, 500.0, 8.0)]}},  # before the field
        "straggler": {"links": links(80.5, 80.6), "runs": {"tiny x2 adaptive": [repeat(1.0, 1.0, 1.0)]}},  # mixed
        "elsewhere": {"runs": {"tiny x1 adaptive": [repeat(1.0, 1.0, 1.0)]}}}}}}})  # no links measured: left out
    assert set(runs) == {("agora-floor", "tiny x1 adaptive"), ("lan", "tiny x1 adaptive")}
    floor = runs[("agora-floor", "tiny x1 adaptive")]
    assert (floor.tokens_per_s, floor.latency_ms, floor.trainer_cpu_ms) == (1000.0, 500.0, 8.0)  # means; the last's CPU
    assert floor.link == (80.5, 190.0, 191.0)
    assert floor.stages == [(10.0, 5.0), (11.0, 5.0), (12.0, 5.0)]
    assert floor.dht_ms == (30 * 120.0 + 10 * 80.0) / 40
    assert runs[("lan", "tiny x1 adaptive")].dht_ms is None
    assert floor.host is None  # it did not read its processes: each call's compute is its wall time
    assert scenario_for(floor, 5.0, 60.0, 110.0)["compute"] == {"ms": [20.0, 22.0, 12.0], "call_overhead_ms": 5.0,
                                                                "shared_cores": 2}
    assert scenario_for(floor, 5.0, 60.0, 110.0)["dht"] == {"base_ms": 110.0}
    assert scenario_for(runs[("lan", "tiny x1 adaptive")], 5.0, 60.0)["dht"] == {"base_ms": 0.06 + 5.0}


def test_a_run_that_read_its_cpu_shares_the_host_by_it():
    """Two stages' worth of figures: each call's compute is its wall time times the compute thread's
    share, a worker's other process CPU is spread over its calls, and what the host burned besides the
    workers' and trainers' own processes is background."""
    from agora.bench.simulate_validation import row3_runs, scenario_for

    split = {"0": {"calls": 100, "compute_ms": 20.0, "wire_ms": 5.0}, "1": {"calls": 50, "compute_ms": 40.0,
                                                                             "wire_ms": 5.0}}
    run = {"tokens_per_s": 1000.0, "in_flight": [{"latency_ms": 100.0}], "time_split_by_stage": split,
           "trainer_split": {"cpu_ms": 10.0},
           "compute_by_stage": {"0": {"cpu_share": 0.5}, "1": {"cpu_share": 0.75}},
           "cpu_by_process": {"worker-s0-r0": {"main": 1.5, "p2pd": 0.5, "children": 1.0},  # 1 s of jobs, 0.5 else
                              "worker-s1-r0": {"main": 2.0, "p2pd": 0.5, "children": 1.0},  # 1.5 s of jobs
                              "trainer-0": {"main": 0.5, "p2pd": 0.25, "children": 0.25},
                              "bootstrap": {"main": 0.0, "p2pd": 0.5, "children": 0.5}},
           "host_cpu": {"window_s": 10.0, "busy_s": 8.0, "cores": 2, "processes_s": 9.0}}
    tiny = row3_runs({"items": {"3": {"data": {"profiles": {"lan": {
        "links": [{"rtt_ms": 0.1, "upload_mbit": 1e4, "download_mbit": 1e4}], "runs": {"tiny x1 adaptive": [run]}}}}}}})
    host = tiny[("lan", "tiny x1 adaptive")].host
    assert host.compute_ms == [10.0, 30.0]
    assert host.call_cpu_ms == pytest.approx([5.0, 10.0])  # (1.5 s - 100 x 10 ms) / 100; (2 s - 50 x 30 ms) / 50
    assert host.background_ms_per_s == pytest.approx((8.0 - 1.5 - 2.0 - 0.5) * 100)  # 4 s over 10 s
    assert host.busy_cores == pytest.approx(0.8)
    compute = scenario_for(tiny[("lan", "tiny x1 adaptive")], 5.0, 60.0)["compute"]
    assert compute == {"ms": [20.0, 30.0], "call_cpu_ms": host.call_cpu_ms,
                       "background_cpu_ms_per_s": pytest.approx(400.0), "call_overhead_ms": 0.0, "shared_cores": 2}
    # Where the workers timed their Steps apart, a report's step takes its CPU on the replica's executor.
    run["compute_by_stage"] = {"0": {"cpu_share": 0.5, "control_jobs": 10, "control_cpu_s": 0.05},
                               "1": {"cpu_share": 0.75, "control_jobs": 10, "control_cpu_s": 0.08}}
    stepped = row3_runs({"items": {"3": {"data": {"profiles": {"lan": {
        "links": [{"rtt_ms": 0.1, "upload_mbit": 1e4, "download_mbit": 1e4}], "runs": {"tiny x1 adaptive": [run]}}}}}}})
    compute = scenario_for(stepped[("lan", "tiny x1 adaptive")], 5.0, 60.0)["compute"]
    assert compute["step_ms"] == pytest.approx([5.0, 8.0])
