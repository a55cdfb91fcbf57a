"""Which work a replica has applied: a unit's microbatch adds its gradient here at most once.

Trainers lease data units (dht/leases.py); a trainer that dies after its microbatches reached the
workers leaves its unit uncommitted, and another trainer reclaims it and runs it again. Every
attempt of the same microbatch carries the same work key ("u12m3": unit 12, microbatch 3; the
microbatch id is fresh per attempt), so a replica that applied it before computes the repeat (the
stages after it still need its output and gradient) without adding the gradient a second time.

What a key costs is its string: a replica remembers the last `capacity` keys it applied (65,536
by default: hundreds of global batches of any preset), far more than a lease can lag. A key is
forgotten when its gradient is taken back out (Abort), so a rerouted attempt applies it again.

The keys go into the stage's checkpoint (`StageCompute.work_in_weights`: those whose gradient
the saved weights hold, not those still accumulating), so a worker resumed from it still knows
what it applied: a unit its dead trainer left uncommitted, reclaimed after the restart, is not
added twice (node/replica/checkpoints.py).
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["WorkLedger", "MAX_WORK_KEY_CHARS"]

MAX_WORK_KEY_CHARS = 64


class WorkLedger:
    def __init__(self, capacity: int = 65_536):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()
        self.repeats = 0  # microbatches computed without applying their gradient again

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def apply(self, key: str) -> bool:
        """True if `key`'s gradient should be added now (never seen, or no key); False for a repeat."""
        if not key:
            return True
        if key in self._keys:
            self.repeats += 1
            return False
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return True

    def forget(self, key: str) -> None:
        """Its gradient was taken back out: the next attempt applies it."""
        self._keys.pop(key, None)

    def keys(self) -> list[str]:
        """The keys it remembers, oldest first."""
        return list(self._keys)

    def restore(self, keys: object) -> None:
        """Remember `keys` (a checkpoint's, oldest first) in place of what it had; ValueError names
        what is wrong with them, and then nothing changes."""
        if not isinstance(keys, (list, tuple)) or not all(
                isinstance(key, str) and 0 < len(key) <= MAX_WORK_KEY_CHARS for key in keys):
            raise ValueError(f"work keys: expected a list of strings of 1 to {MAX_WORK_KEY_CHARS} characters")
        self._keys = OrderedDict.fromkeys(list(keys)[-self.capacity:])
