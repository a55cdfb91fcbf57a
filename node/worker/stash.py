"""The forward-input store a worker keeps for Backward: bounded in count and in age.

A worker runs Forward without autograd and keeps only the forward's *input* (wire + token ids);
Backward recomputes the forward with grad on it (docs/design.md, "A microbatch's path", step 4).
Microbatches whose backward never comes (the trainer died, the route was abandoned) must not
pile up, hence two bounds:

- capacity: beyond it the oldest entry is evicted (a worker under load forgets the stalest work);
- TTL: an entry older than `ttl_s` is gone, checked lazily on every access (no timer thread).

A key is stored once: `put` refuses a key that is still live instead of replacing its entry.
Keys are microbatch ids bound to the trainer that ran the forward (node/worker/compute.py), and
a second Forward under the same id would otherwise overwrite someone's pending work.

The clock is injected so tests expire entries without sleeping. Not thread-safe by design: only
the worker's compute thread touches it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Generic, TypeVar

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
        self._entries: OrderedDict[str, tuple[float, V]] = OrderedDict()

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
            key, (deadline, _) = next(iter(self._entries.items()))
            if deadline > now:
                break
            del self._entries[key]
            dropped += 1
        return dropped

    def values(self) -> list[V]:
        """The live entries, oldest first."""
        self.expire()
        return [value for _, value in self._entries.values()]

    def put(self, key: str, value: V) -> list[str]:
        """Store a new entry; returns the keys evicted for room. AlreadyStashed if `key` is live."""
        self.expire()
        if key in self._entries:
            raise AlreadyStashed(key)
        self._entries[key] = (self._clock() + self.ttl_s, value)
        evicted = []
        while len(self._entries) > self.capacity:
            evicted.append(self._entries.popitem(last=False)[0])
        return evicted

    def get(self, key: str) -> V:
        """The live entry for `key`; KeyError if it was never stored, expired or was evicted."""
        self.expire()
        return self._entries[key][1]

    def pop(self, key: str) -> V:
        self.expire()
        return self._entries.pop(key)[1]
