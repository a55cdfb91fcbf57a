"""The robust aggregation rules (dht/robust.py), pure: weights, outliers, CenteredClip, pairs, bounds."""

from __future__ import annotations

import math

import pytest
import torch

from agora.dht.robust import (
    HISTORY_MIN,
    DeviationHistory,
    RobustAggregation,
    aggregate_part,
    agreed_weights,
    deviation,
    relative_move,
)
from agora.node.averaging.sparta import max_round_weight
from agora.pipeline.config import PRESETS

POLICY = RobustAggregation()
MEAN = RobustAggregation("mean")


def honest(n: int, size: int = 4096, seed: int = 0, spread: float = 0.01) -> list[torch.Tensor]:
    """n replicas of one part: shared values of init scale, each a little apart (local training)."""
    generator = torch.Generator().manual_seed(seed)
    base = 0.02 * torch.randn(size, generator=generator)
    return [base + spread * 0.02 * torch.randn(size, generator=generator) for _ in range(n)]


def mean_of(parts, weights=None):
    weights = weights or [1.0] * len(parts)
    return sum(w * p for w, p in zip(weights, parts)) / sum(weights)


# ---------------------------------------------------------------- weights


def test_a_syncing_peer_counts_zero_and_a_declared_weight_is_capped_by_the_config_bound():
    policy = RobustAggregation(max_weight=128.0)
    weights, counts = agreed_weights([32.0, 1e9, 40.0], [True, True, False], policy)
    assert weights == [32.0, 128.0, 0.0]  # two positive weights: the config bound only
    assert counts == {"weight_capped": 1, "syncing": 1}


def test_in_a_group_of_three_no_weight_exceeds_the_median_slack_so_the_honest_keep_the_majority():
    weights, counts = agreed_weights([30.0, 34.0, 1e6], [True] * 3, RobustAggregation(max_weight=1e7))
    assert weights == [30.0, 34.0, 1.5 * 34.0] and counts == {"weight_capped": 1}
    assert weights[2] < weights[0] + weights[1]


def test_a_weight_that_is_not_a_finite_non_negative_number_counts_zero():
    weights, counts = agreed_weights([math.nan, -5.0, math.inf, 8.0], [True] * 4, POLICY)
    assert weights == [0.0, 0.0, 0.0, 8.0] and counts == {"nonfinite": 3}


def test_the_plain_mean_takes_declared_weights_as_they_are():
    assert agreed_weights([1e9, 0.5], [True, False], MEAN) == ([1e9, 0.5], {})


def test_the_config_bound_is_every_sample_of_the_steps_between_two_rounds_twice_over():
    sync = PRESETS["tiny"].sync  # a round every 8 steps, batch 8
    assert max_round_weight(sync, 8) == 2 * 8 * 8
    assert max_round_weight(sync, 8, local_batch=32) == 2 * 8 * 32
    import dataclasses
    diloco = dataclasses.replace(sync, method="diloco", fragments=4)  # weights count per fragment
    assert max_round_weight(diloco, 8) == 2 * 4 * 8 * 8


# ---------------------------------------------------------------- groups of three or more


@pytest.mark.parametrize("attack", ["scaled", "random", "nan"])
def test_a_bad_contribution_in_a_group_of_three_is_rejected_and_the_honest_mean_stands(attack):
    a, b = honest(2)
    bad = {"scaled": 10 * a, "random": torch.randn_like(a), "nan": torch.full_like(a, math.nan)}[attack]
    result = aggregate_part([a, b, bad], [32.0, 32.0, 48.0], POLICY)
    expected = {"scaled": "outlier", "random": "outlier", "nan": "nonfinite"}[attack]
    assert result.verdicts[2] == expected and result.counts == {expected: 1}
    assert result.verdicts[:2] == ["used", "used"]
    torch.testing.assert_close(result.value, mean_of([a, b]))


def test_without_the_checks_one_scaled_replica_sets_the_whole_part():
    a, b = honest(2)
    result = aggregate_part([a, b, 10 * a], [32.0, 32.0, 48.0], MEAN)
    assert float(torch.linalg.vector_norm(result.value - mean_of([a, b]))) > 3 * float(torch.linalg.vector_norm(a))


def test_honest_groups_get_their_weighted_mean():
    for n in (3, 4, 6):
        parts = honest(n, seed=n)
        weights = [float(w) for w in range(10, 10 + n)]
        result = aggregate_part(parts, weights, POLICY)
        assert result.counts == {} and set(result.verdicts) == {"used"}
        torch.testing.assert_close(result.value, mean_of(parts, weights))


def test_a_subtle_liar_is_clipped_and_moves_the_result_by_about_its_share_of_the_radius():
    parts = honest(4, seed=3)
    liar = parts[0] + 3.5 * (parts[1] - parts[0])  # beyond the honest spread, not an outlier
    group = parts[:3] + [liar]
    result = aggregate_part(group, [1.0] * 4, POLICY)
    assert result.verdicts[3] == "clipped" and result.counts == {"clipped": 1}
    stacked = torch.stack(group)
    radius = POLICY.clip_factor * float(torch.linalg.vector_norm(stacked - stacked.median(0).values, dim=1).median())
    honest_mean = mean_of(parts[:3])
    moved = float(torch.linalg.vector_norm(result.value - honest_mean))
    assert moved < 0.4 * radius  # its share is 1/4; CenteredClip's own offset from the mean is the rest
    assert moved < 0.8 * float(torch.linalg.vector_norm(mean_of(group) - honest_mean))


def test_identical_honest_replicas_reject_any_deviation():
    a = honest(1)[0]
    result = aggregate_part([a.clone(), a.clone(), a * 1.001], [1.0] * 3, POLICY)
    assert result.verdicts == ["used", "used", "outlier"]
    torch.testing.assert_close(result.value, a)


def test_nobody_with_weight_gives_nan_for_the_caller_to_report():
    a, b = honest(2)
    assert bool(torch.isnan(aggregate_part([a, b], [0.0, 0.0], POLICY).value).all())


# ---------------------------------------------------------------- pairs


def test_a_pair_keeps_the_exact_weighted_mean_within_the_bound():
    a, b = honest(2)
    result = aggregate_part([a, b], [1.0, 3.0], POLICY, own=0, bound=0.5)
    assert result.counts == {}
    torch.testing.assert_close(result.value, mean_of([a, b], [1.0, 3.0]))


def test_a_pair_bounds_how_far_the_other_may_be_from_the_reducers_own_part():
    a = honest(1)[0]
    for weights, share in (([1.0, 1.0], 0.5), ([1.0, 3.0], 0.75)):
        result = aggregate_part([a, 10 * a], weights, POLICY, own=0, bound=0.2)
        assert result.verdicts == ["used", "clipped"]
        # The other counts as if it were 0.2 of the part's norm away: it moves the part by its share of that.
        assert relative_move(result.value - a, a) == pytest.approx(share * 0.2, rel=1e-5)
        assert deviation(relative_move(result.value - a, a), 1 - share) == pytest.approx(0.2, rel=1e-5)


def test_a_pair_without_the_reducers_own_part_is_a_weighted_mean():
    a, b = honest(2)
    result = aggregate_part([a, b], [1.0, 1.0], POLICY, own=None, bound=0.2)
    torch.testing.assert_close(result.value, mean_of([a, b]))


# ---------------------------------------------------------------- the receiving side


def test_relative_move_is_the_norm_ratio_and_refuses_what_is_not_finite():
    a = torch.ones(4)
    assert relative_move(0.5 * a, a) == pytest.approx(0.5)
    assert relative_move(torch.zeros(4), torch.zeros(4)) == 0.0
    assert relative_move(a, torch.zeros(4)) == math.inf
    assert relative_move(torch.full((4,), math.nan), a) == math.inf


def test_the_bound_is_the_ceiling_until_a_position_has_history_then_follows_it():
    history = DeviationHistory(RobustAggregation(max_relative_delta=1.0, history_factor=8.0))
    assert history.bound(3) == 1.0
    for move in [0.02] * (HISTORY_MIN - 1):
        assert history.accept(3, move)
    assert history.bound(3) == 1.0  # not yet enough rounds there
    assert history.accept(3, 0.02)
    assert history.bound(3) == pytest.approx(0.16) and history.bound(4) == 1.0  # per position
    for _ in range(HISTORY_MIN):
        history.accept(5, 0.0)  # replicas identical for a while may still come apart a little
    assert history.bound(5) == RobustAggregation().history_floor
    assert not history.accept(3, 0.5) and not history.accept(3, math.inf) and not history.accept(3, math.nan)
    assert history.bound(3) == pytest.approx(0.16)  # one refused round does not widen it
    refused = 0
    while not history.accept(3, 0.3):  # moves that stay larger (a restart): the bound follows them
        refused += 1
    assert 0 < refused <= 16 and history.bound(3) == 1.0


def test_policies_refuse_nonsense():
    with pytest.raises(ValueError, match="aggregation method"):
        RobustAggregation("median")
    with pytest.raises(ValueError):
        RobustAggregation(max_weight=0)
    with pytest.raises(ValueError):
        RobustAggregation(history_length=1)


def test_the_coordinate_median_is_torchs_lower_median_for_every_group_size():
    from agora.dht.robust import _coordinate_median

    generator = torch.Generator().manual_seed(7)
    for size in range(2, 19):  # the sorting network up to 16 rows, kthvalue beyond
        rows = [torch.randn(257, generator=generator) for _ in range(size)]
        assert torch.equal(_coordinate_median(rows), torch.stack(rows).median(dim=0).values), size


def test_an_idle_partner_far_away_pulls_too_little_to_be_clipped():
    a = honest(1)[0]
    stale = a + torch.randn(a.shape, generator=torch.Generator().manual_seed(1)) * 0.05  # far off, weight ~0
    result = aggregate_part([a, stale], [64.0, 1e-3], POLICY, own=0, bound=0.1)
    assert result.verdicts == ["used", "used"] and result.counts == {}
    torch.testing.assert_close(result.value, mean_of([a, stale], [64.0, 1e-3]))


def test_a_receiver_with_next_to_no_weight_is_judged_by_the_ceiling_alone():
    history = DeviationHistory(RobustAggregation(max_relative_delta=1.0))
    for _ in range(HISTORY_MIN):
        history.accept(0, 0.01)
    assert not history.accept(0, 0.5)  # beyond 8x its recent deviations
    assert history.accept(0, 0.5, trusted_history=False)  # a lagging replica takes its group's average
    assert not history.accept(0, 2.0, trusted_history=False)  # never more than its own norm
