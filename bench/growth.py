"""Which shape a figure measured at several swarm sizes N follows: constant, log N or N.

Benchmarks that run a swarm at a few sizes (bench/many_nodes.py, bench/dht_scale.py) name the growth
of each figure with `growth`: the least-squares line of the figure against each shape of N, the
smallest squared error winning only when clearly smaller than a simpler shape's. On three or four
N values this says which shape the figures follow, not a law.
"""

from __future__ import annotations

import math

__all__ = ["GROWTH_SHAPES", "growth"]


GROWTH_SHAPES = {"constant": lambda n: 0.0, "log N": math.log, "N": float}


def growth(nodes: list[int], values: list[float]) -> str:
    """The shape (constant, log N, N) whose least-squares line fits `values` best; with a positive
    slope only (a falling figure is called constant)."""
    points = [(n, v) for n, v in zip(nodes, values) if math.isfinite(v)]
    if len(points) < 3:
        return "-"
    best, best_error = "constant", math.inf
    for name, shape in GROWTH_SHAPES.items():
        xs, ys = [shape(n) for n, _ in points], [v for _, v in points]
        slope, intercept = _line(xs, ys)
        if name != "constant" and slope <= 0:
            continue
        error = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys))
        if error < best_error * 0.8:  # a more complex shape must fit clearly better
            best, best_error = name, error
    return best


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = 0.0 if spread == 0 else sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
    return slope, mean_y - slope * mean_x
