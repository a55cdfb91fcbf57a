"""Robust aggregation of one all-reduce part: who counts, how much, and how far one sender may pull.

Pure torch over plain values; the hivemind seam that applies it inside the butterfly all-reduce
is dht/robust_allreduce.py. A credential says who a peer is, not that it behaves: an admitted
replica can declare any weight and send any values (a bug, a bad GPU, or on purpose), and with
a plain weighted mean one such replica sets a whole slice of everyone's parameters.

Design choices (the threat model is one bad replica in a group; a colluding majority of a
stage is out of scope, as it is for every robust aggregator):

- Weights are agreed, not declared. Every reducer derives each sender's weight from the same
  gathered metadata with the same rule, so honest reducers agree without another message:
  a peer that is not a ``member`` (weight sync, optimizer sync) counts 0; a weight that is not
  finite or negative counts 0; no weight exceeds ``max_weight`` (the most samples one replica
  can have trained since its previous round, from the run's config: node/averaging/sparta.py);
  and in a group of 3 or more no weight exceeds ``median_weight_slack`` times the median of
  the positive weights, so one peer can never hold a majority of the weight (which
  CenteredClip needs from the honest peers).
- Groups of 3 or more contributions (after non-finite ones are dropped): the coordinate-wise
  median is the robust centre; a contribution farther from it than ``outlier_factor`` times
  the median distance is rejected outright (a scaled or random vector is hundreds of times
  farther than honest replicas are from each other); the rest are combined by CenteredClip
  (Karimireddy, He, Jaggi 2021; the rule the BTARD paper builds on) started at the median, with
  radius ``clip_factor`` times the median distance, so a subtle liar moves the result by at
  most its share of that radius.
- Groups of 2: no majority exists, so nothing can say which of the two is wrong. The reducer
  trusts its own part (it is honest from its own point of view) and bounds how far the other
  may be from it: ``|x_other - x_own| / |x_own|`` is clipped to the bound every receiver applies
  to the averages it gets back (``DeviationHistory``), so the applied delta is bounded by the
  other's share of it: a norm bound on the applied delta. A pull below ``history_floor`` is never
  clipped (an idle partner's weight makes even a far one harmless).
- What is bounded is a part's *deviation*: how far the rest of the group is from this replica,
  relative to its own values, estimated from what an average moves it by, ``|average - own| /
  |own|``, divided by the weight share of the others (``deviation``). A move alone would not do:
  a replica with most of the weight moves little, the same round a light one moves far. The bound
  is ``history_factor`` times the median of the recent accepted deviations at the same position
  in the averaged buffer (slices are cut from every tensor alike, so a position holds the same
  tensors round after round), at least ``history_floor`` (replicas that were identical for a
  while must still be allowed to differ) and never above ``max_relative_delta``; with fewer than
  ``HISTORY_MIN`` past rounds, the ceiling alone. On `tiny`, honest moves are 0.01-0.27 of a
  part's norm and drift slowly over a run; scaled or random vectors are 4.5 and more.
- Coordinates are bounded as well as norms. A norm bound alone lets one sender place its whole
  allowed distance on a single coordinate: in a group of 3, within the outlier threshold and the
  clip radius, that coordinate moves 32 times the honest replicas' per-coordinate spread (more in
  a longer part: the distance grows with the square root of the length), and nothing is rejected.
  So before the norm rules combine anything, every contribution is clipped coordinate-wise:

  - groups of 3 or more: into a band around the coordinate-wise median, ``coordinate_factor``
    times the larger of the coordinate's own spread (the lower median of the contributions'
    absolute distances from the median there) and the part's typical per-coordinate spread (the
    median distance over the square root of the part's length). This is a coordinate-wise
    centered clip (Karimireddy, He, Jaggi 2021, applied per coordinate) around the coordinate-wise
    median of Yin, Chen, Ramchandran, Bartlett 2018: the median and the spread are what one bad
    contribution cannot move far, and a band rather than the median or a trimmed mean itself keeps
    an honest group's weighted mean (a trimmed mean of 3 is their median, a different value on
    every coordinate); honest values fall outside the band on next to no coordinates, and there
    the clipped value is still theirs, moved to the band's edge. One bad contribution then moves a
    coordinate by at most its weight share of the band: a few honest spreads.
  - pairs: the other's value may be at most ``coordinate_factor`` times the norm bound's even share
    per coordinate (the bound times the root mean square of the reducer's own values) from the
    reducer's own, so the pair's recent deviation and the weight's typical size bound every
    coordinate's move as they bound the norm.
  - a part's coordinates from ``nonnegative_from`` (Adam's ``exp_avg_sq`` when optimizer state is
    averaged: the flat offset where it starts) are clipped at 0 too. The result is a convex
    combination of the clipped contributions (the weighted mean, CenteredClip's iterates and the
    pair's pull all are), so on every coordinate it stays within their smallest and largest value,
    and it is at least the honest senders' share of the weight times the smallest honest value:
    a bad sender lowers the second moment by at most its weight share (3/7 in a group of 3 of equal
    honest weights, after the caps; in a pair, the partner's share) and never to 0 or below, so no
    coordinate takes a huge step.

  Clipped coordinates are counted per sender (``PartAggregate.coordinates``), apart from the
  rejections: an honest group has a few, and a value moved to the edge of a band is not refused.
- Counted by reason (``REASONS``): ``syncing`` (weight 0 by phase), ``weight_capped``,
  ``nonfinite``, ``outlier`` (rejected), ``clipped`` (pulled in by CenteredClip or the pair
  bound), and, on the receiving side, ``reducer_outlier`` (an average from another reducer
  beyond the bound: dropped, the local values kept, as for a reducer that failed).
- ``method="mean"`` is hivemind's weighted mean with none of this: for a run among trusted
  machines, and the comparison that shows what the checks stop.
"""

from __future__ import annotations

import functools
import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from agora.pipeline.codec import all_finite

__all__ = [
    "AGGREGATION_METHODS",
    "REASONS",
    "HISTORY_MIN",
    "RobustAggregation",
    "PartAggregate",
    "agreed_weights",
    "aggregate_part",
    "clip_offset",
    "coordinate_move_bound",
    "relative_move",
    "deviation",
    "DeviationHistory",
]

AGGREGATION_METHODS = ("centered_clip", "mean")
REASONS = ("syncing", "weight_capped", "nonfinite", "outlier", "clipped", "reducer_outlier")
# Past rounds at a position before its own history, rather than the ceiling alone, bounds a move.
HISTORY_MIN = 3
# Distances this small against the centre's norm are float noise, not a deviation.
_NOISE = 1e-6
# Groups up to this size take the coordinate median by a sorting network (`_coordinate_median`).
_NETWORK_ROWS = 16


@dataclass(frozen=True)
class RobustAggregation:
    """How a reducer combines the parts it receives; picklable (the averager process builds from it)."""

    method: str = "centered_clip"
    max_weight: float = math.inf
    median_weight_slack: float = 1.5
    outlier_factor: float = 4.0
    clip_factor: float = 2.0
    clip_iterations: int = 20
    max_relative_delta: float = 1.0
    history_factor: float = 8.0
    history_floor: float = 0.02
    history_length: int = 16
    coordinate_factor: float = 6.0
    # The flat offset in the averaged vector from which values are never negative (exp_avg_sq).
    nonnegative_from: Optional[int] = None

    def __post_init__(self) -> None:
        if self.method not in AGGREGATION_METHODS:
            raise ValueError(f"aggregation method: expected one of {', '.join(AGGREGATION_METHODS)}, "
                             f"got {self.method!r}")
        if not self.max_weight > 0 or self.median_weight_slack < 1 or self.outlier_factor < 1:
            raise ValueError("max_weight must be positive, median_weight_slack and outlier_factor at least 1")
        if self.coordinate_factor < 1 or (self.nonnegative_from is not None and self.nonnegative_from < 0):
            raise ValueError("coordinate_factor must be at least 1, nonnegative_from None or >= 0")
        if not (self.clip_factor > 0 and self.max_relative_delta > 0 and self.history_factor >= 1
                and self.clip_iterations >= 1 and self.history_length >= HISTORY_MIN
                and 0 <= self.history_floor <= self.max_relative_delta):
            raise ValueError("clip_factor, max_relative_delta must be positive, history_factor >= 1, "
                             f"clip_iterations >= 1, history_length >= {HISTORY_MIN}, history_floor in "
                             "[0, max_relative_delta]")

    @property
    def robust(self) -> bool:
        return self.method != "mean"


def agreed_weights(declared: Sequence[float], members: Sequence[bool], policy: RobustAggregation
                   ) -> tuple[list[float], Counter]:
    """Each sender's weight from what the group gathered (see the module docstring); same inputs,
    same weights on every reducer. Returns the weights and the counts by reason."""
    counts: Counter = Counter()
    if not policy.robust:
        return [float(w) for w in declared], counts
    weights = []
    for weight, member in zip(declared, members):
        if not member:
            counts["syncing"] += 1
            weights.append(0.0)
        elif not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            counts["nonfinite"] += 1
            weights.append(0.0)
        else:
            weights.append(float(weight))
    cap = policy.max_weight
    positive = sorted(w for w in weights if w > 0)
    if len(positive) >= 3:
        cap = min(cap, policy.median_weight_slack * _lower_median(positive))
    capped = []
    for weight in weights:
        if weight > cap:
            counts["weight_capped"] += 1
            weight = cap
        capped.append(weight)
    return capped, counts


@dataclass
class PartAggregate:
    value: torch.Tensor
    counts: Counter
    # Per contribution, in input order: "used", "clipped", "outlier", "nonfinite" or "unweighted".
    verdicts: list[str]
    # Per contribution, in input order: its coordinates moved to the edge of their band.
    coordinates: list[int]

    @property
    def clipped_coordinates(self) -> int:
        return sum(self.coordinates)


def aggregate_part(parts: Sequence[torch.Tensor], weights: Sequence[float], policy: RobustAggregation, *,
                   own: Optional[int] = None, bound: Optional[float] = None,
                   nonnegative_from: Optional[int] = None) -> PartAggregate:
    """Combine the senders' values of one part. ``own``: the index of this reducer's own part, if it
    sent one (the trusted centre of a pair); ``bound``: the relative deviation a pair's other may have;
    ``nonnegative_from``: the index in the part from which values are never negative.

    Returns NaN values when no contribution has a positive weight (the caller reports that)."""
    if len(parts) != len(weights) or not parts:
        raise ValueError(f"{len(parts)} parts for {len(weights)} weights")
    coordinates = [0] * len(parts)
    if not policy.robust:
        return PartAggregate(_weighted_mean(parts, weights), Counter(), ["used"] * len(parts), coordinates)
    verdicts = ["used" if w > 0 else "unweighted" for w in weights]
    counts: Counter = Counter()
    for i, part in enumerate(parts):
        if verdicts[i] == "used" and not all_finite(part):
            verdicts[i] = "nonfinite"
            counts["nonfinite"] += 1
    live = [i for i, v in enumerate(verdicts) if v == "used"]
    if not live:
        return PartAggregate(torch.full_like(parts[0], math.nan), counts, verdicts, coordinates)
    if len(live) >= 3:
        value = _robust_many(parts, weights, live, verdicts, coordinates, policy, nonnegative_from)
    elif len(live) == 2 and own in live and bound is not None:
        other = next(i for i in live if i != own)
        value = _bounded_pair(parts, weights, own, other, bound, policy, nonnegative_from, verdicts, coordinates)
    else:  # one contribution, or a pair without this reducer's own: their mean, never below 0 where it may not be
        value = _weighted_mean([parts[i] for i in live], [weights[i] for i in live])
        if nonnegative_from is not None:
            value[nonnegative_from:].clamp_min_(0.0)
    counts.update(v for v in verdicts if v in ("outlier", "clipped"))
    return PartAggregate(value, counts, verdicts, coordinates)


def deviation(move: float, own_share: float) -> float:
    """The group's relative distance from this replica, from how far its average moved it
    (`relative_move`) and this replica's share of the weight: the others pull with the rest."""
    return move / max(1.0 - own_share, 0.05)


def relative_move(delta: torch.Tensor, local: torch.Tensor) -> float:
    """How far an average moves a part, relative to the part's own norm (inf for a zero part)."""
    if not all_finite(delta):
        return math.inf
    moved, norm = float(torch.linalg.vector_norm(delta)), float(torch.linalg.vector_norm(local))
    if moved == 0.0:
        return 0.0
    return moved / norm if norm > 0 else math.inf


class DeviationHistory:
    """Recent accepted deviations per position of the averaged buffer, and the bound they give.

    Lives in the averager process for its whole life, so the bound follows the run (moves shrink
    as the learning rate decays); a refused move is recorded at the bound, never above it.
    """

    def __init__(self, policy: RobustAggregation):
        self.policy = policy
        self._moves: dict[int, deque] = {}

    def bound(self, position: int) -> float:
        moves = self._moves.get(position)
        ceiling = self.policy.max_relative_delta
        if moves is None or len(moves) < HISTORY_MIN:
            return ceiling
        recent = self.policy.history_factor * _lower_median(sorted(moves))
        return min(ceiling, max(self.policy.history_floor, recent))

    def accept(self, position: int, move: float, *, trusted_history: bool = True) -> bool:
        """Judge a move at ``position`` against the bound and record it. A refused finite move is
        recorded at the bound, so moves that stay beyond it widen it by ``history_factor`` about
        every half window (up to the ceiling): an honest change of scale (a restart, the schedule)
        is followed within some rounds, while one bad round never moves it. `trusted_history`
        False: only the ceiling judges (a replica with next to no weight in the round: it lags its
        group, and the group's average is what it should take)."""
        limit = self.bound(position) if trusted_history else self.policy.max_relative_delta
        if move <= limit:
            self.record(position, move)
            return True
        if math.isfinite(move):  # NaN and inf are refused and say nothing about the scale
            self.record(position, limit)
        return False

    def record(self, position: int, move: float) -> None:
        if math.isfinite(move):
            self._moves.setdefault(position, deque(maxlen=self.policy.history_length)).append(move)


def _robust_many(parts, weights, live, verdicts, coordinates, policy: RobustAggregation,
                 nonnegative_from: Optional[int]) -> torch.Tensor:
    rows = [parts[i] for i in live]
    centre = _coordinate_median(rows)
    offsets = [row - centre for row in rows]
    distances = [float(torch.linalg.vector_norm(offset)) for offset in offsets]
    spread = sorted(distances)[(len(distances) - 1) // 2]
    noise = _NOISE * float(torch.linalg.vector_norm(centre))
    keep = []
    for row, i in enumerate(live):
        if distances[row] > policy.outlier_factor * spread + noise:
            verdicts[i] = "outlier"
        else:
            keep.append(row)
    band = _coordinate_band(offsets, spread + noise, policy.coordinate_factor)
    clipped = {}
    for row in keep:
        offset, coordinates[live[row]] = clip_offset(offsets[row], band, centre, nonnegative_from)
        clipped[row] = rows[row] if offset is offsets[row] else offset.add_(centre)
    kept_weights = [weights[live[row]] for row in keep]
    radius = policy.clip_factor * spread + noise
    # Every kept contribution within the radius of the weighted mean: that mean is CenteredClip's
    # fixed point (nothing is clipped there), exactly, and it is what an honest group gets.
    mean = _weighted_mean([clipped[row] for row in keep], kept_weights)
    if all(float(torch.linalg.vector_norm(clipped[row] - mean)) <= radius for row in keep):
        return mean
    kept = torch.stack([clipped[row] for row in keep])
    value = _centered_clip(kept, torch.tensor(kept_weights, dtype=kept.dtype), centre, radius,
                           policy.clip_iterations)
    final = torch.linalg.vector_norm(kept - value, dim=1)
    for row, distance in zip(keep, final.tolist()):
        if distance > radius:
            verdicts[live[row]] = "clipped"
    return value


def _coordinate_band(offsets: Sequence[torch.Tensor], spread: float, factor: float) -> torch.Tensor:
    """How far from the coordinate-wise median a contribution may be on each coordinate (3 or more),
    from the contributions' ``offsets`` from it: ``factor`` times the coordinate's own spread (the
    lower median of the offsets' sizes there), at least the part's typical per-coordinate spread."""
    own_spread = _coordinate_median([offset.abs() for offset in offsets])
    return own_spread.clamp_min_(spread / math.sqrt(own_spread.numel())).mul_(factor)


def clip_offset(offset: torch.Tensor, limit: Union[torch.Tensor, float], centre: Optional[torch.Tensor] = None,
                nonnegative_from: Optional[int] = None) -> tuple[torch.Tensor, int]:
    """``offset`` (from ``centre``) with every coordinate within +-``limit`` (one number, or one per
    coordinate) and, from ``nonnegative_from``, ``centre + offset`` at least 0; with how many
    coordinates that moved. ``offset`` itself when none did, else a new tensor (never in place:
    hivemind's deserialized parts may be read-only)."""
    floor = None
    if centre is not None and nonnegative_from is not None and nonnegative_from < offset.numel():
        floor = centre[nonnegative_from:].neg()
    elif not isinstance(limit, torch.Tensor):
        low, high = torch.aminmax(offset)  # one pass, nothing allocated: the common case moves nothing
        if -limit <= float(low) and float(high) <= limit:
            return offset, 0
    moved = offset.abs() > limit
    if floor is not None:
        moved[nonnegative_from:] |= offset[nonnegative_from:] < floor
    count = int(torch.count_nonzero(moved))
    if not count:
        return offset, 0
    clipped = torch.clamp(offset, min=-limit, max=limit)
    if floor is not None:
        clipped[nonnegative_from:] = torch.maximum(clipped[nonnegative_from:], floor)
    return clipped, count


def coordinate_move_bound(own: torch.Tensor, bound: float, policy: RobustAggregation) -> float:
    """How far one coordinate of ``own`` may move when the part may move ``bound`` of its norm:
    ``coordinate_factor`` times that norm budget spread evenly over the coordinates."""
    return policy.coordinate_factor * bound * float(torch.linalg.vector_norm(own)) / math.sqrt(own.numel())


def _coordinate_median(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The lower coordinate-wise median of the rows, by a sorting network of elementwise min/max
    (Batcher's odd-even merge sort): torch's median, kthvalue and sort along a short dimension of a
    2 MiB part took 100-500 ms on this CPU, the network a few passes per comparator."""
    if len(rows) > _NETWORK_ROWS:
        return torch.stack(list(rows)).kthvalue((len(rows) + 1) // 2, dim=0).values
    rows = list(rows)
    for low, high in _sorting_network(len(rows)):
        rows[low], rows[high] = torch.minimum(rows[low], rows[high]), torch.maximum(rows[low], rows[high])
    return rows[(len(rows) - 1) // 2]


@functools.lru_cache(maxsize=None)
def _sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort for `n` rows: the network for the next power of two, without
    the comparators that touch a padding row (padding is +inf, so those never swap)."""
    size = 1
    while size < n:
        size *= 2
    pairs = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (p * 2) == (i + j + k) // (p * 2) and i + j + k < n:
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


def _centered_clip(values: torch.Tensor, weights: torch.Tensor, start: torch.Tensor, radius: float,
                   iterations: int) -> torch.Tensor:
    """v <- v + sum_i w_i (x_i - v) min(1, radius / |x_i - v|) / sum_i w_i, from ``start``."""
    total = float(weights.sum())
    if total <= 0:
        return torch.full_like(start, math.nan)
    share = (weights / total).unsqueeze(1)
    centre = start.clone()
    for _ in range(iterations):
        offsets = values - centre
        distances = torch.linalg.vector_norm(offsets, dim=1, keepdim=True)
        scale = torch.where(distances > radius, radius / distances.clamp_min(1e-30), torch.ones_like(distances))
        step = (share * scale * offsets).sum(dim=0)
        centre += step
        if float(torch.linalg.vector_norm(step)) <= _NOISE * max(radius, 1e-30):
            break
    return centre


def _bounded_pair(parts, weights, own: int, other: int, bound: float, policy: RobustAggregation,
                  nonnegative_from: Optional[int], verdicts, coordinates) -> torch.Tensor:
    mine = parts[own]
    share = weights[other] / (weights[own] + weights[other])
    # A pull under the floor is let be whatever the distance (an idle partner's weight is tiny).
    relative = max(bound, policy.history_floor / max(share, 1e-12))
    limit = relative * float(torch.linalg.vector_norm(mine))
    per_coordinate = coordinate_move_bound(mine, relative, policy)
    offset, coordinates[other] = clip_offset(parts[other] - mine, per_coordinate, mine, nonnegative_from)
    distance = float(torch.linalg.vector_norm(offset))
    if distance > limit:
        verdicts[other] = "clipped"
        offset.mul_(limit / distance)
    return offset.mul_(share).add_(mine)


def _weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    total = float(sum(weights))
    result = torch.zeros_like(parts[0])
    for part, weight in zip(parts, weights):
        result.add_(part, alpha=float(weight))
    return result.div_(total) if total > 0 else result.fill_(math.nan)


def _lower_median(ordered: Sequence[float]) -> float:
    return float(ordered[(len(ordered) - 1) // 2])
