"""How much of a DHT peer's memory other peers' stores may take: per owner and in all.

hivemind keeps every entry a peer accepts until it expires (``DHTLocalStorage`` has no bound,
and its cache, bounded or not, evicts the entries that expire first when full). So one admitted
peer could fill an honest peer's memory with entries of its own, and a bound that evicted would
let it push honest entries out. Here a store over a bound is refused and counted, and what is
already held stays.

Design choices:

- Counted per entry (a key and one subkey) as the record validator accepts it for an incoming
  store: the validator is the last check before hivemind's ``rpc_store`` writes the entry, and
  hivemind offers no other hook into its storage (``DHTProtocol.create`` builds its own
  ``DHTLocalStorage``). A re-store of the same entry replaces its count; an entry leaves the
  count when it expires. hivemind may still refuse a counted store (an entry it holds expires
  later); that entry's slot is counted either way, so the count never exceeds what is held by
  more than those slots' later expirations.
- The owner is the entry's proven writer: the peer id its subkey names (the signature validator
  makes that the writer's own key for our records), or hivemind's averaging entries' peer id.
  So entries an honest peer relays (hivemind re-stores what it finds, and hands its entries to
  a peer it meets) count against their writers, not against the relaying peer.
- Which call is an incoming store is known only where the request arrives: the token authorizer
  (dht/security.py) marks the store's context (``STORE_CONTEXT``, a context variable: grpc-like,
  each request is handled in its own task) before hivemind runs the handler; finds and a peer's
  own stores are not counted.
- Bounds (``StorageLimits``) are generous: an honest owner's largest footprint is a trainer's
  one entry per unit block it touched (4096 blocks at most, 3 KB each with the credential).
"""

from __future__ import annotations

import heapq
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass as plain_dataclass
from typing import Any, Callable, Optional

from pydantic import StrictInt
from pydantic.dataclasses import dataclass

from agora.dht.key_policy import Refusal
from agora.pipeline.schema import SECTION, setting

__all__ = ["STORE_CONTEXT", "IncomingStores", "StorageLedger", "StorageLimits", "StoreContext"]

_MIB = 1 << 20


@dataclass(frozen=True, config=SECTION)
class StorageLimits:
    """What other peers' stores may hold in this peer's DHT storage."""

    max_entries_per_owner: StrictInt = setting(
        8192, "DHT entries one peer's writes may hold here (a trainer holds one per unit block it touched)", gt=0)
    max_bytes_per_owner: StrictInt = setting(32 * _MIB, "bytes one peer's DHT entries may hold here", gt=0)
    max_entries: StrictInt = setting(262144, "DHT entries all other peers' writes may hold here", gt=0)
    max_bytes: StrictInt = setting(512 * _MIB, "bytes all other peers' DHT entries may hold here", gt=0)


@plain_dataclass(frozen=True)
class StoreContext:
    """The incoming store being handled: who sent it, and which of its entries it stores one by
    one, as (key, subkey tag); the rest come as whole dictionaries (a peer handing on what it holds)."""

    sender: str
    single: frozenset[tuple[bytes, bytes]]

    @classmethod
    def of(cls, sender: str, request: Any) -> StoreContext:
        """The context of a hivemind ``StoreRequest`` from ``sender`` (a whole dictionary's subkey
        tag is b"": ``DHTProtocol.IS_DICTIONARY``)."""
        return cls(sender, frozenset((bytes(key), bytes(tag)) for key, tag in zip(request.keys, request.subkeys)
                                     if tag != b""))


STORE_CONTEXT: ContextVar[Optional[StoreContext]] = ContextVar("agora_dht_store", default=None)


class StorageLedger:
    """The entries counted against each owner and in all; ``admit`` says whether one more fits."""

    def __init__(self, limits: StorageLimits):
        self.limits = limits
        self.refused: Counter[str] = Counter()  # stores over a bound: "owner" or "total"
        self._held: dict[tuple[bytes, bytes], tuple[str, int, float]] = {}  # entry -> (owner, bytes, expiration)
        self._owners: dict[str, list[int]] = {}  # owner -> [entries, bytes]
        self._entries = 0
        self._bytes = 0
        self._expiries: list[tuple[float, bytes, bytes]] = []  # heap; stale items are skipped

    @property
    def entries(self) -> int:
        return self._entries

    def held_by(self, owner: str) -> tuple[int, int]:
        """(entries, bytes) counted against ``owner``."""
        entries, size = self._owners.get(owner, (0, 0))
        return entries, size

    def admit(self, key: bytes, subkey: bytes, owner: str, size: int, expiration: float, now: float
              ) -> Optional[str]:
        """Count the entry (key, subkey) of ``owner`` (``size`` bytes, until ``expiration``) and
        return None, or return why it does not fit (``owner`` or ``total``; counted, nothing changes)."""
        self._forget_expired(now)
        entry = (key, subkey)
        previous = self._held.get(entry)
        new_entries = 0 if previous is not None else 1
        new_bytes = size - (0 if previous is None else previous[1])
        entries, held = self.held_by(owner)
        limits = self.limits
        if entries + new_entries > limits.max_entries_per_owner or held + new_bytes > limits.max_bytes_per_owner:
            self.refused["owner"] += 1
            return (f"over this peer's bound for one owner ({limits.max_entries_per_owner} entries, "
                    f"{limits.max_bytes_per_owner} bytes): {owner:.60} holds {entries} entries, {held} bytes")
        if self._entries + new_entries > limits.max_entries or self._bytes + new_bytes > limits.max_bytes:
            self.refused["total"] += 1
            return (f"over this peer's storage bound ({limits.max_entries} entries, {limits.max_bytes} bytes): "
                    f"{self._entries} entries, {self._bytes} bytes held")
        if previous is not None:
            self._drop(entry)
        self._hold(entry, owner, size, expiration)
        return None

    def _hold(self, entry: tuple[bytes, bytes], owner: str, size: int, expiration: float) -> None:
        self._held[entry] = (owner, size, expiration)
        counts = self._owners.setdefault(owner, [0, 0])
        counts[0] += 1
        counts[1] += size
        self._entries += 1
        self._bytes += size
        heapq.heappush(self._expiries, (expiration, *entry))

    def _drop(self, entry: tuple[bytes, bytes]) -> None:
        owner, size, _ = self._held.pop(entry)
        counts = self._owners[owner]
        counts[0] -= 1
        counts[1] -= size
        if counts[0] == 0:
            del self._owners[owner]
        self._entries -= 1
        self._bytes -= size

    def _forget_expired(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] < now:
            expiration, *entry = heapq.heappop(self._expiries)
            held = self._held.get(tuple(entry))
            if held is not None and held[2] == expiration:  # else a later store replaced it
                self._drop(tuple(entry))


class IncomingStores:
    """The record validator's checks of an entry another peer stores here (module docstring):
    a banned writer's new entry is refused, and the storage bounds apply. Outside an incoming
    store (a find, this peer's own store) it checks nothing."""

    def __init__(self, limits: StorageLimits, is_banned: Callable[[str], bool]):
        self.ledger = StorageLedger(limits)
        self._is_banned = is_banned

    def admit(self, key: bytes, subkey: bytes, value: bytes, expiration: float, writer: str, now: float) -> None:
        """``Refusal`` (``banned``, ``storage``) unless the entry of ``writer`` may be stored.

        A banned writer's entries that come as a whole dictionary are old ones a peer hands on:
        hivemind takes or refuses a dictionary whole, so refusing would drop its other writers'
        entries too; readers skip them (``SwarmDHT``)."""
        context = STORE_CONTEXT.get()
        if context is None:
            return
        if (key, subkey) in context.single and self._is_banned(writer):
            raise Refusal("banned", f"{writer} is banned by the run's operator")
        problem = self.ledger.admit(key, subkey, writer, len(value) + len(subkey), expiration, now)
        if problem is not None:
            raise Refusal("storage", f"from {context.sender}: {problem}")
