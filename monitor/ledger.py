"""The monitor's ledger of verified work: trainers' receipts (auth/receipts.py), checked, kept, summed.

Design choices:

- **Verified before it is stored**: a receipt is appended only once ``verify_receipt`` accepted it
  against the run's root; one that fails is refused with the reason, counted
  (``agora_ledger_receipts_refused_total{reason}``) and never written.
- **Append-only sqlite** (stdlib, one file, one table ``receipts``, like the authorizer's
  ``admitted.sqlite``; ``ReceiptTable``): rows are inserted, never changed; triggers abort any
  UPDATE or DELETE, so not even a later bug here rewrites history. One receipt per (trainer,
  worker, interval start): a receipt sent twice (a retry) or replayed is refused as ``duplicate``,
  and it moves no total. A worker keeps the receipts delivered to it in a table of the same kind
  (node/worker/receipts.py), so its copy exports in the same form and verifies the same way.
- **Kept as received**: each row holds the receipt's JSON as signed (``body``), so the export
  (``export``) is the signed receipts themselves, and anyone holding the run's root certificate
  re-verifies every one and recomputes every total (``verify_export``; ``agora-node ledger
  verify``) without trusting the monitor.
- **Cross-checked against the worker's own count** (``overclaim``): where the worker's count of
  what it served that trainer is known (its ``agora_worker_served_tokens_total`` series, read
  from its metrics endpoint, counted since its process started), a receipt that brings the
  trainer's claims for that worker since then above the worker's own count is stored flagged
  (``flag`` names both figures) and counted; a flagged receipt stays in the ledger as evidence
  and its tokens are summed apart (``flagged_tokens``), not into the contributor's share.
- ``contributors`` is a pure function over the rows: per worker, its tokens, microbatches,
  receipts, trainers and stages, and the first and last time its work was seen.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter

from agora.auth.credentials import CredentialVerifier
from agora.auth.receipts import (RECEIPT_REFUSALS, Receipt, ReceiptError, SignedReceipt, receipt_from_json,
                                 receipt_to_json, verify_receipt)

__all__ = ["LEDGER_VERSION", "Contributor", "LedgerMetrics", "ReceiptLedger", "ReceiptTable", "ServedCount",
           "StoredReceipt", "contributors", "open_append_only", "overclaim", "verify_export"]

LEDGER_VERSION = "agora-ledger-v1"

_SCHEMA = """CREATE TABLE IF NOT EXISTS receipts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, trainer TEXT NOT NULL, worker TEXT NOT NULL, stage INTEGER NOT NULL,
    interval_start REAL NOT NULL, interval_end REAL NOT NULL, microbatches INTEGER NOT NULL, tokens INTEGER NOT NULL,
    received_at REAL NOT NULL, flag TEXT NOT NULL, body TEXT NOT NULL, UNIQUE (trainer, worker, interval_start))"""
_ROW = "trainer, worker, stage, interval_start, interval_end, microbatches, tokens, received_at, flag"


class LedgerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.accepted = Counter("agora_ledger_receipts", "Receipts verified and appended to the ledger",
                                registry=registry)
        self.refused = Counter("agora_ledger_receipts_refused", "Receipts refused and not stored, by reason",
                               ["reason"], registry=registry)
        self.flagged = Counter("agora_ledger_receipts_flagged", "Receipts stored flagged: their trainer claims more "
                               "than the worker counts it served", registry=registry)
        for reason in RECEIPT_REFUSALS:
            self.refused.labels(reason=reason)


@dataclass(frozen=True)
class StoredReceipt:
    trainer: str
    worker: str
    stage: int
    interval_start: float
    interval_end: float
    microbatches: int
    tokens: int
    received_at: float
    flag: str  # "" or why the cross-check flagged it


@dataclass(frozen=True)
class ServedCount:
    """What a worker says it served one trainer: ``tokens`` since ``since`` (its process start, epoch seconds)."""

    tokens: int
    since: float


@dataclass
class Contributor:
    worker: str
    tokens: int = 0
    microbatches: int = 0
    receipts: int = 0
    flagged_receipts: int = 0
    flagged_tokens: int = 0
    trainers: list[str] = field(default_factory=list)
    stages: list[int] = field(default_factory=list)
    first_seen: float = 0.0
    last_seen: float = 0.0


def overclaim(claimed_tokens: int, served: Optional[ServedCount]) -> str:
    """Why a trainer's claims (``claimed_tokens`` since ``served.since``, this receipt's included) are
    more than the worker's own count, or "" when they are not (or the worker's count is unknown)."""
    if served is None or claimed_tokens <= served.tokens:
        return ""
    return f"the trainer claims {claimed_tokens} tokens since the worker started, the worker counts {served.tokens}"


def contributors(rows: Iterable[StoredReceipt]) -> list[Contributor]:
    """Per worker, the sums of its receipts (flagged ones apart), most tokens first."""
    by_worker: dict[str, Contributor] = {}
    for row in rows:
        entry = by_worker.get(row.worker)
        if entry is None:
            entry = by_worker[row.worker] = Contributor(row.worker, first_seen=row.interval_start,
                                                        last_seen=row.interval_end)
        if row.flag:
            entry.flagged_receipts += 1
            entry.flagged_tokens += row.tokens
        else:
            entry.receipts += 1
            entry.tokens += row.tokens
            entry.microbatches += row.microbatches
        entry.trainers = sorted(set(entry.trainers) | {row.trainer})
        entry.stages = sorted(set(entry.stages) | {row.stage})
        entry.first_seen = min(entry.first_seen, row.interval_start)
        entry.last_seen = max(entry.last_seen, row.interval_end)
    return sorted(by_worker.values(), key=lambda c: (-c.tokens, c.worker))


def open_append_only(path: Path, schema: str, table: str, *, read_only: bool = False) -> sqlite3.Connection:
    """A connection to the sqlite file at ``path`` holding ``table`` (created by ``schema``), whose
    triggers abort every UPDATE and DELETE of its rows. ``read_only``: the file must exist, nothing is
    created or changed (a reader while another process appends). One file may hold several such tables,
    each opened on a connection of its own (a worker's receipts and round attestations)."""
    if read_only:
        return sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(schema)
    for event, name in (("UPDATE", "updated"), ("DELETE", "deleted")):
        db.execute(f"CREATE TRIGGER IF NOT EXISTS {table}_never_{name} BEFORE {event} ON {table} "
                   "BEGIN SELECT RAISE(ABORT, 'the ledger is append-only'); END")
    return db


class ReceiptTable:
    """The append-only ``receipts`` table of one sqlite file (module docstring): the monitor's ledger and
    a worker's own copy of its receipts (node/worker/receipts.py) are each one. It stores what it is
    given; whoever appends has verified it. Thread-safe (the monitor's HTTP threads append, its status
    page reads): one lock serializes the calls. ``read_only``: opened to be read while another process
    appends (``agora-node ledger export``), the file must exist and nothing is created."""

    def __init__(self, path: str | Path, *, clock, read_only: bool = False):
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._db = open_append_only(self.path, _SCHEMA, "receipts", read_only=read_only)

    def append(self, signed: SignedReceipt, served: Optional[ServedCount] = None) -> StoredReceipt:
        """Store ``signed`` (flagged when it brings its trainer's claims above ``served``, ``overclaim``);
        ReceiptError (duplicate) when the table holds a receipt of its trainer, worker and interval start."""
        receipt = signed.receipt
        with self._lock:
            flag = ""
            if served is not None:
                (claimed,) = self._db.execute(
                    "SELECT COALESCE(SUM(tokens), 0) FROM receipts WHERE trainer = ? AND worker = ? AND "
                    "interval_start >= ?", (receipt.trainer, receipt.worker, served.since)).fetchone()
                counted = receipt.tokens if receipt.interval_start >= served.since else 0
                flag = overclaim(claimed + counted, served)
            stored = StoredReceipt(receipt.trainer, receipt.worker, receipt.stage, receipt.interval_start,
                                   receipt.interval_end, receipt.microbatches, receipt.tokens, self._clock(), flag)
            body = json.dumps(receipt_to_json(signed), sort_keys=True)
            try:
                self._db.execute(f"INSERT INTO receipts ({_ROW}, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                 (*_values(stored), body))
            except sqlite3.IntegrityError:
                raise ReceiptError("duplicate", f"interval_start: trainer {receipt.trainer[:16]}... already has a "
                                                f"receipt for worker {receipt.worker[:16]}... from "
                                                f"{receipt.interval_start:.3f}") from None
        return stored

    def rows(self) -> list[StoredReceipt]:
        with self._lock:
            found = self._db.execute(f"SELECT {_ROW} FROM receipts ORDER BY id").fetchall()
        return [StoredReceipt(*row) for row in found]

    def claimed_tokens(self, trainer: str, since: float) -> int:
        """Tokens of ``trainer``'s receipts whose interval started at ``since`` or later."""
        with self._lock:
            (tokens,) = self._db.execute("SELECT COALESCE(SUM(tokens), 0) FROM receipts WHERE trainer = ? AND "
                                         "interval_start >= ?", (trainer, since)).fetchone()
        return tokens

    def totals(self, trainer: Optional[str] = None) -> tuple[int, int, int, int]:
        """(receipts, microbatches, tokens, trainers) of the unflagged receipts; ``trainer``'s alone when given."""
        where, values = ("AND trainer = ?", (trainer,)) if trainer is not None else ("", ())
        with self._lock:
            found = self._db.execute("SELECT COUNT(*), COALESCE(SUM(microbatches), 0), COALESCE(SUM(tokens), 0), "
                                     f"COUNT(DISTINCT trainer) FROM receipts WHERE flag = '' {where}", values).fetchone()
        return tuple(found)

    def export(self, verifier: CredentialVerifier) -> dict[str, Any]:
        """Every receipt as signed, with the flags and the totals derived from them (``verify_export``),
        read in one query: the totals are those of exactly the receipts listed."""
        with self._lock:
            found = self._db.execute(f"SELECT {_ROW}, body FROM receipts ORDER BY id").fetchall()
        entries = [{"signed": json.loads(row[-1]), "flag": row[-2]} for row in found]
        return {"version": LEDGER_VERSION, "run_id": verifier.run_id, "root_fingerprint": verifier.root_fingerprint,
                "receipts": entries, "contributors": [asdict(c) for c in contributors(
                    StoredReceipt(*row[:-1]) for row in found)]}

    def close(self) -> None:
        with self._lock:
            self._db.close()


class ReceiptLedger:
    """The monitor's ledger: a ``ReceiptTable`` that ``append`` fills with what ``verifier`` accepts."""

    def __init__(self, path: str | Path, verifier: CredentialVerifier, metrics: LedgerMetrics, *, clock):
        self.verifier = verifier
        self.metrics = metrics
        self.table = ReceiptTable(path, clock=clock)
        self.path = self.table.path

    def append(self, signed: SignedReceipt, served: Optional[ServedCount] = None) -> StoredReceipt:
        """Verify and store ``signed``; ReceiptError (counted) when it is refused. ``served``: the
        worker's own count for the cross-check (``overclaim``), None when unknown."""
        try:
            verify_receipt(signed, self.verifier)
            stored = self.table.append(signed, served)
        except ReceiptError as error:
            self.metrics.refused.labels(reason=error.reason).inc()
            raise
        self.metrics.accepted.inc()
        if stored.flag:
            self.metrics.flagged.inc()
        return stored

    def rows(self) -> list[StoredReceipt]:
        return self.table.rows()

    def contributors(self) -> list[Contributor]:
        return contributors(self.rows())

    def export(self) -> dict[str, Any]:
        return self.table.export(self.verifier)

    def close(self) -> None:
        self.table.close()


def _values(stored: StoredReceipt) -> tuple:
    return (stored.trainer, stored.worker, stored.stage, stored.interval_start, stored.interval_end,
            stored.microbatches, stored.tokens, stored.received_at, stored.flag)


def verify_export(document: Any, verifier: CredentialVerifier) -> list[Contributor]:
    """The contributors recomputed from an export's receipts, each verified against ``verifier``'s root
    and run; ReceiptError naming the entry when one fails, repeats another, or when the export's
    stated totals are not the receipts' (the flags are the monitor's judgement, kept as stated)."""
    if not isinstance(document, dict) or document.get("version") != LEDGER_VERSION:
        raise ReceiptError("malformed", f"version: expected an export of version {LEDGER_VERSION!r}")
    entries = document.get("receipts")
    if not isinstance(entries, list):
        raise ReceiptError("malformed", "receipts: expected a list")
    rows, seen = [], set()
    for index, entry in enumerate(entries):
        try:
            if not isinstance(entry, dict) or not isinstance(entry.get("flag", ""), str):
                raise ReceiptError("malformed", "expected {\"signed\": ..., \"flag\": \"...\"}")
            signed = receipt_from_json(entry.get("signed"))
            verify_receipt(signed, verifier)
        except ReceiptError as error:
            raise ReceiptError(error.reason, f"receipts[{index}]: {error}") from None
        receipt: Receipt = signed.receipt
        key = (receipt.trainer, receipt.worker, receipt.interval_start)
        if key in seen:
            raise ReceiptError("duplicate", f"receipts[{index}]: a second receipt of trainer {receipt.trainer[:16]}... "
                                            f"for worker {receipt.worker[:16]}... from {receipt.interval_start:.3f}")
        seen.add(key)
        rows.append(StoredReceipt(receipt.trainer, receipt.worker, receipt.stage, receipt.interval_start,
                                  receipt.interval_end, receipt.microbatches, receipt.tokens, 0.0, entry.get("flag", "")))
    recomputed = contributors(rows)
    if document.get("contributors") != [asdict(c) for c in recomputed]:
        raise ReceiptError("malformed", "contributors: the stated totals are not the sums of the receipts")
    return recomputed
