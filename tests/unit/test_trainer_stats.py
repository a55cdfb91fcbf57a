"""The trainer's time split (node/trainer/stats.py): what the per-call tables and the simulator's inputs read."""

import pytest

from agora.node.trainer.stats import HELD_OUT, TrainerStats


def test_the_time_split_is_of_training_calls():
    """An evaluation's held-out Forwards (forward only, as many as its batches' microbatches) stay out of
    the per-call figures of training: mixed in, they lowered the tail's compute per call."""
    stats = TrainerStats()
    stats.call(2, "Forward", 0.030, 0.020, 0.004)  # the tail: forward and backward in one call
    stats.call(2, "Forward", 0.034, 0.024, 0.006, 0.002)  # 2 ms of its wire time behind other frames
    for _ in range(4):
        stats.call(2, HELD_OUT, 0.012, 0.006, 0.001)
    stats.credit_wait(2, 0.002)
    split = stats.time_split()["2"]
    assert split["calls"] == 2 and stats.calls == 2
    assert split["round_trip_ms"] == pytest.approx(32.0)
    assert split["compute_ms"] == pytest.approx(22.0) and split["queued_ms"] == pytest.approx(5.0)
    assert split["wire_ms"] == pytest.approx(5.0) and split["credit_wait_ms"] == pytest.approx(1.0)
    assert split["wire_queued_ms"] == pytest.approx(1.0)


def test_the_trainers_own_split_names_its_waits_for_credits_and_reports():
    stats = TrainerStats()
    for _ in range(4):
        stats.microbatch_done()
    stats.cpu_s, stats.microbatch_s, stats.calls_s = 0.040, 1.0, 0.6
    stats.credit_wait(0, 0.020)
    stats.credit_wait(1, 0.0)  # no wait: nothing counted
    stats.report_wait(0.100)
    stats.report_wait(-0.001)  # a clock read across a step back counts nothing
    assert stats.trainer_split() == {"cpu_ms": 10.0, "outside_calls_ms": 100.0, "credit_wait_ms": 5.0,
                                     "report_wait_ms": 25.0}
