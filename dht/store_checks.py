"""What the DHT checks only when a value is stored, and how it counts the entries it refuses.

hivemind's record validators (dht/security.py) see a record, not the request that carries it: the
same ``validate`` runs on every store a peer accepts and on every value a find returns, long after
the store. A rule that holds forever (a relation between a record's fields, a time not ahead of
now) belongs there; a rule about the moment of the store does not, since an honest entry read an
hour later was stored an hour ago. The one such rule: a unit block entry must be written now
(``UnitBlockRecord.untimely(storing=True)``), so that the times its claims carry are bound to the
time of the store (dht/leases.py says why that matters). The token authorizer sees the
``StoreRequest`` itself before hivemind stores anything, so ``StoreTimes`` runs there, on the
request's values as they travel (signed, a credential attached: the authorizer passes the function
that takes those off), one per subkey or a whole dictionary of them. A value it cannot read is left
to the validators, which refuse it anyway.

``RefusedEntries`` counts refusals by kind (the field path a refusal names, else the key family)
and logs the first of each kind as a warning, the rest at debug: one hostile writer must not flood
the log, and an operator must see that something was refused and why. It lives in hivemind's DHT
process, where the checks run; its counts are that process's.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Iterator, Optional

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer

from agora.dht.keys import units_key
from agora.dht.record_fields import MAX_UNIT_BLOCKS, RecordError
from agora.dht.records import UnitBlockRecord

__all__ = ["RefusedEntries", "StoreTimes", "refusal_kind"]

logger = logging.getLogger(__name__)

_MAX_KINDS = 256


def refusal_kind(message: str, family: str) -> str:
    """The kind a refusal is counted under: the field path it names ("units.claims"), else the family."""
    head = message.split(":", 1)[0]
    return head if 0 < len(head) <= 40 and " " not in head else family


class RefusedEntries:
    """Refused entries by kind; the first of each kind is a warning (see the module docstring)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, kind: str, message: str) -> None:
        first = kind not in self.counts
        if first and len(self.counts) >= _MAX_KINDS:
            kind, first = "other", "other" not in self.counts
        self.counts[kind] += 1
        logger.log(logging.WARNING if first else logging.DEBUG, "%s", message)

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)


class StoreTimes:
    """The store-time rule for one run's unit block keys (see the module docstring). ``unwrap``: a
    stored value as it travels -> the msgpack record inside."""

    def __init__(self, run_id: str, unwrap: Callable[[bytes], bytes]):
        self.run_id = run_id
        self._unwrap = unwrap
        self._keys: Optional[frozenset[bytes]] = None  # 4096 hashes: built on the first store

    def _unit_keys(self) -> frozenset[bytes]:
        if self._keys is None:
            self._keys = frozenset(DHTID.generate(source=units_key(self.run_id, block)).to_bytes()
                                   for block in range(MAX_UNIT_BLOCKS))
        return self._keys

    def problem(self, request: dht_pb2.StoreRequest, now: float) -> Optional[str]:
        """Why the store may not happen at ``now`` (the first entry at fault), or None."""
        keys = self._unit_keys()
        for key, tag, value in zip(request.keys, request.subkeys, request.values):
            if key not in keys:
                continue
            for entry in _entry_values(tag, value):
                record = _unit_record(self._unwrap(entry))
                problem = None if record is None else record.untimely(now, storing=True)
                if problem is not None:
                    return problem
        return None


def _entry_values(tag: bytes, value: bytes) -> Iterator[bytes]:
    """The stored values a request's item carries: one, or each of a whole dictionary's."""
    if tag != DHTProtocol.IS_DICTIONARY:
        yield value
        return
    try:
        dictionary = MSGPackSerializer.loads(value)
        items = [item.value for _, item in dictionary.items()]
    except Exception:  # not a dictionary hivemind can read: hivemind refuses it
        return
    yield from (item for item in items if isinstance(item, bytes))


def _unit_record(packed: bytes) -> Optional[UnitBlockRecord]:
    """The unit block record of a msgpack value; None for a tombstone or anything unreadable."""
    try:
        wire = MSGPackSerializer.loads(packed)
        return None if wire is None else UnitBlockRecord.from_wire(wire)
    except RecordError:
        return None
    except Exception:  # msgpack's own errors are many; the validators refuse such a value anyway
        return None
