"""`Boundary`: the reference a stage's replies of one frame kind are held to: the window of its accepted
replies and the centre and spread of each feature over it. Why the reference is what it is: the module
docstring of node/trainer/verification.py, the verifier that keeps one per stage and kind; a lone
worker's, below.

**Alone.** With one worker on a stage the pooled reference is that worker's own recent history, its
spread floored at `LONE_SPREAD_FLOOR` (training's own trends are narrow next to it), and its replies
keep entering it however far its CUSUM has gone, unless the reply itself stands `OUTLIER_Z` spreads
off: with no one else's replies to move the reference, keeping them all out froze it, and a lone
head whose outputs grew 3.5-fold over a few early steps (three trainers stepping it in turn, 5
spreads) stood ever further off its frozen past until it was flagged, and its stage, and the run,
were left with no worker. A sudden large change of its scale or direction, or of a reply's relation
to its request, still trips it: a x10 lie stands 9 spreads off, never enters, and trips within five
replies. But alone it is not flagged on that first trip (a loss spike trips an honest one just so):
its CUSUMs restart, the trainer checks it at once against its own held-out answers, and only a
second trip with no passed check since flags it; a passed check restarts its history instead
(node/trainer/lone_worker.py, which says why and what that bound lets through).

**Weights versions.** Alone, a worker's replies are held to its replies of the same weights: every
reply names the weights version it was computed on (bumped by each write to the stage's weights),
and a lone worker's centre is the median of its window's replies of the reply's version, or of the
newest versions before it until `_SAME_WEIGHTS_REPLIES` replies, its spread their MAD around each
version's own median (floored as above). Early in a run with three trainers stepping one worker,
its values are a staircase in its versions, not a trend in one trainer's replies: a sole head's
log-RMS stood flat over versions 0 and 1, then rose 0.33 a version (0.3 to 0.6 for a sole tail's
input gradient, falling), while replies of one version scattered 0.15 to 0.3; and each trainer sees
only its own microbatches, so it meets the worker again 2 to 3 versions on, or, after the others
stepped it while it stalled or before its closing evaluation, 4 to 7 versions on (2.2 higher in
log-RMS, 9 spreads off a history that held only versions 0 and 1: every such reply was kept out as an
outlier and the honest head was flagged, in demo runs). Against the same weights those replies
stand within 2 spreads (the largest CUSUM over 13 demo runs' recorded traffic 5.7, against 31
before). A reply whose newest such replies go back more than `STALE_VERSIONS` versions is not judged
(nothing there describes its weights) and enters the window, so its weights' next replies are. A
lie is still caught where it starts on weights the trainer has seen replies of, or one or two
versions on: a x10 lie stands 9 spreads off them, never enters, and trips within five replies (and
again five later, with no passed self check between, to be flagged). What this cannot catch then: a
lone worker whose lie starts just when it names weights more than `STALE_VERSIONS` versions past the
replies this trainer holds (its lie is its history from there; versions are the worker's word, and
with several trainers honest jumps that large are common), a worker lying from its first reply (its
history is the lie), a lie its own self checks pass (its excused trip is vouched for, and the lie
becomes its history), a lie grown so slowly that it looks like drift, a sole head replaying earlier
outputs (a head's Forward has no request frame to align with), and a stage-wide honest shift cannot
be told from a lie.

Pure: no torch, no clock.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["SPREAD_FLOOR", "LONE_SPREAD_FLOOR", "STALE_VERSIONS", "Boundary"]

# The smallest spread of a feature (all are dimensionless): a feature that never varies is not
# an invitation to flag the first rounding difference.
SPREAD_FLOOR = 0.02
# The smallest spread when a worker is alone on its stage: its reference is its own recent history,
# whose spread can be far narrower than what training moves it by (a lone tail's input gradients
# shrank 1.6x over a few batches as the loss fell, 12 of its own spreads). A quarter in every
# feature (log-RMS: a 1.3x change) keeps such trends under the drift allowance, while a x10 lie
# (2.3 in log-RMS) or a flipped sign (about 2 in alignment) still counts 8-9 spreads a reply.
LONE_SPREAD_FLOOR = 0.25
# A lone worker's reply is held to its replies of the same weights, or of the newest weights before
# them holding at least this many, within STALE_VERSIONS versions (module docstring: weights versions).
_SAME_WEIGHTS_REPLIES = 4
STALE_VERSIONS = 2
_MAD_TO_SIGMA = 1.4826
# The centre is the median of the newest 1/_RECENT_PART of the window (the spread is the whole window's).
_RECENT_PART = 4


@dataclass
class Boundary:
    """One stage's frames of one kind: the pooled window and each worker's track."""

    window: deque  # (peer, features, weights version or None) of the accepted replies
    workers: dict = field(default_factory=dict)  # worker -> its track (node/trainer/verification.py)
    replies: int = 0

    def entries(self, live: frozenset[str] | None) -> list[tuple[str, tuple[float, ...], int | None]]:
        """The window's replies of the workers in `live` (None: all of them)."""
        return [entry for entry in self.window if live is None or entry[0] in live]

    def reference(self, index: int, floor: float = SPREAD_FLOOR, live: frozenset[str] | None = None,
                  version: int | None = None) -> tuple[float, float] | None:
        """The feature's centre and spread (the verifier's module docstring) over the replies of the
        workers in `live` (None: all), the spread at least `floor`. Given the reply's weights `version`,
        the centre is the median of the replies of those weights (`_same_weights`) and the spread is
        around each weights' own median. None: too few replies, or none of weights close enough to `version`'s."""
        entries = [(features[index], weights) for _, features, weights in self.entries(live)
                   if not math.isnan(features[index])]
        values = [value for value, _ in entries]
        if len(values) < 2:
            return None
        if version is not None:
            recent = _same_weights(entries, version)
            return None if recent is None else (statistics.median(recent), max(_spread_within_weights(entries), floor))
        middle = statistics.median(values)
        spread = _MAD_TO_SIGMA * statistics.median(abs(value - middle) for value in values)
        return statistics.median(values[-max(2, len(values) // _RECENT_PART):]), max(spread, floor)


def _spread_within_weights(entries: list[tuple[float, int | None]]) -> float:
    """The MAD (as a standard deviation) of the values around their own weights' median."""
    by_weights: dict[int | None, list[float]] = {}
    for value, weights in entries:
        by_weights.setdefault(weights, []).append(value)
    middles = {weights: statistics.median(values) for weights, values in by_weights.items()}
    return _MAD_TO_SIGMA * statistics.median(abs(value - middles[weights]) for value, weights in entries)


def _same_weights(entries: list[tuple[float, int | None]], version: int) -> list[float] | None:
    """The values of the newest weights at or before `version` (whole versions, newest first, until
    `_SAME_WEIGHTS_REPLIES`), or None when those reach back more than `STALE_VERSIONS` versions."""
    chosen: list[float] = []
    for weights in sorted({w for _, w in entries if w is not None and w <= version}, reverse=True):
        if weights < version - STALE_VERSIONS:
            break
        chosen += [value for value, w in entries if w == weights]
        if len(chosen) >= _SAME_WEIGHTS_REPLIES:
            return chosen
    return None
