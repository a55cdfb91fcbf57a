"""The heartbeat's schedule (dht/heartbeat.py ``next_beat_s``): the interval on average, each gap within
the jitter, and nodes that start together out of step after a few beats."""

import random
import statistics

import pytest

from agora.dht.heartbeat import BEAT_JITTER, next_beat_s


def test_gaps_stay_within_the_jitter_and_keep_the_interval_on_average():
    rng, due, gaps = random.Random(0), 0.0, []
    for _ in range(2000):
        after = next_beat_s(due, 5.0, due, rng)
        gaps.append(after - due)
        due = after
    assert 5.0 * (1 - BEAT_JITTER) <= min(gaps) and max(gaps) <= 5.0 * (1 + BEAT_JITTER)
    assert statistics.mean(gaps) == pytest.approx(5.0, rel=0.01)
    assert statistics.pstdev(gaps) > 0.1


def test_nodes_that_start_together_do_not_beat_together():
    rngs = [random.Random(seed) for seed in range(16)]
    dues = [0.0] * len(rngs)
    for _ in range(20):  # 100 s of 5 s beats
        dues = [next_beat_s(due, 5.0, due, rng) for due, rng in zip(dues, rngs)]
    assert max(dues) - min(dues) > 2.0  # spread over more than two fifths of a beat


def test_a_beat_that_ran_late_restarts_the_schedule_from_its_end():
    assert next_beat_s(0.0, 5.0, 30.0, random.Random(0)) == 30.0
