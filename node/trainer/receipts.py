"""A trainer's receipts for the work it accepted, per worker and interval, and their way to the ledger.

`ReceiptBook` tallies, per worker, the microbatches (and their tokens) of every global batch this
trainer finished: a microbatch counts for each worker of its completed route, forward and backward
(the tail's Forward runs both). Routes that failed are no share (the trainer takes them back from
the batch's shares before the batch finishes, node/trainer/microbatches.py), so what is tallied is what
passed the reply bounds, the blame of a downstream refusal and the verifier. Every
`every_batches` finished global batches the interval closes: each worker with work in it gets one
receipt (auth/receipts.py), signed with this trainer's credential key, except a worker flagged in
the meantime by the verifier, a spot check or a self check. A flag can come after replies that
already counted (a CUSUM builds up over many replies; checks run in the background), so the whole
interval of a flagged worker goes unsigned, and it is excluded from then on. The last interval is
closed when the run ends, however short. Each round goes to every recipient: the ledger's sender
below, when there is a ledger, and the workers themselves, each its own receipt
(node/trainer/receipt_delivery.py, which the trainer adds: it holds the clients to the workers).

`ReceiptSender` posts the receipts to the monitor's ledger (monitor/http.py, `/api/receipts`) in
the background, best effort: what a post could not deliver (the monitor down, a timeout) is
kept, up to `MAX_UNSENT`, and sent with the next interval's, `POST_CHUNK` to a request; a receipt the ledger already holds
is answered `duplicate` and counts as delivered. The HTTP client is the stdlib's, on a worker
thread: one small POST per interval does not need another dependency.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from cryptography.hazmat.primitives.asymmetric import rsa

from agora.auth.receipts import Receipt, SignedReceipt, receipt_to_json, sign_receipt
from agora.node.trainer.stats import TrainerStats

__all__ = ["MAX_UNSENT", "POST_CHUNK", "ReceiptBook", "ReceiptSender", "Recipient", "Signer", "WorkerTally"]

logger = logging.getLogger("agora.node.trainer")

MAX_UNSENT = 10_000
# Receipts per POST: each carries its trainer's chain (some 3 KB in all), well within the ledger's 1 MiB body.
POST_CHUNK = 100
# The trainer's node key and its current credential chain (re-read: the credential is renewed).
Signer = Callable[[], tuple[rsa.RSAPrivateKey, bytes]]
# Who a round of receipts goes to: the ledger's sender, the workers' delivery.
Recipient = Callable[[list[SignedReceipt]], None]


@dataclass
class WorkerTally:
    stage: int
    microbatches: int = 0
    tokens: int = 0


class ReceiptBook:
    """Tallies accepted work per worker and signs it every `every_batches` global batches (module docstring)."""

    def __init__(self, run_id: str, trainer: str, every_batches: int, signer: Signer, *,
                 flagged: Callable[[str], bool], deliver: Optional[Recipient] = None,
                 wall_clock: Callable[[], float] = time.time):
        self.run_id, self.trainer, self.every_batches = run_id, trainer, every_batches
        self._signer, self._flagged, self._wall_clock = signer, flagged, wall_clock
        self._recipients: list[Recipient] = [deliver] if deliver is not None else []
        self._tallies: dict[str, WorkerTally] = {}
        self._batches = 0
        self._started = wall_clock()
        self.signed = 0
        self.withheld: dict[str, int] = {}  # flagged workers' unsigned tokens, by peer

    def batch_served(self, shares: Iterable[Counter], tokens_per_microbatch: int) -> None:
        """One finished global batch: `shares` its microbatches per worker, one counter per stage."""
        for stage, stage_shares in enumerate(shares):
            for peer, microbatches in stage_shares.items():
                if microbatches > 0:
                    tally = self._tallies.setdefault(peer, WorkerTally(stage))
                    tally.microbatches += microbatches
                    tally.tokens += microbatches * tokens_per_microbatch
        self._batches += 1
        if self._batches >= self.every_batches:
            self.close_interval()

    def close_interval(self) -> list[SignedReceipt]:
        """Sign the interval's receipts (none: nothing was served) and hand them to each recipient."""
        tallies, self._tallies, self._batches = self._tallies, {}, 0
        start, end = self._started, max(self._wall_clock(), self._started)
        self._started = end
        receipts = []
        key, chain = self._signer() if tallies else (None, b"")
        for peer, tally in sorted(tallies.items()):
            if self._flagged(peer):
                self.withheld[peer] = self.withheld.get(peer, 0) + tally.tokens
                continue
            receipt = Receipt(self.run_id, self.trainer, peer, tally.stage, start, end, tally.microbatches, tally.tokens)
            receipts.append(sign_receipt(receipt, key, chain))
        self.signed += len(receipts)
        if receipts:
            for recipient in self._recipients:
                recipient(receipts)
        return receipts

    def also_deliver(self, recipient: Recipient) -> None:
        """Hand every later round of receipts to `recipient` too (the workers: node/trainer/receipt_delivery.py)."""
        self._recipients.append(recipient)


class ReceiptSender:
    """Posts receipts to the ledger at `url` (the monitor's base URL) in the background (module docstring)."""

    def __init__(self, url: str, stats: TrainerStats, *, timeout_s: float = 10.0):
        self.url = url.rstrip("/") + "/api/receipts"
        self.stats, self.timeout_s = stats, timeout_s
        self._unsent: list[SignedReceipt] = []
        self._tasks: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()

    def submit(self, receipts: list[SignedReceipt]) -> None:
        """Queue `receipts` and post everything unsent in the background (call from the event loop)."""
        self.stats.receipts("signed", len(receipts))
        self._unsent.extend(receipts)
        dropped = len(self._unsent) - MAX_UNSENT
        if dropped > 0:
            del self._unsent[:dropped]
            self.stats.receipts("dropped", dropped)
        task = asyncio.get_running_loop().create_task(self._post())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the posts in flight (each bounded by `timeout_s`)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _post(self) -> None:
        async with self._lock:  # one post at a time, so a receipt is never in two
            batch, self._unsent = self._unsent, []
            if not batch:
                return
            for start in range(0, len(batch), POST_CHUNK):  # a backlog goes in bodies the ledger takes
                chunk = batch[start:start + POST_CHUNK]
                try:
                    answer = await asyncio.to_thread(self._send, chunk)
                except (OSError, ValueError) as error:
                    self._unsent[:0] = batch[start:]
                    self.stats.receipts("failed", len(batch) - start)
                    logger.warning("receipts: posting %d to %s failed (kept for the next post): %s",
                                   len(batch) - start, self.url, error)
                    return
                self._answered(answer, len(chunk))

    def _answered(self, answer: dict, sent: int) -> None:
        refused = [entry for entry in answer.get("refused", []) if entry.get("reason") != "duplicate"]
        self.stats.receipts("delivered", sent - len(refused))
        if refused:
            self.stats.receipts("refused", len(refused))
            logger.warning("receipts: the ledger refused %d of %d: %s", len(refused), sent, refused[0].get("error"),
                           extra={"milestone": "receipts_refused", "fields": {"refused": len(refused), "url": self.url}})

    def _send(self, batch: list[SignedReceipt]) -> dict:
        body = json.dumps({"receipts": [receipt_to_json(signed) for signed in batch]}).encode()
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as error:
            raise ValueError(f"HTTP {error.code}: {error.read()[:200].decode(errors='replace')}") from None

