"""dht/op_timings.py: the labels a DHT request is timed under, and quantiles read from the buckets."""

import math

import pytest

from agora.dht.op_timings import BUCKETS_S, OperationStats, RequestTimings, key_family, quantile
from agora.dht.keys import bans_key, move_key, rounds_key, trainer_key, units_key, worker_key


def test_keys_are_named_by_their_record_family_and_nothing_else():
    assert key_family(worker_key("run", 3)) == "workers"
    assert key_family(trainer_key("run")) == "trainers"
    assert key_family(move_key("run")) == "moves"
    assert key_family(rounds_key("run", 2, "sparta")) == "rounds"
    assert key_family(units_key("run", 7)) == "units"
    assert key_family(bans_key("run")) == "bans"
    assert key_family("run.stage0.whatever-a-peer-makes-up") == "other"
    assert key_family("b12") == "other"  # a block's tail needs a units head
    assert key_family(None) == "other"


def test_latencies_land_in_prometheus_style_cumulative_buckets():
    timings = RequestTimings()
    for seconds in (0.0005, 0.003, 0.003, 0.2, 99.0):
        timings.record("get", "workers", seconds)
    timings.record("get", "workers", 0.02, failed=True)
    stats = timings.snapshot()[("get", "workers")]
    cumulative = stats.cumulative()
    assert cumulative[BUCKETS_S.index(0.001)] == 1
    assert cumulative[BUCKETS_S.index(0.005)] == 3
    assert cumulative[BUCKETS_S.index(0.025)] == 4
    assert cumulative[BUCKETS_S.index(0.25)] == 5
    assert cumulative[-2] == 5 and cumulative[-1] == 6  # 99 s is past the last bound: +Inf only
    assert stats.count == 6 and stats.failures == 1
    assert stats.total_s == pytest.approx(0.0005 + 0.006 + 0.2 + 99.0 + 0.02)
    with pytest.raises(ValueError, match="operation"):
        timings.record("lookup", "workers", 0.1)


def test_a_snapshot_is_a_copy():
    timings = RequestTimings()
    timings.record("store", "rounds", 0.01)
    snapshot = timings.snapshot()
    timings.record("store", "rounds", 0.01)
    assert snapshot[("store", "rounds")].count == 1


def test_quantiles_interpolate_inside_a_bucket_as_histogram_quantile_does():
    stats = OperationStats()
    for _ in range(10):
        stats.add(0.003, failed=False)  # all in (0.0025, 0.005]
    assert quantile(0.5, stats.cumulative()) == pytest.approx(0.0025 + 0.0025 * 0.5)
    assert quantile(1.0, stats.cumulative()) == pytest.approx(0.005)
    stats.add(1000.0, failed=False)
    assert quantile(1.0, stats.cumulative()) == BUCKETS_S[-1]
    assert math.isnan(quantile(0.5, OperationStats().cumulative()))
    merged = stats.merged(stats)
    assert merged.count == 22 and quantile(0.5, merged.cumulative()) == pytest.approx(quantile(0.5, stats.cumulative()))
    with pytest.raises(ValueError):
        quantile(1.5, stats.cumulative())


def test_the_summary_keeps_each_used_operation_and_family_with_its_mean_and_median():
    timings = RequestTimings()
    for seconds in (0.06, 0.07, 0.2):
        timings.record("get", "units", seconds)
    timings.record("store", "units", 0.09, failed=True)
    summary = timings.summary()
    assert list(summary) == ["get units", "store units"]  # families never asked are left out
    assert summary["get units"]["requests"] == 3 and summary["get units"]["failed"] == 0
    assert summary["get units"]["mean_ms"] == pytest.approx(110.0)
    assert 50.0 < summary["get units"]["p50_ms"] <= 100.0  # read from the 50-100 ms bucket
    assert summary["store units"] == {"requests": 1, "failed": 1, "mean_ms": 90.0, "p50_ms": 75.0}
