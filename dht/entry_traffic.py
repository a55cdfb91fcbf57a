"""What this peer's DHT process carries, by record family: the entries it receives and the requests
it sends.

How a node's DHT traffic grows with the swarm is which entries it has to carry and how many
requests it makes to carry them, each with its own authorization both ways. Both are counted
where they pass, in the DHT process; `dht_traffic` is the coroutine that reads them from there
(`SwarmDHT.traffic`).

- `ReceivedEntries`: every store another peer sends here, and every entry a read's answer brings
  back. hivemind hands each to the record validators before anything else is done with it (a
  store on the holder, a find's and a changed find's answer on the reader), so a validator that
  judges nothing and runs first sees every entry as it came off the wire, its owner's signature
  and writer's credential included. Entries this peer stores in its own storage pass through the
  same validation; they are told apart by their owner (this peer's key in the subkey) and not
  counted, so a read that brings back this peer's own entry from a holder is not counted either
  (one entry of a stage's R, at most, a read). Bytes: the key's hash, the subkey and the value.
- `SentRequests` (`SENT`): every request an admitted peer's DHT process sends goes through
  `PeerStub` (dht/token_authorizer.py), hivemind's and ours alike (finds, stores, pings, changed
  finds and their digests), which counts it by method and by the family of its first key: the
  calls, the request's bytes and the response's, each as protobuf encodes it with its
  authorization (the token and signature every request and response carry). The p2pd framing,
  libp2p's own messages and TCP are not in them; the interface's byte counter has it all.
- Counted by family name (dht/key_families.py, `bans` for the ban list, `other` for hivemind's
  matchmaking keys and any key of no family; `-` for a request with no key, a ping), never by
  key, so the tables stay a handful of rows whatever keys a request names.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Optional

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from agora.dht.key_families import BAN_LIST
from agora.dht.key_policy import KeyTable
from agora.dht.record_fields import MAX_STAGES

__all__ = ["NO_KEY", "OTHER", "SENT", "ReceivedEntries", "SentRequests", "dht_traffic", "family_name",
           "received_entries"]

OTHER = "other"
NO_KEY = "-"


def family_name(keys: Optional[KeyTable], key: bytes) -> str:
    """The family of the key hashed to ``key`` (``OTHER`` if none, or no table to ask)."""
    found = None if keys is None else keys.family(key)
    if found is None:
        return OTHER
    return "bans" if found[0] is BAN_LIST else found[0].name


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

    def validate(self, record: DHTRecord) -> bool:
        if self._own and self._own in record.subkey:
            return True  # this peer's own entry
        name = family_name(self._keys, record.key)
        size = len(record.key) + len(record.subkey) + len(record.value)
        with self._lock:
            self._entries[name] += 1
            self._bytes[name] += size
        return True

    def restored(self, key: bytes, subkey: bytes, added: int) -> None:
        """An entry counted here had its writer's chain named on the wire and put back before it was
        judged (dht/entry_chains.py): ``added`` of the bytes counted never crossed the wire."""
        if self._own and self._own in subkey:
            return
        name = family_name(self._keys, key)
        with self._lock:
            self._bytes[name] -= added

    def counts(self) -> dict[str, tuple[int, int]]:
        """(entries, bytes) received so far, by family."""
        with self._lock:
            return {name: (self._entries[name], self._bytes[name]) for name in sorted(self._entries)}

    @property
    def priority(self) -> int:
        # Validation runs from the highest priority down, each validator stripping its part before the
        # next: above the owner's signature (10), so the entry is counted whole.
        return 100


class SentRequests:
    """Requests sent, by "method family": (calls, request bytes, response bytes)."""

    def __init__(self) -> None:
        self.keys: Optional[KeyTable] = None  # the run's keys (`use_peer_stubs` sets them)
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}

    def add(self, method: str, request: Any, response: Any) -> None:
        """One request (its authorization in it) and its response (None: none came back)."""
        name = f"{method.removeprefix('rpc_')} {self._family(request)}"
        sent = request.ByteSize()
        back = 0 if response is None else response.ByteSize()
        with self._lock:
            counts = self._counts.setdefault(name, [0, 0, 0])
            counts[0] += 1
            counts[1] += sent
            counts[2] += back

    def _family(self, request: Any) -> str:
        keys = getattr(request, "keys", None)  # a find's or store's repeated field, indexed as it is (every RPC)
        key = keys[0] if keys else getattr(request, "key", b"")
        return family_name(self.keys, key) if key else NO_KEY

    def counts(self) -> dict[str, tuple[int, int, int]]:
        with self._lock:
            return {name: tuple(counts) for name, counts in sorted(self._counts.items())}


SENT = SentRequests()  # this DHT process's (dht/token_authorizer.py's PeerStub adds to it)


def received_entries(validator: Any) -> Optional[ReceivedEntries]:
    """The ``ReceivedEntries`` among a DHT's record validators, if any."""
    if isinstance(validator, ReceivedEntries):
        return validator
    for inner in getattr(validator, "_validators", ()):  # hivemind's CompositeValidator
        if isinstance(inner, ReceivedEntries):
            return inner
    return None


async def dht_traffic(_dht: Any, node: Any) -> dict[str, dict]:
    """Run in the DHT process (`run_coroutine`): {"received": `ReceivedEntries.counts()` ({} without
    one), "sent": `SENT.counts()`}."""
    counter = received_entries(node.protocol.record_validator)
    return {"received": {} if counter is None else counter.counts(), "sent": SENT.counts()}
