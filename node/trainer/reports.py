"""`WorkerReports`: a trainer tells the run's authorizer about the workers its verifier flagged.

The verifier (node/trainer/verification.py) excludes a flagged worker from this trainer's routes
for the rest of its run (node/trainer/blame.py); reported, the worker is banned by the authorizer
once the reports pass its bar (auth/reports.py), and then every node refuses it.

Design choices:

- One report per worker, started in the background when it is flagged (`flagged`): the training
  loop never waits on the authorizer, and the worker is excluded here whatever the authorizer says.
- Authenticated like a renewal (auth/admission.py `CredentialRenewer`): a renewal challenge, this
  trainer's credential chain, and its key's signature over the report, over TLS under the run's root.
- Retried with exponential backoff (auth/policy.py `retry_delay_s`) while the answer says "later"
  (the authorizer unreachable, busy, rate limiting, restarted under a challenge), up to `attempts`;
  a refusal (the peer is no admitted worker, this credential may not report) is final. A report
  that fails is logged and counted (`agora_trainer_worker_reports_total{outcome="failed"}`), never
  raised.
- A trainer without an authorizer (--insecure, or a credential minted with no authorizer to renew
  at) builds none: nothing is sent (node/trainer/command.py).
- At close, reports still under way get `close_grace_s` to land, then are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import replace
from typing import Any, Optional

import grpc

from agora.auth.authorizer_tls import authorizer_channel
from agora.auth.credentials import CredentialError
from agora.auth.node_state import NodeCredentials
from agora.auth.policy import retry_delay_s, sign_proof
from agora.auth.reports import MAX_REASON_CHARS
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.verification import Evidence
from agora.protos.authorizer_adapter import (AuthorizerStub, ChallengeRequest, ReportReceipt, WorkerReport,
                                             signed_payload)

__all__ = ["WorkerReports", "send_report", "RETRIED_CODES"]

logger = logging.getLogger("agora.node.trainer")

# Answers that say "later": the authorizer is down or restarting (its challenge no longer verifies), busy
# or rate limiting. Any other status is final.
RETRIED_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
                           grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED})


async def send_report(address: str, node: NodeCredentials, evidence: Evidence, *, timeout_s: float) -> ReportReceipt:
    """Report the worker `evidence` names to the authorizer at `address`, as the trainer holding `node`'s
    credential; raises grpc.aio.AioRpcError (the authorizer's answer) or CredentialError (no valid one)."""
    chain, identity = node.current()
    async with authorizer_channel(address, node.root_pem()) as channel:
        stub = AuthorizerStub(channel)
        challenge = await stub.get_challenge(ChallengeRequest(peer_id=node.peer_id, role=identity.role,
                                                              renewal=True), timeout=timeout_s)
        report = WorkerReport(nonce=challenge.nonce, credential_pem=chain, peer_id=evidence.peer,
                              stage=evidence.stage, kind=evidence.kind, feature=evidence.feature,
                              cusum=evidence.cusum, replies=evidence.replies,
                              reason=evidence.describe()[:MAX_REASON_CHARS])
        report = replace(report, signature=sign_proof(node.key, signed_payload(report)))
        return await stub.report(report, timeout=timeout_s)


class WorkerReports:
    """Reports this trainer's flagged workers to the authorizer at `address` (module docstring)."""

    def __init__(self, address: str, node: NodeCredentials, stats: TrainerStats, *, attempts: int = 6,
                 retry_initial_s: float = 1.0, retry_max_s: float = 30.0, rpc_timeout_s: float = 20.0,
                 close_grace_s: float = 5.0, rng: Optional[random.Random] = None):
        self.address, self.node, self.stats = address, node, stats
        self._attempts, self._retry_initial_s, self._retry_max_s = attempts, retry_initial_s, retry_max_s
        self._rpc_timeout_s, self._close_grace_s = rpc_timeout_s, close_grace_s
        self._rng = rng or random.Random()
        self._reported: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self.receipts: dict[str, ReportReceipt] = {}  # what the authorizer answered, per worker reported

    def flagged(self, evidence: Evidence) -> None:
        """The verifier flagged `evidence.peer`: report it (once per worker) in the background."""
        if evidence.peer in self._reported:
            return
        self._reported.add(evidence.peer)
        task = asyncio.get_running_loop().create_task(self._report(evidence), name=f"report-{evidence.peer[:16]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _report(self, evidence: Evidence) -> None:
        for attempt in range(self._attempts):
            try:
                receipt = await send_report(self.address, self.node, evidence, timeout_s=self._rpc_timeout_s)
            except grpc.aio.AioRpcError as error:
                why = f"{error.code().name}: {error.details()}"
                if error.code() not in RETRIED_CODES or attempt + 1 == self._attempts:
                    return self._failed(evidence, why)
                logger.info("reporting worker %s to the authorizer failed (%s); retrying", evidence.peer[:16], why)
                await asyncio.sleep(retry_delay_s(attempt, self._rng, initial_s=self._retry_initial_s,
                                                  maximum_s=self._retry_max_s))
            except CredentialError as error:
                return self._failed(evidence, f"no valid credential to report with: {error}")
            else:
                return self._sent(evidence, receipt)

    def _sent(self, evidence: Evidence, receipt: ReportReceipt) -> None:
        self.receipts[evidence.peer] = receipt
        self.stats.worker_report("sent")
        outcome = "banned" if receipt.banned else f"{receipt.reporters} of {receipt.needed} trainers needed to ban it"
        logger.warning("reported stage %d worker %s to the authorizer: %s", evidence.stage, evidence.peer[:16],
                       outcome, extra={"milestone": "worker_reported", "fields": {
                           "peer": evidence.peer, "stage": evidence.stage, "banned": receipt.banned,
                           "reporters": receipt.reporters, "needed": receipt.needed}})

    def _failed(self, evidence: Evidence, why: str) -> None:
        self.stats.worker_report("failed")
        logger.warning("could not report stage %d worker %s to the authorizer at %s: %s (it stays excluded here)",
                       evidence.stage, evidence.peer[:16], self.address, why,
                       extra={"milestone": "worker_report_failed", "fields": {
                           "peer": evidence.peer, "stage": evidence.stage, "error": why}})

    async def close(self) -> None:
        """Give the reports under way `close_grace_s` to land, then cancel them."""
        pending = set(self._tasks)
        if pending:
            await asyncio.wait(pending, timeout=self._close_grace_s)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> "WorkerReports":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()
