"""The forward-input store a worker keeps for Backward: bounded in count and in age.

A worker runs Forward without autograd and keeps only the forward's *input* (wire + token ids);
Backward recomputes the forward with grad on it (docs/design.md, "A microbatch's path", step 4).
Microbatches whose backward never comes (the trainer died, the route was abandoned) must not
pile up, hence two bounds:

- capacity: beyond it an entry is evicted (a worker under load forgets the stalest work), chosen
  fairly among owners (the trainers that ran the forwards): the oldest entry of the owner holding
  the most entries, the caller's own when it is one of them. With n owners, one holding at most
  `capacity / n` entries is never a largest holder when the stash overflows, so it loses nothing
  to the others' Forwards: a flood of Forwards from one trainer evicts its own work, not another's
  pending Backward. Eviction rather than refusal keeps the old contract for a single trainer (its
  stalest work goes, its new Forward is served). Only owners beyond `capacity` in number (each
  holding one entry) evict one another's oldest: that takes as many credentials as the stash has
  slots;
- TTL: an entry older than `ttl_s` is gone, checked lazily on every access (no timer thread).

A key is stored once: `put` refuses a key that is still live instead of replacing its entry.
Keys are microbatch ids bound to the trainer that ran the forward (node/replica/compute.py), and
a second Forward under the same id would otherwise overwrite someone's pending work.

The clock is injected so tests expire entries without sleeping. Not thread-safe by design: only
the worker's compute thread touches it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

__all__ = ["ForwardStash", "AlreadyStashed"]

V = TypeVar("V")


class AlreadyStashed(KeyError):
    """`put` of a key whose entry is still live."""


class ForwardStash(Generic[V]):
    def __init__(self, capacity: int, ttl_s: float, *, clock: Callable[[], float] = time.monotonic):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        # Insertion order == expiry order (one TTL for all), so expiry scans only the front.
        self._entries: OrderedDict[str, tuple[float, Hashable, V]] = OrderedDict()
        self._owned: dict[Hashable, OrderedDict[str, None]] = {}  # owner -> its keys, oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        self.expire()
        return key in self._entries

    def expire(self) -> int:
        """Drop entries past their TTL; returns how many."""
        now = self._clock()
        dropped = 0
        while self._entries:
            key, (deadline, _, _) = next(iter(self._entries.items()))
            if deadline > now:
                break
            self._remove(key)
            dropped += 1
        return dropped

    def _remove(self, key: str) -> V:
        _, owner, value = self._entries.pop(key)
        keys = self._owned[owner]
        del keys[key]
        if not keys:
            del self._owned[owner]
        return value

    def owners(self) -> dict[Hashable, int]:
        """Live entries per owner."""
        self.expire()
        return {owner: len(keys) for owner, keys in self._owned.items()}

    def keys_of(self, owner: Hashable) -> list[str]:
        """The live keys `owner` put, oldest first."""
        self.expire()
        return list(self._owned.get(owner, ()))

    def values(self) -> list[V]:
        """The live entries, oldest first."""
        self.expire()
        return [value for _, _, value in self._entries.values()]

    def put(self, key: str, value: V, *, owner: Hashable = None) -> list[str]:
        """Store a new entry of `owner`; returns the keys evicted for room (see the module docstring).
        AlreadyStashed if `key` is live."""
        self.expire()
        if key in self._entries:
            raise AlreadyStashed(key)
        self._entries[key] = (self._clock() + self.ttl_s, owner, value)
        self._owned.setdefault(owner, OrderedDict())[key] = None
        evicted = []
        while len(self._entries) > self.capacity:
            victim = self._victim(owner, key)
            self._remove(victim)
            evicted.append(victim)
        return evicted

    def _victim(self, caller: Hashable, new_key: str) -> str:
        """The entry to evict for `caller`'s new entry `new_key`: the caller's own oldest when it holds
        as many as anyone (and more than the new one), else the oldest entry of the largest holders."""
        most = max(len(keys) for keys in self._owned.values())
        own = self._owned[caller]
        if len(own) == most and len(own) > 1:
            return next(iter(own))
        return next(key for key, (_, owner, _) in self._entries.items()
                    if key != new_key and len(self._owned[owner]) == most)

    def get(self, key: str) -> V:
        """The live entry for `key`; KeyError if it was never stored, expired or was evicted."""
        self.expire()
        return self._entries[key][2]

    def pop(self, key: str) -> V:
        self.expire()
        if key not in self._entries:
            raise KeyError(key)
        return self._remove(key)
