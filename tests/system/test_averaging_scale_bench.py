"""bench/averaging_scale.py at R = 3, a short window: three replica processes average for real,
their rounds commit, the table's figures come back, and no process outlives the measurement.

Not a result (three rounds on a shared machine): what is checked is that the bench measures.
"""

from __future__ import annotations

import math

import pytest

from agora.bench.averaging_scale import Pace, measure, report
from leftovers import assert_nothing_left

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def test_three_replicas_commit_rounds_and_the_figures_come_back(tmp_path):
    pace = Pace(rounds=3, step_s=0.5, every_steps=4, matchmaking_s=2.0)
    row = measure(3, pace, tmp_path / "r3")
    assert row.reported == 3, row
    assert row.outcomes["committed"] >= 3 and row.attempted_min >= 1, row
    assert 2 <= row.group_mean <= 3, row
    assert all(math.isfinite(v) and v > 0 for v in (row.formation_p50_s, row.duration_p50_s,
                                                    row.pss_mib_per_replica, row.startup_s)), row
    # Three replicas' processes (each its DHT process, p2pd and averager) over three rounds: a reading
    # of the whole trees, which one process's idle second alone would not reach.
    assert 0.05 < row.cpu_s_per_round < 60, row
    # The same CPU by part of the trees: each part ran (every replica has a main process, a p2pd and
    # forked DHT and averager processes), and the parts add up to the whole, read a moment apart.
    parts = row.cpu_s_per_round_by_part
    assert set(parts) == {"main", "p2pd", "children"} and all(v > 0 for v in parts.values()), row
    assert abs(sum(parts.values()) - row.cpu_s_per_round) < 0.5 * row.cpu_s_per_round, row
    # Each replica's own requests: its heartbeat's stores and its loop's probes of the round board.
    assert row.dht_requests_per_round.get("store workers", 0) > 0, row
    assert row.dht_requests_per_round.get("get rounds", 0) > 0, row
    assert row.formation_p50_s <= row.duration_p50_s, row
    # Every replica's start of each round, beside the others' (one of each round's is the first).
    assert len(row.start_offsets_s) >= 3 and min(row.start_offsets_s) == 0.0, row
    # Offsets from the round's first start, not clock readings: within the window. (Not within a round's
    # interval: a replica the loaded cores held back can start a round after its partners left it, alone,
    # as one did in a clean CI run at the suite's busiest.)
    assert all(0.0 <= offset < pace.rounds * pace.round_every_s for offset in row.start_offsets_s), row
    assert "| 3 |" in report([row], pace, "test")
    assert_nothing_left(tmp_path / "r3")
