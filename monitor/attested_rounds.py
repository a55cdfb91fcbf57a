"""The ledger's rounds: averaging rounds a contributor joined, as the round's other members attest them.

A worker keeps the round attestations delivered to it (auth/round_attestations.py; verified by
node/worker/attestations.py) beside its receipts: a second table, ``attestations``, in the same
``receipts.sqlite``, of the same kind (monitor/ledger.py ``open_append_only``: triggers abort any
UPDATE or DELETE). ``agora-node ledger export`` writes both into one ledger export and ``agora-node
ledger verify`` checks both (node/ledger_command.py).

Design choices:

- **One per attester and round**: (attester, attested, stage, round) is unique; a second is
  ``duplicate`` and moves nothing. The round counter is per stage, so the stage is in the key: a
  worker that moved keeps its rounds of both stages.
- **A round counts once** (``attested_rounds``): a contributor's rounds are its distinct (stage,
  round) pairs that at least one other member attests; two members attesting the same round make
  it no more than one round, and the attestations and attesters are reported beside it.
- **Kept as received** (``body``): the export is the signed attestations themselves, so
  ``verify_attestations`` re-verifies each against the run's root alone, refuses a repeated one and
  recomputes every contributor's rounds, which must be those the export states.
- **In the ledger export, optional**: an export carries ``attestations`` and ``attested_rounds``
  beside its receipts when it has any (a worker's own export); the monitor's holds none (no trainer
  sees a round). A reader that knows only receipts ignores them, claiming nothing about them.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from agora.auth.credentials import CredentialVerifier
from agora.auth.round_attestations import (SignedAttestation, attestation_from_json, attestation_to_json,
                                           verify_attestation)
from agora.auth.signed_statements import StatementError
from agora.monitor.ledger import open_append_only

__all__ = ["AttestationTable", "AttestedRounds", "StoredAttestation", "attested_rounds", "verify_attestations"]

_TABLE = "attestations"
_SCHEMA = f"""CREATE TABLE IF NOT EXISTS {_TABLE} (
    id INTEGER PRIMARY KEY AUTOINCREMENT, attester TEXT NOT NULL, attested TEXT NOT NULL, stage INTEGER NOT NULL,
    round INTEGER NOT NULL, completed_at REAL NOT NULL, received_at REAL NOT NULL, body TEXT NOT NULL,
    UNIQUE (attester, attested, stage, round))"""
_ROW = "attester, attested, stage, round, completed_at, received_at"


@dataclass(frozen=True)
class StoredAttestation:
    attester: str
    attested: str
    stage: int
    round: int
    completed_at: float
    received_at: float


@dataclass
class AttestedRounds:
    """One contributor's rounds that other members attest."""

    worker: str
    rounds: int = 0  # distinct (stage, round) pairs
    attestations: int = 0
    attesters: list[str] = field(default_factory=list)
    stages: list[int] = field(default_factory=list)
    first_completed: float = 0.0
    last_completed: float = 0.0


def attested_rounds(rows: Iterable[StoredAttestation]) -> list[AttestedRounds]:
    """Per attested worker, its rounds counted once each, most rounds first."""
    by_worker: dict[str, AttestedRounds] = {}
    seen: dict[str, set[tuple[int, int]]] = {}
    for row in rows:
        entry = by_worker.get(row.attested)
        if entry is None:
            entry = by_worker[row.attested] = AttestedRounds(row.attested, first_completed=row.completed_at,
                                                             last_completed=row.completed_at)
            seen[row.attested] = set()
        seen[row.attested].add((row.stage, row.round))
        entry.rounds = len(seen[row.attested])
        entry.attestations += 1
        entry.attesters = sorted(set(entry.attesters) | {row.attester})
        entry.stages = sorted(set(entry.stages) | {row.stage})
        entry.first_completed = min(entry.first_completed, row.completed_at)
        entry.last_completed = max(entry.last_completed, row.completed_at)
    return sorted(by_worker.values(), key=lambda entry: (-entry.rounds, entry.worker))


class AttestationTable:
    """The append-only ``attestations`` table of one sqlite file (module docstring). It stores what it is
    given; whoever appends has verified it. Thread-safe. ``read_only``: opened to be read while another
    process appends; a file without the table (written before attestations existed) reads as empty."""

    def __init__(self, path: str | Path, *, clock, read_only: bool = False):
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._db = open_append_only(self.path, _SCHEMA, _TABLE, read_only=read_only)
        self._exists = read_only is False or self._db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (_TABLE,)).fetchone() is not None

    def append(self, signed: SignedAttestation) -> tuple[StoredAttestation, bool]:
        """Store ``signed``; (the row, whether its (stage, round) is new for the worker it attests).
        StatementError (duplicate) when the table holds one of the same attester, worker, stage and round."""
        attestation = signed.attestation
        stored = StoredAttestation(attestation.attester, attestation.attested, attestation.stage, attestation.round,
                                   attestation.completed_at, self._clock())
        body = json.dumps(attestation_to_json(signed), sort_keys=True)
        with self._lock:
            (known,) = self._db.execute(f"SELECT COUNT(*) FROM {_TABLE} WHERE attested = ? AND stage = ? AND round = ?",
                                        (stored.attested, stored.stage, stored.round)).fetchone()
            try:
                self._db.execute(f"INSERT INTO {_TABLE} ({_ROW}, body) VALUES (?, ?, ?, ?, ?, ?, ?)",
                                 (*asdict(stored).values(), body))
            except sqlite3.IntegrityError:
                raise StatementError("duplicate", f"round: attester {attestation.attester[:16]}... already attested "
                                                  f"round {attestation.round} of stage {attestation.stage} for "
                                                  f"{attestation.attested[:16]}...") from None
        return stored, known == 0

    def rows(self) -> list[StoredAttestation]:
        if not self._exists:
            return []
        with self._lock:
            found = self._db.execute(f"SELECT {_ROW} FROM {_TABLE} ORDER BY id").fetchall()
        return [StoredAttestation(*row) for row in found]

    def totals(self, worker: str) -> tuple[int, int, int]:
        """(rounds, attestations, attesters) of ``worker``: its distinct (stage, round) pairs attested."""
        if not self._exists:
            return 0, 0, 0
        with self._lock:
            (rounds,) = self._db.execute(f"SELECT COUNT(*) FROM (SELECT DISTINCT stage, round FROM {_TABLE} "
                                         "WHERE attested = ?)", (worker,)).fetchone()
            attestations, attesters = self._db.execute(f"SELECT COUNT(*), COUNT(DISTINCT attester) FROM {_TABLE} "
                                                       "WHERE attested = ?", (worker,)).fetchone()
        return rounds, attestations, attesters

    def export(self) -> dict[str, Any]:
        """The attestations as signed and the rounds derived from them, read in one query: the part of a
        ledger export ``verify_attestations`` checks."""
        if not self._exists:
            return {"attestations": [], "attested_rounds": []}
        with self._lock:
            found = self._db.execute(f"SELECT {_ROW}, body FROM {_TABLE} ORDER BY id").fetchall()
        return {"attestations": [{"signed": json.loads(row[-1])} for row in found],
                "attested_rounds": [asdict(entry) for entry in attested_rounds(
                    StoredAttestation(*row[:-1]) for row in found)]}

    def close(self) -> None:
        with self._lock:
            self._db.close()


def verify_attestations(document: Any, verifier: CredentialVerifier) -> list[AttestedRounds]:
    """The attested rounds recomputed from a ledger export's attestations (none: []), each verified
    against ``verifier``'s root and run; StatementError naming the entry when one fails or repeats
    another, or when the export's stated rounds are not the attestations'."""
    if not isinstance(document, dict):
        raise StatementError("malformed", "expected a ledger export (a JSON object)")
    entries = document.get("attestations", [])
    if not isinstance(entries, list):
        raise StatementError("malformed", "attestations: expected a list")
    rows, seen = [], set()
    for index, entry in enumerate(entries):
        try:
            if not isinstance(entry, dict):
                raise StatementError("malformed", "expected {\"signed\": ...}")
            signed = attestation_from_json(entry.get("signed"))
            verify_attestation(signed, verifier)
        except StatementError as error:
            raise StatementError(error.reason, f"attestations[{index}]: {error}") from None
        attestation = signed.attestation
        key = (attestation.attester, attestation.attested, attestation.stage, attestation.round)
        if key in seen:
            raise StatementError("duplicate", f"attestations[{index}]: a second attestation of round "
                                              f"{attestation.round} of stage {attestation.stage} by "
                                              f"{attestation.attester[:16]}... for {attestation.attested[:16]}...")
        seen.add(key)
        rows.append(StoredAttestation(*key, attestation.completed_at, 0.0))
    recomputed = attested_rounds(rows)
    if document.get("attested_rounds", []) != [asdict(entry) for entry in recomputed]:
        raise StatementError("malformed", "attested_rounds: the stated rounds are not those of the attestations")
    return recomputed
