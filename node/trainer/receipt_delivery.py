"""`ReceiptDelivery`: a trainer hands each worker the receipt it signed for that worker's work.

The ledger (node/trainer/receipts.py `ReceiptSender`, the monitor) is where the run's totals are
read; this is how a contributor comes to hold the proof of its own work: each receipt of a round
goes to the worker it names, over that worker's Stage service (`DeliverReceipt`), which verifies it
against the run's root and keeps it (node/worker/receipts.py).

Design choices:

- Best effort, in the background: one call per receipt, each under a short deadline (`timeout_s`);
  the training loop never waits on one, and a receipt that could not be delivered is not sent
  again (the ledger has it; a worker down at the end of an interval misses that interval's proof).
- Through the trainer's own client for the worker (node/trainer/calls.py `StageClients`): the same
  mutual TLS, whose target name is the worker's peer id, so the receipt reaches the worker it names
  and no other. A worker no longer in the roster (it left) is skipped.
- Counted by outcome (`agora_trainer_receipt_deliveries_total{outcome}`): kept, duplicate (the
  worker had it: a retry), refused (the worker's reason: another run, a worker without a root under
  --insecure, one that does not know the call), failed (unreachable, deadline), no_route. The first
  refusal and the first failure are warnings in the log, the rest debug lines: a worker that cannot
  take receipts would otherwise write one line per round.
- `close` waits for the calls in flight (at most `timeout_s`), before the trainer closes its clients;
  a round signed after that (the trainer already closed) goes to the ledger alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable, Optional

import grpc

from agora.auth.receipts import SignedReceipt, receipt_to_json
from agora.node.trainer.routing import Roster, WorkerView
from agora.node.trainer.stage_client import RequestRefused, StageCallError, StageClient
from agora.node.trainer.stats import TrainerStats

__all__ = ["DELIVERY_OUTCOMES", "ReceiptDelivery"]

logger = logging.getLogger("agora.node.trainer")

DELIVERY_OUTCOMES = ("kept", "duplicate", "refused", "failed", "no_route")


class ReceiptDelivery:
    """Delivers receipts to the workers of `roster` through `client` (module docstring)."""

    def __init__(self, roster: Roster, client: Callable[[WorkerView], StageClient], stats: TrainerStats, *,
                 timeout_s: float = 5.0):
        self.roster, self._client, self.stats, self.timeout_s = roster, client, stats, timeout_s
        self._tasks: set[asyncio.Task] = set()
        self._warned: set[str] = set()
        self._closed = False

    def submit(self, receipts: list[SignedReceipt]) -> None:
        """Deliver each of `receipts` to the worker it names, in the background (call from the event loop)."""
        loop = asyncio.get_running_loop()
        for signed in receipts:
            if self._closed:  # its clients are closed: a round signed after the trainer ended goes to the ledger alone
                self._outcome("failed", signed, "the trainer has closed its connections to the workers")
                continue
            view = self.roster.workers.get(signed.receipt.worker)
            if view is None:
                self._outcome("no_route", signed, "the worker is no longer in this trainer's roster")
                continue
            task = loop.create_task(self._deliver(view, signed), name=f"receipt-{signed.receipt.worker[:16]}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _deliver(self, view: WorkerView, signed: SignedReceipt) -> None:
        text = json.dumps(receipt_to_json(signed), sort_keys=True)
        try:
            await self._client(view).deliver_receipt(text, timeout_s=self.timeout_s)
        except RequestRefused as error:
            duplicate = error.code == grpc.StatusCode.ALREADY_EXISTS
            self._outcome("duplicate" if duplicate else "refused", signed, f"{error.code.name}: {error.details}")
        except StageCallError as error:
            self._outcome("failed", signed, f"{error.code.name}: {error.details}")
        else:
            self._outcome("kept", signed)

    def _outcome(self, outcome: str, signed: SignedReceipt, why: Optional[str] = None) -> None:
        self.stats.receipt_delivery(outcome)
        if why is None or outcome == "duplicate":
            return
        level = logging.DEBUG if outcome in self._warned else logging.WARNING
        self._warned.add(outcome)
        logger.log(level, "receipts: delivering worker %s its receipt: %s: %s%s", signed.receipt.worker[:16], outcome,
                   why, "" if level == logging.DEBUG else " (further ones are debug lines)")

    async def close(self) -> None:
        """Wait for the deliveries in flight (each bounded by `timeout_s`); deliver nothing after."""
        self._closed = True
        await asyncio.gather(*self._tasks, return_exceptions=True)
