"""A worker keeps the receipts the trainers sign for its work: verified, stored once, shown in its log and metrics.

When a trainer signs a round of receipts (node/trainer/receipts.py) it hands each worker its own over
the worker's Stage service (`DeliverReceipt`, protos/receipt_adapter.py; the trainer's side is
node/trainer/receipt_delivery.py). `ReceiptService` answers that call; `KeptReceipts` is the store.

Design choices:

- **Verified before kept** (auth/receipts.py `verify_addressed`): addressed to this worker's peer id,
  of this run, signed by the trainer it names with a `trainer` or `operator` credential of the run's
  root, within that credential's validity. The per-call check (node/rpc/auth_check.py) already
  admits only trainers and operators to the call, but a receipt is judged by its own signature, not
  by who carried it.
- **Bounded**: a delivery of more than `MAX_RECEIPT_BYTES` is refused before it is parsed (a receipt
  is some 3 KiB: its fields, a chain of two certificates, a signature).
- **Append-only**: `receipts.sqlite` in the worker's state dir (`RECEIPTS_FILE`) is the monitor's
  kind of table (monitor/ledger.py `ReceiptTable`: triggers abort UPDATE and DELETE; one receipt per
  trainer, worker and interval start, a second one is `duplicate`). It outlives the process, a
  restart and a move to another stage (same key, same state dir).
- **Refused with the reason**, counted by it (`agora_worker_receipts_refused_total{reason}`):
  INVALID_ARGUMENT for what is wrong with the receipt (malformed, oversized, another run, another
  worker, a signature that does not match), PERMISSION_DENIED for who signed it (a chain not of
  this run's root, a role that signs no receipts, a signer other than the trainer it names, signed
  outside its credential's validity), ALREADY_EXISTS for a duplicate (a retry: kept the first time),
  FAILED_PRECONDITION with no root to verify against (--insecure: nothing is kept). The first
  refusal of each reason is a warning in the log, the rest debug lines. A refusal costs the worker
  nothing else: it keeps serving.
- **The contributor's view**: one log line per receipt kept (a trainer's round brings this worker
  one), saying what it vouches for, how much of what this process served that trainer its
  receipts now cover (receipts lag: the trainer's open interval is not signed yet), and the totals
  of every receipt kept; the metrics `agora_worker_receipted_{tokens,microbatches}_total{trainer}`
  count what was kept since this process started (monitor/worker_metrics.py).
- **Exportable** (`export`): the document the monitor's `/api/ledger` serves, so `agora-node
  ledger verify` checks a worker's own copy against the run's root alone (`agora-node ledger
  export`, node/ledger_command.py).
- Verification and the sqlite write run on a thread (`asyncio.to_thread`), off the event loop that
  serves the pipeline; `KeptReceipts` serializes them with a lock of its own, and holds a verifier
  of its own (the per-call check's is used on the loop).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import grpc

from agora.auth.credentials import CredentialVerifier
from agora.auth.receipts import ReceiptError, SignedReceipt, receipt_from_json, verify_addressed
from agora.monitor.ledger import ReceiptTable, StoredReceipt
from agora.monitor.worker_metrics import WorkerMetrics
from agora.protos.receipt_adapter import ReceiptDelivery, ReceiptKept
from agora.protos.stage_adapter import StageRefusal

__all__ = ["MAX_RECEIPT_BYTES", "RECEIPTS_FILE", "KeptReceipts", "KeptTotals", "ReceiptService", "refusal_code"]

RECEIPTS_FILE = "receipts.sqlite"
MAX_RECEIPT_BYTES = 16 * 1024

_PERMISSION = ("untrusted", "expired", "wrong_role", "not_signer")  # who signed it may not vouch for this


def refusal_code(reason: str) -> grpc.StatusCode:
    """The status a receipt refused for `reason` (auth/receipts.py KEPT_REFUSALS) is answered with."""
    if reason == "duplicate":
        return grpc.StatusCode.ALREADY_EXISTS
    if reason == "no_root":
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.PERMISSION_DENIED if reason in _PERMISSION else grpc.StatusCode.INVALID_ARGUMENT


@dataclass(frozen=True)
class KeptTotals:
    receipts: int
    microbatches: int
    tokens: int
    trainers: int


class KeptReceipts:
    """The receipts for `worker` (its peer id) in the append-only table at `path`, each verified by
    `verifier` (the run's root and id) before it is stored; thread-safe."""

    def __init__(self, path: str | Path, worker: str, verifier: CredentialVerifier, *,
                 clock: Callable[[], float] = time.time):
        self.worker, self.verifier = worker, verifier
        self.table = ReceiptTable(path, clock=clock)
        self._lock = threading.Lock()

    def keep(self, signed: SignedReceipt) -> StoredReceipt:
        """Verify and store `signed`; ReceiptError naming the reason when it is refused."""
        with self._lock:
            verify_addressed(signed, self.verifier, self.worker)
            return self.table.append(signed)

    def totals(self, trainer: Optional[str] = None) -> KeptTotals:
        """Of every receipt kept, or of `trainer`'s."""
        return KeptTotals(*self.table.totals(trainer))

    def tokens_since(self, trainer: str, since: float) -> int:
        """Tokens of `trainer`'s receipts for intervals that started at `since` or later."""
        return self.table.claimed_tokens(trainer, since)

    def export(self) -> dict[str, Any]:
        """The kept receipts as the monitor exports its ledger (monitor/ledger.py `verify_export` checks it)."""
        return self.table.export(self.verifier)

    def close(self) -> None:
        self.table.close()


class ReceiptService:
    """The DeliverReceipt handler (protos/receipt_adapter.ReceiptHandler): verify, keep, count, log one line.
    `kept=None`: a worker with nothing to verify against (--insecure), which refuses every receipt."""

    def __init__(self, kept: Optional[KeptReceipts], *, metrics: Optional[WorkerMetrics], logger: logging.Logger):
        self.kept, self._metrics, self._logger = kept, metrics, logger
        self._warned: set[str] = set()

    async def deliver_receipt(self, request: ReceiptDelivery, context: Any) -> ReceiptKept:
        try:
            signed = self._parsed(request.receipt)
            stored, mine, every = await asyncio.to_thread(self._keep, signed)
        except ReceiptError as error:
            raise self._refused(error) from None
        if self._metrics is not None:
            self._metrics.receipted(stored.trainer, stored.microbatches, stored.tokens)
        self._log_kept(stored, every)
        return ReceiptKept(receipts=mine.receipts, microbatches=mine.microbatches, tokens=mine.tokens)

    def _parsed(self, text: str) -> SignedReceipt:
        if self.kept is None:
            raise ReceiptError("no_root", "this worker runs without credentials (--insecure): it holds no root "
                                          "certificate to verify receipts against, so it keeps none")
        size = len(text.encode())
        if size > MAX_RECEIPT_BYTES:
            raise ReceiptError("oversized", f"receipt: {size} bytes, more than the {MAX_RECEIPT_BYTES} a receipt "
                                            "may carry")
        try:
            value = json.loads(text)
        except ValueError as error:
            raise ReceiptError("malformed", f"receipt: not JSON ({error})") from None
        return receipt_from_json(value)

    def _keep(self, signed: SignedReceipt) -> tuple[StoredReceipt, KeptTotals, KeptTotals]:
        stored = self.kept.keep(signed)
        return stored, self.kept.totals(stored.trainer), self.kept.totals()

    def _refused(self, error: ReceiptError) -> StageRefusal:
        if self._metrics is not None:
            self._metrics.receipt_refused(error.reason)
        level = logging.DEBUG if error.reason in self._warned else logging.WARNING
        self._warned.add(error.reason)
        self._logger.log(level, "receipts: refused a receipt (%s): %s%s", error.reason, error,
                         "" if level == logging.DEBUG else " (further refusals for this reason are debug lines)",
                         extra={"milestone": "receipt_refused", "fields": {"reason": error.reason}})
        return StageRefusal(refusal_code(error.reason), f"receipt refused ({error.reason}): {error}")

    def _log_kept(self, stored: StoredReceipt, every: KeptTotals) -> None:
        served = self._served_share(stored.trainer)
        trainers = f"{every.trainers} trainer{'s' if every.trainers != 1 else ''}"
        self._logger.info(
            "receipts: trainer %s.. verified %s microbatches / %s tokens at stage %d in [%s, %s]%s; all receipts: "
            "%s microbatches, %s tokens from %s", stored.trainer[:12], _count(stored.microbatches),
            _count(stored.tokens), stored.stage, _clock_time(stored.interval_start), _clock_time(stored.interval_end),
            served, _count(every.microbatches), _count(every.tokens), trainers,
            extra={"milestone": "receipt_kept", "fields": {
                "trainer": stored.trainer, "stage": stored.stage, "microbatches": stored.microbatches,
                "tokens": stored.tokens, "interval_start": stored.interval_start,
                "interval_end": stored.interval_end, "total_microbatches": every.microbatches,
                "total_tokens": every.tokens, "trainers": every.trainers}})

    def _served_share(self, trainer: str) -> str:
        """'; its receipts cover 96% of the 64,000 tokens this process served it', or "" when not counted."""
        if self._metrics is None:
            return ""
        served = self._metrics.served_tokens_of(trainer)
        if not served:
            return ""
        covered = self.kept.tokens_since(trainer, self._metrics.served_since_s)
        return f"; its receipts cover {100 * covered / served:.0f}% of the {_count(served)} tokens this process served it"


def _count(value: int) -> str:
    """61440 -> '61,440'; 1234567 -> '1.2M'; 3.4e9 -> '3.4B'."""
    if value >= 10 ** 9:
        return f"{value / 1e9:.1f}B"
    if value >= 10 ** 6:
        return f"{value / 1e6:.1f}M"
    return f"{value:,}"


def _clock_time(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(seconds))
