"""`ReceivedEntries`: the DHT entries this peer received, and their bytes, by record family.

How a node's DHT traffic grows with the swarm is mostly which entries it has to carry: every
store another peer sends here, and every entry a read's answer brings back. hivemind hands each of
them to the record validators before anything else is done with it (a store on the holder, a
find's and a changed find's answer on the reader), so a validator that judges nothing and runs
first sees every entry as it came off the wire, its owner's signature and writer's credential
included: that is where they are counted. Entries this peer stores in its own storage pass through
the same validation; they are told apart by their owner (this peer's key in the subkey) and not
counted, so a read that brings back this peer's own entry from a holder is not counted either
(one entry of a stage's R, at most, a read).

- Counted by family name (dht/key_families.py, `bans` for the ban list, `other` for hivemind's
  matchmaking keys and any key of no family), never by key, so the table stays a handful of rows.
- It lives in the DHT process (the validators' process); `received_entries` is the coroutine that
  reads it from there (`SwarmDHT.received_entries`).
- Bytes: the key's hash, the subkey and the value, as hivemind passes them; the message framing
  around them and the digests a read names are not entries and are not counted.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Optional

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from agora.dht.key_families import BAN_LIST
from agora.dht.key_policy import KeyTable
from agora.dht.record_fields import MAX_STAGES

__all__ = ["OTHER", "ReceivedEntries", "received_entries"]

OTHER = "other"


class ReceivedEntries(RecordValidatorBase):
    """Counts every entry hivemind validates here, by family; refuses nothing."""

    def __init__(self, run_id: str, *, methods: tuple[str, ...], owner_public_key: str = "",
                 max_stages: int = MAX_STAGES):
        self._keys = KeyTable(run_id, methods=methods, max_stages=max_stages)
        self._own = owner_public_key.encode("ascii")  # OpenSSH text, as hivemind's owner marker holds it
        self._lock = threading.Lock()
        self._entries: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()

    def __getstate__(self) -> dict[str, Any]:
        return {"_keys": self._keys, "_own": self._own}  # counts start in the process that receives

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._keys, self._own = state["_keys"], state["_own"]
        self._lock = threading.Lock()
        self._entries, self._bytes = Counter(), Counter()

    def family(self, key: bytes) -> str:
        found = self._keys.family(key)
        if found is None:
            return OTHER
        return "bans" if found[0] is BAN_LIST else found[0].name

    def validate(self, record: DHTRecord) -> bool:
        if self._own and self._own in record.subkey:
            return True  # this peer's own entry
        name = self.family(record.key)
        size = len(record.key) + len(record.subkey) + len(record.value)
        with self._lock:
            self._entries[name] += 1
            self._bytes[name] += size
        return True

    def counts(self) -> dict[str, tuple[int, int]]:
        """(entries, bytes) received so far, by family."""
        with self._lock:
            return {name: (self._entries[name], self._bytes[name]) for name in sorted(self._entries)}

    @property
    def priority(self) -> int:
        # Validation runs from the highest priority down, each validator stripping its part before the
        # next: above the owner's signature (10), so the entry is counted whole.
        return 100


def _find(validator: Any) -> Optional[ReceivedEntries]:
    if isinstance(validator, ReceivedEntries):
        return validator
    for inner in getattr(validator, "_validators", ()):  # hivemind's CompositeValidator
        if isinstance(inner, ReceivedEntries):
            return inner
    return None


async def received_entries(_dht: Any, node: Any) -> dict[str, tuple[int, int]]:
    """Run in the DHT process (`run_coroutine`): what its `ReceivedEntries` counted, {} without one."""
    counter = _find(node.protocol.record_validator)
    return {} if counter is None else counter.counts()
