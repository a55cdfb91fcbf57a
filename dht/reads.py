"""How this peer reads a dictionary key (a stage's workers, a key with subkeys): which reads visit the
whole search beam and which stop at the first holder as new as what it saw, and what it remembers.

Design choices:

- Bytes. A holder answers a find with the key's whole dictionary: every entry of the stage, each with
  its writer's credential chain (2.7 KB a worker entry). hivemind's latest read (``latest=True``)
  visits every peer of its beam (``READ_BEAM``, 8) and merges what each holds, so one read cost about
  eight dictionaries and grew like the stage, like N. A *quick* read asks one peer at a time
  (``num_workers=1``, nearest first) and stops at the first whose dictionary holds an entry expiring
  no earlier than the newest this peer has seen there (hivemind's ``sufficient_expiration_time``): a
  holder that kept up with the writers, usually the nearest. About one dictionary a read.
- What a quick read can miss: an entry the holder it stopped at lacks (a store to it failed, or it
  joined nearer since and has not seen that writer's next beat) and this peer has not seen before.
  So every ``FULL_READ_EVERY``-th read of a key (the first included) is a latest read over the whole
  beam, as before: such an entry is missed by at most one read, never for good, whichever holder
  lacks it and for however long. A holder *behind* what this peer saw (missing the newest entry) does
  not end a quick read: its dictionary is not new enough, and the search goes on to the next.
- Memory. Each read's answer is merged into what this peer's reads of that key returned before,
  subkey by subkey, the later expiration winning (hivemind's own rule, so a tombstone outlives its
  entry), expired entries dropped: an entry seen once stays visible until it expires or a later
  tombstone is seen, even while the holder a quick read stops at lacks it. This is what hivemind's
  local cache did for latest reads; that cache is off (``CACHE_OPTIONS``), since a cached copy would
  answer a quick read by itself, locally, every time (the local search comes first and the cache holds
  the last answer, as new as anything seen), and it cost more bytes of its own: each read found
  something newer than the cache, so hivemind pushed the merged dictionary to one more peer
  (``cache_nearest``), and each store of a cached dictionary key started a background read of it over
  20 peers (``cache_on_store``). A holder's own storage still answers its quick reads: it is a holder's
  copy like any other.
- Where a read goes: to the key's holders this peer's DHT process remembers (dht/holder_reads.py).
- Only what changed. A read names the entries this peer holds (``held``) and a holder answers with
  the others and the newer ones (dht/changed_finds.py); ``merge`` makes the whole dictionary again.
  Should the memory forget the key between the two (past ``_MAX_KEYS`` keys at once), that one read
  returns the changes alone, a miss of the kind a quick read can make, mended by the next read.
- Plain keys (one value, no subkeys) are read latest: one small value per holder, the latest wins.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from hivemind.utils.timed_storage import ValueWithExpiration

from agora.dht.changed_finds import Seen, subkey_digest
from agora.dht.entry_reader import is_subkey_dict

__all__ = ["CACHE_OPTIONS", "FULL_READ_EVERY", "ReadMemory"]

# Every this-many-th read of a key visits the whole beam (the first one too); the others are quick.
FULL_READ_EVERY = 2
# hivemind DHTNode options: no local cache of found values, none pushed to peers, none kept on store.
CACHE_OPTIONS = {"cache_locally": False, "cache_nearest": 0, "cache_on_store": False}
# Keys remembered at once; past it the oldest is forgotten (its next read is a full one).
_MAX_KEYS = 512


class ReadMemory:
    """Per dictionary key: what this peer's reads returned (merged), and which read comes next.

    Thread-safe: reads of one ``SwarmDHT`` come from several threads.
    """

    def __init__(self, clock: Callable[[], float], *, full_read_every: int = FULL_READ_EVERY,
                 max_keys: int = _MAX_KEYS) -> None:
        if full_read_every < 1:
            raise ValueError(f"full_read_every must be >= 1, got {full_read_every}")
        self._clock = clock
        self._full_read_every = full_read_every
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self._seen: dict[str, dict[Any, ValueWithExpiration[Any]]] = {}
        self._reads: dict[str, int] = {}

    def next_bar(self, key: str) -> Optional[float]:
        """None: the next read of ``key`` is a full (latest) one. Else it is quick, and this is the
        expiration a holder's dictionary must reach to end it: the newest this peer has seen there."""
        with self._lock:
            count = self._reads.pop(key, 0)
            self._reads[key] = count + 1  # re-inserted: the dict's order is the reads' recency
            while len(self._reads) > self._max_keys:
                self._reads.pop(next(iter(self._reads)))
            seen = self._live(key)
            if count % self._full_read_every == 0 or not seen:
                return None
            return max(item.expiration_time for item in seen.values())

    def held(self, key: str) -> Seen:
        """What this peer holds under ``key``, as a changed find names it (dht/changed_finds.py): the
        holders answer with the rest only, and ``merge`` puts the two together again."""
        with self._lock:
            return {subkey_digest(subkey): item.expiration_time for subkey, item in self._live(key).items()}

    def merge(self, key: str, found: Optional[ValueWithExpiration[Any]]) -> Optional[ValueWithExpiration[Any]]:
        """``found`` (a read's answer) merged into what this peer saw there before, and remembered.

        A plain value (not subkeys) is returned as found and forgets the key's dictionary."""
        if found is not None and not is_subkey_dict(found.value):
            with self._lock:
                self._seen.pop(key, None)
            return found
        with self._lock:
            merged = dict(self._live(key))
            for subkey, item in ({} if found is None else found.value).items():
                held = merged.get(subkey)
                if held is None or item.expiration_time > held.expiration_time:
                    merged[subkey] = item
            self._seen.pop(key, None)
            if not merged:
                return found
            self._seen[key] = merged
            while len(self._seen) > self._max_keys:
                self._seen.pop(next(iter(self._seen)))
            return ValueWithExpiration(merged, max(item.expiration_time for item in merged.values()))

    def _live(self, key: str) -> dict[Any, ValueWithExpiration[Any]]:
        now = self._clock()
        return {subkey: item for subkey, item in self._seen.get(key, {}).items() if item.expiration_time >= now}
