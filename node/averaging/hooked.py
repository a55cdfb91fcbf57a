"""The step hook's snapshots of a round's slice, handed from a worker's compute thread to its
averaging loop (node/averaging/loop.py): a round snapshots its slice at the step it falls due,
on the compute thread, and runs later on the loop, so the snapshot waits here meanwhile."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["Hooked", "HookedSnapshots"]


@dataclass
class Hooked:
    round: int
    local: torch.Tensor  # `_local_part` at `step`
    samples: int
    step: int


class HookedSnapshots:
    """The step hook's snapshots, handed from the compute thread to the loop (thread-safe).

    `newest`: the latest round the hook snapshotted (one slot: the loop never runs an older one,
    and a slice of a large stage is not small). `reserved`: the round the loop settled on as its
    next when the previous round's result arrived, kept here because the hook may overwrite
    `newest` while that result is being applied.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._newest: Optional[Hooked] = None
        self._reserved: Optional[Hooked] = None

    def put(self, hooked: Hooked) -> None:
        with self._lock:
            self._newest = hooked

    def reserve(self, after_round: int, steps: int) -> None:
        """Settle the next round when `after_round`'s result arrives, at local step `steps`: the
        newest snapshot if no step has happened since it was taken; one that came due while the
        round ran and is no longer current is dropped (skipped, not started late)."""
        with self._lock:
            newest = self._newest
            if newest is not None and newest.round > after_round:
                self._newest = None
                if newest.step >= steps:
                    self._reserved = newest

    def next_after(self, last_round: int) -> Optional[int]:
        """The round to run now from the hook's snapshots: the reserved one, else the newest (taken
        while no round ran, or since the last result), if later than `last_round`."""
        with self._lock:
            for hooked in (self._reserved, self._newest):
                if hooked is not None and hooked.round > last_round:
                    return hooked.round
            return None

    def take(self, round_number: int) -> Optional[Hooked]:
        """The snapshot of this round, if the hook took one; those of earlier rounds are dropped."""
        with self._lock:
            found = None
            for name in ("_reserved", "_newest"):
                hooked = getattr(self, name)
                if hooked is not None and hooked.round <= round_number:
                    setattr(self, name, None)
                    if hooked.round == round_number:
                        found = hooked
            return found

    def carry(self, same_slice: Callable[[int], bool], delta: torch.Tensor, moments_from: Optional[int]) -> None:
        """Add an applied delta to the snapshots of the same slice (see `_carry_into_hooked`)."""
        with self._lock:
            for hooked in (self._reserved, self._newest):
                if hooked is not None and same_slice(hooked.round):
                    hooked.local.add_(delta)
                    if moments_from is not None:
                        hooked.local[moments_from:].clamp_min_(0.0)  # exp_avg_sq, as applied
