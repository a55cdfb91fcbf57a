"""Per-coordinate bounds of the robust aggregation (dht/robust.py), pure: one sender placing its
whole allowed distance on a single coordinate, honest groups, pairs, and Adam's second moment."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from agora.dht.robust import RobustAggregation, aggregate_part, clip_offset, coordinate_move_bound
from agora.dht.robust_allreduce import nonnegative_in_part
from agora.node.averaging.sparta import second_moment_offset
from agora.pipeline.config import PRESETS

POLICY = RobustAggregation()
SIZE = 4096


def honest_pair(seed: int = 0, size: int = SIZE, spread: float = 2e-4) -> tuple[torch.Tensor, ...]:
    """Two replicas of one part: shared values of init scale (0.02), each `spread` apart from them."""
    generator = torch.Generator().manual_seed(seed)
    base = 0.02 * torch.randn(size, generator=generator)
    return tuple(base + spread * torch.randn(size, generator=generator) for _ in range(2))


def rms(values: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(values)) / math.sqrt(values.numel())


def pushes(a: torch.Tensor, b: torch.Tensor, coordinate: int):
    """A third sender at the honest mean but for one coordinate, pushed as far as the norm rules let
    it be without being rejected as an outlier (the whole allowed distance on that coordinate)."""
    honest_distance = float(torch.linalg.vector_norm(a - b))
    for scale in torch.linspace(0.1, 8.0, 80).tolist():
        liar = (a + b) / 2
        liar[coordinate] += scale * honest_distance
        result = aggregate_part([a, b, liar], [1.0] * 3, POLICY)
        if "outlier" not in result.verdicts:
            yield result


def test_one_coordinate_carrying_the_whole_distance_moves_about_the_honest_spread_in_a_group_of_three():
    # The norm rules alone let this coordinate move 32x the honest per-coordinate spread.
    a, b = honest_pair()
    honest_spread = rms(a - b)
    moves = []
    for result in pushes(a, b, coordinate=7):
        moves.append(abs(float(result.value[7] - (a[7] + b[7]) / 2)))
        assert result.coordinates[:2] == [0, 0]  # the honest replicas are left alone
    assert moves and max(moves) <= 3 * honest_spread
    assert max(moves) <= 0.05 * rms(a)  # a twentieth of a weight's typical size, not several times it


def test_a_single_coordinate_push_is_counted_as_clipped_coordinates():
    a, b = honest_pair()
    liar = (a + b) / 2
    liar[7] += float(torch.linalg.vector_norm(a - b))
    result = aggregate_part([a, b, liar], [1.0] * 3, POLICY)
    assert result.coordinates == [0, 0, 1] and result.clipped_coordinates == 1
    assert result.verdicts == ["used"] * 3 and result.counts == {}  # a clipped coordinate is not a rejection


@pytest.mark.parametrize("group", [3, 4, 6])
def test_honest_groups_keep_their_weighted_mean_to_a_thousandth_of_their_spread(group):
    # Tolerance: at most 1 in 10,000 coordinates clipped, and the result within 1e-3 of an honest
    # replica's distance from the mean (gaussian honest deviations, 2**16 coordinates).
    generator = torch.Generator().manual_seed(group)
    base = 0.02 * torch.randn(2**16, generator=generator)
    parts = [base + 2e-4 * torch.randn(base.shape, generator=generator) for _ in range(group)]
    weights = [float(w) for w in range(10, 10 + group)]
    mean = sum(w * p for w, p in zip(weights, parts)) / sum(weights)
    result = aggregate_part(parts, weights, POLICY)
    assert result.clipped_coordinates <= 1e-4 * base.numel()
    assert float(torch.linalg.vector_norm(result.value - mean)) <= 1e-3 * float(torch.linalg.vector_norm(parts[0] - mean))


@pytest.mark.parametrize("bound", [1.0, 0.08])
def test_a_pair_bounds_each_coordinates_move_by_its_share_of_the_norm_budget_spread_evenly(bound):
    # bound 1.0: the ceiling (no history yet); 0.08: eight times an honest deviation of 1%.
    a, _ = honest_pair()
    other = a.clone()
    other[7] += bound * float(torch.linalg.vector_norm(a))  # the whole norm budget on one coordinate
    result = aggregate_part([a, other], [1.0, 1.0], POLICY, own=0, bound=bound)
    moved = abs(float(result.value[7] - a[7]))
    assert moved <= 0.5 * coordinate_move_bound(a, bound, POLICY) * (1 + 1e-5)
    assert moved <= 0.5 * POLICY.coordinate_factor * bound * rms(a) * (1 + 1e-5)  # 3 weights' size at most
    assert result.coordinates == [0, 1]
    assert moved < 0.1 * 0.5 * bound * float(torch.linalg.vector_norm(a))  # what the norm bound alone allowed


def test_an_honest_pair_keeps_its_exact_weighted_mean():
    a, b = honest_pair(seed=3)
    result = aggregate_part([a, b], [1.0, 3.0], POLICY, own=0, bound=0.08)
    assert result.coordinates == [0, 0]
    torch.testing.assert_close(result.value, (a + 3 * b) / 4)


def second_moments(seed: int, size: int = 1024) -> tuple[torch.Tensor, ...]:
    """Two replicas' exp_avg_sq of one part: positive, orders of magnitude apart across coordinates,
    about 10% apart from each other."""
    generator = torch.Generator().manual_seed(seed)
    shared = 1e-8 * torch.rand(size, generator=generator).pow(4).add_(1e-3)
    return tuple(shared * (1 + 0.1 * torch.rand(size, generator=generator)) for _ in range(2))


def test_a_pushed_second_moment_stays_within_the_honest_values_and_positive():
    a_weights, b_weights = honest_pair(size=1024)
    a_moments, b_moments = second_moments(1)
    a, b = torch.cat([a_weights, a_moments]), torch.cat([b_weights, b_moments])
    liar = (a + b) / 2
    pushed = torch.arange(1024, 2048, 97)  # a few coordinates: far inside the outlier threshold
    liar[pushed] = -(a[pushed] + b[pushed])  # the plain mean of these is 0: Adam's step there explodes
    result = aggregate_part([a, b, liar], [1.0] * 3, POLICY, nonnegative_from=1024)
    assert result.verdicts == ["used"] * 3
    second = result.value[1024:]
    low, high = torch.minimum(a_moments, b_moments), torch.maximum(a_moments, b_moments)
    assert bool((second > 0).all())
    assert bool((second >= 2 / 3 * low).all())  # the honest share of the smallest honest value, at least
    assert bool((second[pushed - 1024] <= high[pushed - 1024]).all())
    torch.testing.assert_close(result.value[:1024], (a_weights + b_weights) / 2)


def test_a_pair_partner_cannot_zero_the_second_moment():
    a_moments, b_moments = second_moments(2)
    liar = b_moments.clone()
    liar[::50] = -1.0
    result = aggregate_part([a_moments, liar], [1.0, 1.0], POLICY, own=0, bound=1.0, nonnegative_from=0)
    assert bool((result.value > 0).all())
    assert bool((result.value >= 0.5 * a_moments).all())  # its share of the way to 0, no further


def test_the_second_moment_begins_after_the_slice_and_its_first_moment():
    sync = PRESETS["tiny"].sync
    assert second_moment_offset(sync, 100) is None
    assert second_moment_offset(dataclasses.replace(sync, average_optimizer_state=True), 100) == 200


def test_a_reducer_finds_where_the_second_moments_begin_in_each_of_its_parts():
    # Parts of 100 values; the second moments from offset 250: part 2 holds its first 50.
    assert [nonnegative_in_part(250, position, 100) for position in range(5)] == [None, None, 50, 0, 0]
    assert nonnegative_in_part(None, 3, 100) is None and nonnegative_in_part(200, 2, 100) == 0


def test_clipping_counts_what_moved_and_never_changes_the_offset():
    offset = torch.tensor([-2.0, -0.5, 0.5, 2.0])
    clipped, moved = clip_offset(offset, 1.0)
    assert clipped.tolist() == [-1.0, -0.5, 0.5, 1.0] and moved == 2
    clipped, moved = clip_offset(offset, torch.tensor([3.0, 3.0, 0.25, 3.0]), centre=torch.full((4,), 1.0),
                                 nonnegative_from=1)
    assert clipped.tolist() == [-2.0, -0.5, 0.25, 2.0] and moved == 1  # 1 - 0.5 is not below 0
    clipped, moved = clip_offset(offset, 3.0, centre=torch.full((4,), 0.25), nonnegative_from=1)
    assert clipped.tolist() == [-2.0, -0.25, 0.5, 2.0] and moved == 1  # 0.25 - 0.5 is
    assert offset.tolist() == [-2.0, -0.5, 0.5, 2.0]
    assert clip_offset(offset, 3.0) == (offset, 0)


def test_policies_refuse_a_coordinate_factor_below_one():
    with pytest.raises(ValueError, match="coordinate_factor"):
        RobustAggregation(coordinate_factor=0.5)
    with pytest.raises(ValueError, match="nonnegative_from"):
        RobustAggregation(nonnegative_from=-1)
