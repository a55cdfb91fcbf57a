"""What a SwarmDHT reader makes of the values a get found: records it believes, the rest counted.

Design choices:

- Reading is a pure function of what a get returned, this peer's clock, the owner rule and the
  ban list; no request is made here, so the checks read apart from the requests (dht/swarm.py)
  and one ``EntryReader`` per peer holds the counts of what its reads skipped.
- Readers check what the validators check (``dht/ownership.py``), and count what they skip:
  the subkey's peer id is the record's, the owner key is that peer id's key, and with
  admission on an entry without an owner (unsigned) is skipped. A reader that passes its
  run fingerprint also skips workers of another run configuration, naming the field.
- Values from other peers are untrusted: anything that is not a valid record (wrong
  shape, bad field, subkey that does not match the record) is skipped, counted per key
  in ``rejections()`` and logged (warning once per entry and reason, then debug).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Optional, TypeVar

from hivemind.utils.timed_storage import ValueWithExpiration

from agora.dht.bans import NodeBans
from agora.dht.ownership import EntryOwnership, fingerprint_mismatch
from agora.dht.record_fields import RecordError
from agora.dht.records import Record, WorkerRecord

if TYPE_CHECKING:
    from agora.pipeline.fingerprint import RunFingerprint

__all__ = ["EntryReader", "Stored", "is_subkey_dict"]

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
R = TypeVar("R", bound=Record)

# Bounds on per-instance bookkeeping, so a long-lived peer's memory stays flat.
_MAX_WARNED_REJECTIONS = 1024


@dataclass(frozen=True)
class Stored(Generic[R]):
    """A record as read from the DHT, with the DHT time at which it expires."""

    record: R
    expiration_time: float


class EntryReader:
    """What a reader makes of the values a get found: records, kept only where it believes them,
    and a count per key (and a log line) of every value it skips (see the module docstring)."""

    def __init__(self, *, clock: Clock, ownership: EntryOwnership, bans: NodeBans) -> None:
        self._clock = clock
        self._ownership = ownership
        self._bans = bans
        self._lock = threading.Lock()
        self._rejections: Counter[str] = Counter()
        self._warned: set[tuple[str, str, str]] = set()

    def rejections(self) -> dict[str, int]:
        """How many invalid values each key has yielded so far."""
        with self._lock:
            return dict(self._rejections)

    def record(self, key: str, found: Any, record_type: type[R]) -> Optional[Stored[R]]:
        """The record of a plain key (no subkeys), or None if absent, expired or invalid."""
        if found is None or found.expiration_time < self._clock() or found.value is None:
            return None
        if is_subkey_dict(found.value):
            self._reject(key, None, "expected one record, found subkeys")
            return None
        try:
            return Stored(record_type.from_wire(found.value), found.expiration_time)
        except RecordError as error:
            self._reject(key, None, str(error))
            return None

    def entries(self, key: str, found: Any, record_type: type[R]) -> dict[str, Stored[R]]:
        """Valid, unexpired, not deleted records under a key's subkeys, sorted by subkey."""
        if found is None:
            return {}
        if not is_subkey_dict(found.value):
            if found.value is not None and found.expiration_time >= self._clock():
                self._reject(key, None, "expected subkeys, found a plain value")
            return {}
        now = self._clock()
        entries: dict[str, Stored[R]] = {}
        for subkey, item in found.value.items():
            if item.expiration_time < now or item.value is None:
                continue  # expired by our clock, or a tombstone
            if not isinstance(subkey, str):
                self._reject(key, repr(subkey), "subkey is not a string")
                continue
            try:
                entries[subkey] = Stored(record_type.from_wire(item.value), item.expiration_time)
            except RecordError as error:
                self._reject(key, subkey, str(error))
        return dict(sorted(entries.items()))

    def owned(self, key: str, entries: dict[str, Stored[R]]) -> dict[str, Stored[R]]:
        """Entries by peer id, each checked against its subkey (see ``SwarmDHT.owned_entries``); a
        banned peer's are skipped."""
        owned: dict[str, Stored[R]] = {}
        for subkey, stored in entries.items():
            peer_id = getattr(stored.record, "peer_id", "")  # records without one are refused
            reason = self._ownership.problem(subkey, peer_id)
            if reason is None and self._bans.is_banned(peer_id):
                reason = "banned by the run's operator"
            if reason is not None:
                self._reject(key, subkey, reason)
                continue
            owned[peer_id] = stored
        return dict(sorted(owned.items()))

    def workers(
        self,
        key: str,
        entries: dict[str, Stored[WorkerRecord]],
        run_id: str,
        stage: int,
        fingerprint: Optional[RunFingerprint],
    ) -> list[WorkerRecord]:
        """The workers of ``run_id``'s ``stage`` among ``entries``, skipping another run's (or, with
        ``fingerprint``, another configuration's)."""
        workers = []
        for peer_id, stored in entries.items():
            record = stored.record
            if record.run_id != run_id or record.stage != stage:
                self._reject(key, peer_id, f"record is for {record.run_id}.stage{record.stage}")
            elif fingerprint is not None and (mismatch := fingerprint_mismatch(fingerprint, record.fingerprint)):
                self._reject(key, peer_id, mismatch)
            else:
                workers.append(record)
        return workers

    def _reject(self, key: str, subkey: Optional[str], reason: str) -> None:
        entry = (key, str(subkey), reason)
        with self._lock:
            self._rejections[key] += 1
            first_time = entry not in self._warned
            if first_time:
                if len(self._warned) >= _MAX_WARNED_REJECTIONS:
                    self._warned.clear()
                self._warned.add(entry)
        where = key if subkey is None else f"{key}[{str(subkey)[:60]}]"
        # A bad entry lingers until it expires and is re-read on every poll: warn once.
        level = logging.WARNING if first_time else logging.DEBUG
        logger.log(level, "skipping invalid DHT value at %s: %s", where, reason)


def is_subkey_dict(value: Any) -> bool:
    """Whether a value hivemind found is a dictionary of subkeys (each with its expiration), not one value."""
    return isinstance(value, dict) and all(isinstance(item, ValueWithExpiration) for item in value.values())
