"""`WireScale`: how large the values crossing one stage boundary usually are, and when a frame is too large.

A codec frame may carry any finite float32, and a peer chooses what its frames carry: a stage worker
its outputs and input gradients, a trainer the output gradients it relays. Values a million times
what the stage produces are finite, pass every shape and NaN check, and either overflow the next
stage (whose refusal then looked like its own fault) or train it on nonsense. No fixed bound fits
every model and every point of a run, so the bound is relative to what the same boundary carried
lately. Design choices:

- The measure is a frame's largest magnitude (max |value|): what overflows a stage, and what a lie
  confined to one token's vector still moves. A relayed frame yields it from the pass that checks
  it for NaN (`WireCodec.inspect`).
- The scale is the median of the last `window` accepted frames' measures: a minority of liars,
  however large their values, cannot move it, and it follows an honest run's drift (gradients shrink
  as the loss falls; a loss spike is a few frames). Refused frames never enter it.
- A frame is refused beyond `factor` times the scale; honest frames of one boundary stay within a
  small factor of each other, so the default factor is generous (see where each user sets it).
- Nothing is refused before `warmup` frames were accepted: a fresh scale knows nothing. Until
  then the stage's own overflow check is what stops values at float32's limit.
- With half the frames or more from liars, the median is theirs: like robust averaging, this needs
  an honest majority of what a boundary carries.
- `peak_ratio` is the largest measure over the scale among accepted frames since warm-up: how far
  honest traffic stays from the bound, for metrics.

Pure: no torch, no clock, no socket; one instance per boundary, called from one thread.
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["WireScale", "DEFAULT_SCALE_WINDOW"]

# Accepted frames the median is taken over.
DEFAULT_SCALE_WINDOW = 64


class WireScale:
    """The running scale of one boundary's frames, and the bound it implies (module docstring)."""

    def __init__(self, factor: float, warmup: int, window: int = DEFAULT_SCALE_WINDOW):
        if not factor > 1:
            raise ValueError(f"factor must be above 1, got {factor}")
        if warmup < 1 or window < 1:
            raise ValueError(f"warmup and window must be positive, got {warmup} and {window}")
        self.factor = factor
        self.warmup = warmup
        self._recent: deque[float] = deque(maxlen=window)
        self.accepted = 0
        self.refused = 0
        self.peak_ratio = 0.0

    @property
    def scale(self) -> float | None:
        """The median of the recent accepted measures (None: nothing accepted yet)."""
        return statistics.median(self._recent) if self._recent else None

    def bound(self) -> float | None:
        """The largest measure accepted now; None while warming up, or while the scale is 0 (frames of
        zeros give nothing to scale by)."""
        scale = self.scale
        if self.accepted < self.warmup or not scale:
            return None
        return self.factor * scale

    def vouches(self, largest: float) -> bool:
        """Whether this scale, warmed up, holds a frame of this measure ordinary: within the bound."""
        bound = self.bound()
        return bound is not None and largest <= bound

    def refuses(self, largest: float) -> float | None:
        """The bound a frame of this measure exceeds (counted as refused), or None: it may be accepted."""
        bound = self.bound()
        if bound is not None and not largest <= bound:  # NaN is refused as well
            self.refused += 1
            return bound
        return None

    def accept(self, largest: float) -> None:
        """Count an accepted frame's measure into the scale (after `refuses` said None)."""
        scale = self.scale if self.accepted >= self.warmup else None
        if scale:
            self.peak_ratio = max(self.peak_ratio, largest / scale)
        self._recent.append(largest)
        self.accepted += 1

    def admit(self, largest: float) -> float | None:
        """Judge one frame: None when accepted (and counted into the scale), else the bound it exceeds.
        A caller that may still fail the frame for other reasons calls `refuses`, then `accept` once
        it is taken."""
        bound = self.refuses(largest)
        if bound is None:
            self.accept(largest)
        return bound
