"""Row 3's simulated tokens/s is taken as the demo takes it (over the run's own global batches from its
start), with a DHT request as long as the run's own trainer measured its lease requests."""

from types import SimpleNamespace

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
    runs = row3_runs({"items": {"3": {"data": {"profiles": {
        "agora-floor": {"runs": {"tiny x1 adaptive": [repeat(900.0, 400.0, 7.0), repeat(1100.0, 600.0, 8.0,
                                                                                       dht_requests=[trainer])],
                                 "tiny x1 no calls": [{"tokens_per_s": 5.0}]}},  # no per-call table: not a run
        "lan": {"runs": {"tiny x1 adaptive": [repeat(1000.0, 500.0, 8.0)]}},  # recorded before the field
        "elsewhere": {"runs": {"tiny x1 adaptive": [repeat(1.0, 1.0, 1.0)]}}}}}}})  # no links known: left out
    assert set(runs) == {("agora-floor", "tiny x1 adaptive"), ("lan", "tiny x1 adaptive")}
    floor = runs[("agora-floor", "tiny x1 adaptive")]
    assert (floor.tokens_per_s, floor.latency_ms, floor.trainer_cpu_ms) == (1000.0, 500.0, 8.0)  # means; the last's CPU
    assert floor.stages == [(10.0, 5.0), (11.0, 5.0), (12.0, 5.0)]
    assert floor.dht_ms == (30 * 120.0 + 10 * 80.0) / 40
    assert runs[("lan", "tiny x1 adaptive")].dht_ms is None
    assert scenario_for(floor, 5.0, 60.0, 110.0)["dht"] == {"base_ms": 110.0}
    assert scenario_for(runs[("lan", "tiny x1 adaptive")], 5.0, 60.0)["dht"] == {"base_ms": 0.06 + 5.0}
