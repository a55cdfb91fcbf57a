"""The admitted nodes an authorizer keeps beside its CA, so a restarted authorizer keeps its slots
and ``agora-node authorizer list`` shows them.

Design choices:

- ``admitted.sqlite`` in the state directory (the standard library's sqlite3), one row per peer:
  an admission or a renewal is one small upsert, whatever the number of nodes; nothing rewrites
  the whole list on a join.
- WAL journal, ``synchronous=NORMAL``: a commit appends to the write-ahead log without an fsync
  of its own. A power cut may lose the last few rows; a node it forgets still holds its
  credential, and its next renewal writes its row again (renewals upsert the whole row).
  ``list`` reads from another process while ``serve`` writes (WAL readers never block the writer).
- Rows of expired credentials are deleted when the log opens and every ``_PRUNE_EVERY`` writes.
- An ``admitted.json`` left by an older state directory is imported once (under a file lock, so
  ``serve`` and ``list`` cannot both import it), then renamed ``admitted.json.imported``.
- Calls block (disk): the service runs them on a worker thread (``asyncio.to_thread``); one lock
  serializes them on the one connection.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Optional

from filelock import FileLock

__all__ = ["ADMITTED_DB", "LEGACY_ADMITTED_FILE", "AdmittedNode", "AdmissionLog", "read_admitted"]

ADMITTED_DB = "admitted.sqlite"
LEGACY_ADMITTED_FILE = "admitted.json"
_PRUNE_EVERY = 256


@dataclass(frozen=True)
class AdmittedNode:
    peer_id: str
    role: str
    stage: Optional[int]
    address: str  # the announced host:port (workers), else the caller's address
    device: str
    admitted_at: float
    expires_at: float
    rtt_ms: Optional[float] = None
    upload_mbit: Optional[float] = None
    download_mbit: Optional[float] = None


_COLUMNS = [f.name for f in fields(AdmittedNode)]
_SCHEMA = """CREATE TABLE IF NOT EXISTS admitted (
    peer_id TEXT PRIMARY KEY, role TEXT NOT NULL, stage INTEGER, address TEXT NOT NULL, device TEXT NOT NULL,
    admitted_at REAL NOT NULL, expires_at REAL NOT NULL, rtt_ms REAL, upload_mbit REAL, download_mbit REAL)"""
_UPSERT = f"INSERT OR REPLACE INTO admitted ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"


class AdmissionLog:
    """``state_dir/admitted.sqlite``: ``record`` an admission or renewal, read the ``live`` ones."""

    def __init__(self, state_dir: str | Path, *, now: float):
        directory = Path(state_dir)
        self.path = directory / ADMITTED_DB
        self._lock = threading.Lock()
        self._writes = 0
        with FileLock(str(directory / ".admitted.lock")):
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(_SCHEMA)
            self._import_legacy(directory / LEGACY_ADMITTED_FILE)
        self.prune(now)

    def _import_legacy(self, legacy: Path) -> None:
        if not legacy.exists():
            return
        nodes = [AdmittedNode(**entry) for entry in json.loads(legacy.read_text() or "[]")]
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(_UPSERT, [astuple(node) for node in nodes])
        legacy.rename(legacy.with_name(legacy.name + ".imported"))

    def record(self, node: AdmittedNode) -> None:
        """Store (or replace) ``node``'s row: one small transaction."""
        with self._lock:
            self._db.execute(_UPSERT, astuple(node))
            self._writes += 1
            if self._writes % _PRUNE_EVERY == 0:
                self._db.execute("DELETE FROM admitted WHERE expires_at <= ?", (node.admitted_at,))

    def forget(self, peer_id: str) -> None:
        """Delete ``peer_id``'s row (a clean leave): a restarted authorizer does not hold its slot again."""
        with self._lock:
            self._db.execute("DELETE FROM admitted WHERE peer_id = ?", (peer_id,))

    def prune(self, now: float) -> None:
        with self._lock:
            self._db.execute("DELETE FROM admitted WHERE expires_at <= ?", (now,))

    def live(self, now: float) -> list[AdmittedNode]:
        """The nodes whose credential is still valid at ``now``, in order of admission."""
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM admitted WHERE expires_at > ? "
                                    "ORDER BY admitted_at", (now,)).fetchall()
        return [AdmittedNode(*row) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def read_admitted(state_dir: str | Path, now: float) -> list[AdmittedNode]:
    """The nodes admitted by the authorizer of ``state_dir`` whose credential is valid at ``now``."""
    log = AdmissionLog(state_dir, now=now)
    try:
        return log.live(now)
    finally:
        log.close()
