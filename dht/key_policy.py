"""Which keys an admitted peer may store in this run's DHT, looked up by the hash hivemind names them by.

hivemind sends only a key's hash (``DHTID``), never the key, so a validator knows a key by
listing every key it accepts and hashing each once. The list (key_families.py, keys.py) is:

- the per-peer record families (``typed_keys``: workers and rounds of every stage, trainers,
  moves, unit blocks), each with its record type;
- the ban list (``bans_key``, dht/bans.py);
- hivemind's matchmaking keys of this run's averagers (``averaging_keys``: ``{prefix}.0b{bits}``
  for every stage, method and group bits), whose entries are a flag under a peer id's bytes.

Any other key is refused, so an admitted peer cannot use the DHT as storage of its own.
About 150 000 hashes (mostly the averaging keys of 4096 stages), built once in the DHT process,
~15 MB. The averaging keys of one stage differ only in their last bits, so their common part
is hashed once and each key's hash is that state's copy given the bits: a fifth of a second for
all of them, where hashing each key from scratch took half a second and more on a loaded machine
(every DHT process pays it at its first store).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer

from agora.dht.key_families import BAN_LIST, HOUR_S, KeyFamily, typed_keys
from agora.dht.keys import averaging_key_parts, bans_key
from agora.dht.record_fields import MAX_STAGES, RecordError
from agora.dht.records import CLOCK_SKEW_S

# Averaging methods that keep a rounds board (pipeline/config.py SYNC_METHODS, less "none").
ROUND_METHODS = ("sparta", "diloco")

__all__ = ["KeyTable", "PLAIN_TAGS", "ROUND_METHODS", "Refusal", "key_hash"]

# hivemind's subkey tags for a plain value and for a whole dictionary (DHTProtocol.RESERVED_SUBKEYS).
PLAIN_TAGS = (MSGPackSerializer.dumps(None), b"")


class Refusal(RecordError):
    """A refusal counted under its own reason (``unknown_key``, ``banned``, ``ban_list``, ``storage``)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def key_hash(key: str) -> bytes:
    """The hash hivemind names ``key`` by (``DHTID.generate(source=key).to_bytes()``, without its int detour)."""
    return DHTID.HASH_FUNC(MSGPackSerializer.dumps(key)).digest()


class KeyTable:
    """The keys of one run, by hash (see the module docstring); built lazily, in the process that validates."""

    def __init__(self, run_id: str, *, methods: tuple[str, ...], max_stages: int = MAX_STAGES):
        self.run_id, self.methods, self.max_stages = run_id, tuple(methods), max_stages
        self._families: Optional[dict[bytes, tuple[KeyFamily, Optional[int]]]] = None
        self._averaging: Optional[frozenset[bytes]] = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_families": None, "_averaging": None}

    def family(self, key: bytes) -> Optional[tuple[KeyFamily, Optional[int]]]:
        """(the record family of the key hashed to ``key``, its slot), None if it is no record key."""
        if self._families is None:
            keys = [*typed_keys(self.run_id, methods=self.methods, max_stages=self.max_stages),
                    (bans_key(self.run_id), BAN_LIST, None)]
            self._families = {key_hash(key): (family, slot) for key, family, slot in keys}
        return self._families.get(key)

    def is_averaging(self, key: bytes) -> bool:
        if self._averaging is None:
            self._averaging = frozenset(_hashes_sharing_a_head(averaging_key_parts(
                self.run_id, methods=self.methods, max_stages=self.max_stages)))
        return key in self._averaging

    def averaging_writer(self, record: DHTRecord, now: float) -> str:
        """The peer an entry of hivemind's matchmaking names (a flag under its peer id's bytes);
        ``Refusal`` for a key of no family of this run, ``RecordError`` for another value."""
        if not self.is_averaging(record.key):
            raise Refusal("unknown_key", "a key that is none of this run's record families or averaging keys")
        subkey = None if record.subkey in PLAIN_TAGS else MSGPackSerializer.loads(record.subkey)
        if not isinstance(subkey, bytes) or not isinstance(MSGPackSerializer.loads(record.value), bool):
            raise RecordError("averaging: expected a flag under a peer id")
        if record.expiration_time > now + HOUR_S + CLOCK_SKEW_S:
            raise RecordError(f"averaging: expires more than {HOUR_S:.0f} s from now")
        return PeerID(subkey).to_base58()


def _hashes_sharing_a_head(parts: Iterable[tuple[str, tuple[str, ...]]]) -> Iterator[bytes]:
    """``key_hash(head + tail)`` for every head and its tails of equal length (module docstring):
    msgpack writes a text as a header of its length, then its bytes, so the hash input of each
    key is a common prefix (header and head) followed by the tail's bytes."""
    for head, tails in parts:
        length = len(tails[0].encode())
        common = MSGPackSerializer.dumps(head + tails[0])[:-length]
        state = DHTID.HASH_FUNC(common)
        for tail in tails:
            hashed = state.copy()
            hashed.update(tail.encode())
            yield hashed.digest()
