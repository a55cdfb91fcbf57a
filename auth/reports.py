"""Trainers' reports of the workers their verifiers flagged, and the bar at which the authorizer bans.

A trainer's verifier (node/trainer/verification.py) excludes a flagged worker from that trainer's
routes for the rest of its run; the trainer then reports it here (node/trainer/reports.py), and
once the reports pass the bar the authorizer bans the worker through ``RunAuthority.ban``: the ban
list it publishes, signed, in the DHT (node/ban_publisher.py), refuses the worker at every node
from their next heartbeat, and its next renewal is refused, so it leaves within one lifetime.

Design choices:

- **The bar** (``ReportBar``, pure): reports from ``ban_after_reports`` distinct trainers about one
  worker within ``window_s`` seconds. The default is one trainer: trainers are operator-issued
  (auth/settings.py ``OPEN_ROLES``: nobody joins as one by itself), and each report already passed
  that trainer's own bar, a CUSUM over many replies held to the stage's other workers, which an
  honest worker's traffic stays well below. A run with several trainers may ask for two or more,
  so that one trainer alone cannot ban. 0 keeps the reports and never bans on them (the operator
  reads them and bans by hand). Distinct trainers count, not reports: a trainer reporting the same
  worker again moves nothing.
- **What a compromised trainer can do.** A trainer is a trusted operator process: with the default
  bar, whoever holds a trainer credential can get any admitted worker banned by reporting it, as
  it could already ruin the run by choosing the data and the targets of every gradient. What it
  cannot do: ban a peer that is not an admitted worker (a trainer, a monitor, the operator's own
  nodes), report under another trainer's name (a report is signed with the reporter's key and
  checked against its credential), or stay anonymous: each report is kept with the reporting
  trainer's peer id and the ban's reason names the trainers, so the operator can audit
  (``admitted.sqlite``, table ``reports``), ``unban`` the worker and ban the trainer. Raising the
  bar to two trainers takes the power from any single one.
- **Append-only**: reports are rows of the ``reports`` table in ``admitted.sqlite`` beside the
  admissions (auth/admitted.py says why sqlite), inserted and never updated or deleted; the bar
  reads them back, so a restarted authorizer counts the reports it had.
- **Bounded**: a report's fields are checked before anything is stored (``report_problem``):
  a base58 peer id, a stage of the run, short kind, feature and reason, a finite CUSUM.
- ``ReportDesk`` takes a report the service authenticated (``ReportService``, the Report handler
  of auth/service.py's ``AuthorizerService``: the report's bounds, then a trainer's credential and
  proof as a renewal's, auth/renewal.py, then its rate): a worker neither admitted nor banned is
  NOT_FOUND (nothing to ban), else the report is stored, the bar read and the worker banned if it
  is passed. A report about a worker already banned is kept and answered "banned". Its disk work
  runs on worker threads. The handler sits here, beside the desk, so that a report's whole path
  reads in one module.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import sqlite3
import threading
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Optional

import grpc

from agora.auth.admitted import ADMITTED_DB
from agora.auth.authority import RunAuthority
from agora.auth.challenges import ChallengeError
from agora.auth.status import Status, answers, caller_address
from agora.protos.authorizer_adapter import ReportReceipt, WorkerReport

__all__ = ["ReportBar", "ReportVerdict", "StoredReport", "ReportLog", "ReportDesk", "report_problem",
           "MAX_REASON_CHARS", "MAX_LABEL_CHARS", "ReportService"]

logger = logging.getLogger("agora.auth.service")

MAX_REASON_CHARS = 400
MAX_LABEL_CHARS = 40  # kind, feature
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{10,128}")


@dataclass(frozen=True)
class ReportVerdict:
    """The distinct trainers that reported a worker within the window, and whether that bans it."""

    reporters: frozenset[str]
    ban: bool


@dataclass(frozen=True)
class ReportBar:
    """Ban a worker once ``ban_after_reports`` distinct trainers reported it within ``window_s`` (module
    docstring says why one by default); ``ban_after_reports`` 0: never ban on reports."""

    ban_after_reports: int = 1
    window_s: float = 3600.0

    def verdict(self, reports: Iterable[tuple[str, float]], now: float) -> ReportVerdict:
        """``reports``: (reporting trainer, when) of one worker."""
        reporters = frozenset(reporter for reporter, at in reports if now - self.window_s <= at <= now)
        return ReportVerdict(reporters, 0 < self.ban_after_reports <= len(reporters))


def report_problem(report: WorkerReport, stages: int) -> Optional[str]:
    """None when a report's fields are within bounds (of a run of ``stages``), else one line naming the field."""
    if not _PEER_ID.fullmatch(report.peer_id):
        return f"peer_id: expected a base58 peer id, got {report.peer_id[:40]!r}"
    if report.stage >= stages:
        return f"stage: {report.stage} is out of range for this {stages}-stage run"
    for name, value in (("kind", report.kind), ("feature", report.feature)):
        if not 0 < len(value) <= MAX_LABEL_CHARS:
            return f"{name}: expected 1 to {MAX_LABEL_CHARS} characters, got {len(value)}"
    if len(report.reason) > MAX_REASON_CHARS:
        return f"reason: at most {MAX_REASON_CHARS} characters, got {len(report.reason)}"
    if not (math.isfinite(report.cusum) and report.cusum >= 0):
        return f"cusum: expected a finite value >= 0, got {report.cusum}"
    return None


@dataclass(frozen=True)
class StoredReport:
    """One report as kept: who reported whom, when, from where, with what evidence."""

    reported_at: float
    reporter: str  # the reporting trainer's peer id
    caller: str  # its address
    peer_id: str  # the worker reported
    stage: int
    kind: str
    feature: str
    cusum: float
    replies: int
    reason: str


_COLUMNS = [f.name for f in fields(StoredReport)]
_SCHEMA = """CREATE TABLE IF NOT EXISTS reports (
    id INTEGER PRIMARY KEY AUTOINCREMENT, reported_at REAL NOT NULL, reporter TEXT NOT NULL, caller TEXT NOT NULL,
    peer_id TEXT NOT NULL, stage INTEGER NOT NULL, kind TEXT NOT NULL, feature TEXT NOT NULL, cusum REAL NOT NULL,
    replies INTEGER NOT NULL, reason TEXT NOT NULL)"""
_INDEX = "CREATE INDEX IF NOT EXISTS reports_by_peer ON reports (peer_id, reported_at)"
_INSERT = f"INSERT INTO reports ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"


class ReportLog:
    """The ``reports`` table of ``state_dir/admitted.sqlite``: ``append`` a report, read a worker's back.
    Calls block (disk): the service runs them on a worker thread; one lock serializes them."""

    def __init__(self, state_dir: str | Path):
        self.path = Path(state_dir) / ADMITTED_DB
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)
        self._db.execute(_INDEX)

    def append(self, report: StoredReport) -> None:
        with self._lock:
            self._db.execute(_INSERT, astuple(report))

    def about(self, peer_id: str, since: float) -> list[StoredReport]:
        """The reports about ``peer_id`` made at ``since`` or later, oldest first."""
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM reports WHERE peer_id = ? AND "
                                    "reported_at >= ? ORDER BY id", (peer_id, since)).fetchall()
        return [StoredReport(*row) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


class ReportDesk:
    """Keeps authenticated reports in ``authority``'s ``admitted.sqlite`` and bans at ``bar`` (module docstring)."""

    def __init__(self, authority: RunAuthority, bar: ReportBar):
        self.authority, self.bar = authority, bar
        self._log = ReportLog(authority.directory)

    async def take(self, report: WorkerReport, reporter: str, caller: str, now: float, *,
                   admitted_worker: bool) -> tuple[ReportReceipt, bool]:
        """The receipt for `reporter`'s `report`, and whether it banned the worker; NOT_FOUND when the
        worker is neither `admitted_worker` nor banned."""
        ban = self.authority.is_banned(report.peer_id)
        if ban is None and not admitted_worker:
            raise Status(grpc.StatusCode.NOT_FOUND, f"peer_id: {report.peer_id[:16]}... is not an admitted worker of "
                                                    "this run: nothing to ban")
        await asyncio.to_thread(self._log.append, StoredReport(
            reported_at=now, reporter=reporter, caller=caller, peer_id=report.peer_id, stage=report.stage,
            kind=report.kind, feature=report.feature, cusum=report.cusum, replies=report.replies, reason=report.reason))
        recent = await asyncio.to_thread(self._log.about, report.peer_id, now - self.bar.window_s)
        verdict = self.bar.verdict(((stored.reporter, stored.reported_at) for stored in recent), now)
        fields = {"peer_id": report.peer_id, "reporter": reporter, "stage": report.stage, "kind": report.kind,
                  "feature": report.feature, "cusum": report.cusum, "reporters": len(verdict.reporters),
                  "needed": self.bar.ban_after_reports}
        logger.warning("authorizer: trainer %s reported worker %s: %s (%d of %d trainers needed)", reporter[:16],
                       report.peer_id[:16], report.reason or report.feature, len(verdict.reporters),
                       self.bar.ban_after_reports, extra={"milestone": "worker_reported", "fields": fields})
        banned_now = ban is None and verdict.ban
        if banned_now:
            reason = (f"flagged by {len(verdict.reporters)} trainer(s) ({', '.join(sorted(verdict.reporters))}): "
                      f"stage {report.stage} {report.kind} {report.feature}, CUSUM {report.cusum:.1f} after "
                      f"{report.replies} replies")
            await asyncio.to_thread(self.authority.ban, report.peer_id, reason)
            logger.warning("authorizer: banned worker %s: %s", report.peer_id[:16], reason,
                           extra={"milestone": "worker_banned", "fields": {**fields, "reason": reason}})
        receipt = ReportReceipt(reporters=len(verdict.reporters), needed=self.bar.ban_after_reports,
                                banned=ban is not None or banned_now)
        return receipt, banned_now

    def close(self) -> None:
        self._log.close()


class ReportService:
    """Report, over the state AuthorizerService builds (the desk, the admitted nodes, the buckets)."""

    @answers
    async def report(self, request: WorkerReport, context: Any) -> ReportReceipt:
        caller = caller_address(context.peer())
        try:
            receipt, banned_now = await self._report(request, caller)
        except (Status, ChallengeError) as error:
            outcome = error.code.name.lower() if isinstance(error, Status) else f"challenge_{error.kind}"
            self._on_report(outcome)
            logger.info("authorizer: refused a report about %s from %s: %s", request.peer_id[:16], caller, error,
                        extra={"milestone": "report_refused", "fields": {
                            "peer_id": request.peer_id[:128], "caller": caller, "outcome": outcome}})
            raise
        self._on_report("banned" if banned_now else "accepted")
        return receipt

    async def _report(self, request: WorkerReport, caller: str) -> tuple[ReportReceipt, bool]:
        """The receipt, and whether this report banned the worker. Cheap checks first: bounds, then the
        reporter (a renewal's), its rate, and the worker (in memory); then the write and the bar."""
        now = self._clock()
        problem = report_problem(request, self.fingerprint.stages)
        if problem is not None:
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, problem)
        reporter, _ = self._authenticated(request, now, roles=("trainer",), denied=(
            "role: only a trainer reports workers; this is a {role} credential"))
        wait = self._reporting_peers.acquire(reporter.peer_id, now)
        if wait > 0:
            raise Status(grpc.StatusCode.RESOURCE_EXHAUSTED, f"rate limit: {reporter.peer_id[:16]}... reported too "
                                                             f"often; retry after {wait:.1f} s", retry_after_s=wait)
        subject = self._admitted.get(request.peer_id)
        admitted_worker = subject is not None and subject.role == "worker" and subject.expires_at > now
        receipt, banned_now = await self._report_desk.take(request, reporter.peer_id, caller, now,
                                                           admitted_worker=admitted_worker)
        if banned_now:
            self._forget(request.peer_id)
        return receipt, banned_now
