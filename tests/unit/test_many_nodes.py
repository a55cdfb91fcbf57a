"""bench/many_nodes.py's pure parts: how N nodes are laid out, scraped histograms read in the DHT's
buckets, and which growth shape a figure follows."""

import math

import pytest

from agora.bench.growth import growth
from agora.bench.many_nodes import _as_stats, difference, geometry_for
from agora.dht.op_timings import BUCKETS_S, quantile


@pytest.mark.parametrize("nodes, stages, expected", [(8, 3, (3, 2, 2)), (16, 3, (3, 5, 1)), (64, 3, (3, 20, 4)),
                                                     (32, 7, (7, 4, 4))])
def test_nodes_are_stages_times_replicas_plus_trainers(nodes, stages, expected):
    geometry = geometry_for(nodes, stages)
    assert (geometry.stages, geometry.replicas, geometry.trainers) == expected
    assert geometry.nodes == nodes and geometry.trainers >= max(1, nodes // 16)


def test_a_scraped_histogram_with_other_bounds_is_read_at_the_bound_below():
    scraped = {0.005: 2.0, 0.05: 5.0, 0.5: 9.0, math.inf: 10.0}  # another metric's buckets, cumulative
    stats = _as_stats(scraped, total_s=3.0)
    cumulative = stats.cumulative()
    assert cumulative[BUCKETS_S.index(0.005)] == 2 and cumulative[BUCKETS_S.index(0.01)] == 2
    assert cumulative[BUCKETS_S.index(0.5)] == 9 and cumulative[-1] == 10 and stats.count == 10
    window = difference(stats, _as_stats({0.005: 1.0, 0.05: 1.0, 0.5: 1.0, math.inf: 1.0}, 1.0))
    assert window.count == 9 and window.total_s == pytest.approx(2.0)
    assert 0.05 < quantile(0.5, window.cumulative()) <= 0.5


def test_growth_names_the_shape_the_figures_follow():
    nodes = [8, 16, 32, 64]
    assert growth(nodes, [5.0, 5.1, 4.9, 5.05]) == "constant"
    assert growth(nodes, [2 + 3 * math.log(n) for n in nodes]) == "log N"
    assert growth(nodes, [1 + 0.5 * n for n in nodes]) == "N"
    assert growth(nodes, [9.0, 6.0, 4.0, 2.0]) == "constant"  # falling: no growth
    assert growth(nodes[:2], [1.0, 2.0]) == "-"  # too few points to say
