"""A worker keeps the attestations of the averaging rounds it joined: verified, stored once, in its log and metrics.

When a round of its stage completes, each member signs, for every other member, that they completed
it together (auth/round_attestations.py) and hands it over (node/averaging/round_attestations.py)
through the member's Stage service (`DeliverAttestation`, protos/attestation_adapter.py).
`AttestationService` answers that call; `KeptAttestations` is the store.

Design choices:

- **Only the stage's own replicas deliver**: the per-call check (node/rpc/auth_check.py) admits a
  worker credential alone; the handler further holds the caller to this worker's stage
  (`wrong_stage`, PERMISSION_DENIED): only a stage's replicas average together. The attestation is
  still judged by its own signature, not by who carried it.
- **Verified before kept** (`verify_addressed_attestation`): naming this worker and its stage,
  of this run, signed by the attester it names, never this worker itself, with a worker credential
  of that stage of the run's root, within that credential's validity.
- **Bounded**: a delivery of more than `MAX_ATTESTATION_BYTES` is refused before it is parsed (an
  attestation is some 3 KiB); one caller has at most `MAX_IN_FLIGHT_PER_CALLER` deliveries in
  verification at once (`busy`, RESOURCE_EXHAUSTED); the round must lie within `ROUND_WINDOW` rounds
  below the latest this worker would join now (its averaging loop's `round_bound`, its own count
  plus a few rounds of lead), and a worker that runs no averaging (`rounds` unset) refuses every one
  (`far_round`); one per attester and round (`duplicate`). So another member can make this worker
  store at most one row per round it could have joined.
- **Append-only**: a second table, `attestations`, in the same `receipts.sqlite` as the receipts
  (monitor/attested_rounds.py `AttestationTable`: triggers abort UPDATE and DELETE), exported with
  them by `agora-node ledger export` and checked by `ledger verify`.
- **Refused with the reason**, counted by it (`agora_worker_round_attestations_refused_total{reason}`),
  the status as for receipts (node/worker/receipts.py `refusal_code`: INVALID_ARGUMENT for what is
  wrong with the attestation, self_attested and far_round included, PERMISSION_DENIED for who
  signed or carried it, wrong_stage included, ALREADY_EXISTS for a duplicate, FAILED_PRECONDITION
  with no root to verify against: --insecure, nothing is kept) and RESOURCE_EXHAUSTED for `busy`.
  The first refusal of each reason is a warning, the rest debug lines; the worker serves on.
- **The contributor's view**: a log line when a round is first attested, at most one every
  `LOG_EVERY_S` (the rounds newly attested since the last line, in one line: a round can come every
  step), and `agora_worker_attested_rounds_total` (each stage and round once) beside
  `agora_worker_round_attestations_total`.
- Verification and the sqlite write run on a thread (`asyncio.to_thread`), off the event loop that
  serves the pipeline; `KeptAttestations` serializes them with a lock of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import grpc

from agora.auth.credentials import CredentialVerifier
from agora.auth.round_attestations import SignedAttestation, attestation_from_json, verify_addressed_attestation
from agora.auth.signed_statements import StatementError
from agora.monitor.attested_rounds import AttestationTable, StoredAttestation
from agora.monitor.worker_metrics import WorkerMetrics
from agora.node.rpc.auth_check import Caller, current_caller
from agora.node.worker.receipts import refusal_code
from agora.protos.attestation_adapter import AttestationDelivery, AttestationKept
from agora.protos.stage_adapter import StageRefusal

__all__ = ["LOG_EVERY_S", "MAX_ATTESTATION_BYTES", "MAX_IN_FLIGHT_PER_CALLER", "ROUND_WINDOW", "AttestationService",
           "KeptAttestations", "caller_refusal"]

MAX_ATTESTATION_BYTES = 16 * 1024
MAX_IN_FLIGHT_PER_CALLER = 4
# Rounds below this worker's `round_bound` an attestation may name: a delivery takes seconds, a round
# can come every step, and a restarted worker resumes its count from its checkpoint.
ROUND_WINDOW = 64
LOG_EVERY_S = 10.0
# The statuses of the refusals receipts do not have (the rest: node/worker/receipts.py `refusal_code`).
_CODES = {"busy": grpc.StatusCode.RESOURCE_EXHAUSTED, "wrong_stage": grpc.StatusCode.PERMISSION_DENIED}


def caller_refusal(caller: Optional[Caller], stage: int) -> Optional[str]:
    """Why `caller` may not deliver attestations to a worker of `stage`, or None (pure)."""
    if caller is None or caller.identity is None:
        return "no credential for this call: attestations come from workers of the stage over mutual TLS"
    if caller.role != "worker" or caller.identity.stage != stage:
        return (f"a {caller.role} of stage {caller.identity.stage} may not deliver attestations to stage {stage}: "
                "only the stage's replicas average together")
    return None


class KeptAttestations:
    """The round attestations for `worker` (its peer id) at `stage` in the append-only table at `path`,
    each verified by `verifier` (the run's root and id) before it is stored; thread-safe."""

    def __init__(self, path: str | Path, worker: str, stage: int, verifier: CredentialVerifier, *,
                 clock: Callable[[], float] = time.time):
        self.worker, self.stage, self.verifier = worker, stage, verifier
        self.table = AttestationTable(path, clock=clock)
        self._lock = threading.Lock()

    def keep(self, signed: SignedAttestation, round_bound: Optional[int]) -> tuple[StoredAttestation, bool]:
        """Verify and store `signed`; (the row, whether its round is newly attested). StatementError naming
        the reason when it is refused; `round_bound`: the latest round this worker would join now (None:
        it runs no averaging)."""
        with self._lock:
            verify_addressed_attestation(signed, self.verifier, self.worker, self.stage)
            round_number = signed.attestation.round
            if round_bound is None:
                raise StatementError("far_round", "round: this worker runs no averaging rounds")
            if not round_bound - ROUND_WINDOW <= round_number <= round_bound:
                raise StatementError("far_round", f"round: {round_number} is not within the {ROUND_WINDOW} rounds "
                                                  f"up to {round_bound}, the latest this worker would join now")
            return self.table.append(signed)

    def totals(self) -> tuple[int, int, int]:
        """(rounds, attestations, attesters) of this worker's kept attestations."""
        return self.table.totals(self.worker)

    def export(self) -> dict[str, Any]:
        return self.table.export()

    def close(self) -> None:
        self.table.close()


class AttestationService:
    """The DeliverAttestation handler (protos/attestation_adapter.AttestationHandler): check the caller,
    verify, keep, count, log. `kept=None`: a worker with nothing to verify against (--insecure), which
    refuses every attestation. `rounds`: the latest round this worker would join now (its averaging
    loop's `round_bound`), set once the loop runs; until then every attestation is `far_round`."""

    def __init__(self, kept: Optional[KeptAttestations], *, stage: int, metrics: Optional[WorkerMetrics],
                 logger: logging.Logger, caller: Callable[[], Optional[Caller]] = current_caller,
                 clock: Callable[[], float] = time.monotonic):
        self.kept, self.stage, self._metrics, self._logger = kept, stage, metrics, logger
        self.rounds: Optional[Callable[[], int]] = None
        self._caller, self._clock = caller, clock
        self._in_flight: dict[str, int] = {}  # deliveries in verification, by caller (event loop only)
        self._warned: set[str] = set()
        self._unlogged: list[tuple[int, str]] = []  # rounds newly attested since the last line, and by whom
        self._logged_at = -math.inf

    async def deliver_attestation(self, request: AttestationDelivery, context: Any) -> AttestationKept:
        owner = None
        try:
            owner = self._admit()
            signed = self._parsed(request.attestation)
            bound = self.rounds() if self.rounds is not None else None
            stored, new_round, totals = await asyncio.to_thread(self._keep, signed, bound)
        except StatementError as error:
            raise self._refused(error) from None
        finally:
            if owner is not None:
                self._release(owner)
        if self._metrics is not None:
            self._metrics.attestation_kept(new_round)
        if new_round:
            self._unlogged.append((stored.round, stored.attester))
        self._log_kept(totals)
        return AttestationKept(*totals)

    def _admit(self) -> str:
        """The caller's owner, counted in flight; StatementError when it may not deliver one now."""
        if self.kept is None:
            raise StatementError("no_root", "this worker runs without credentials (--insecure): it holds no root "
                                            "certificate to verify attestations against, so it keeps none")
        caller = self._caller()
        problem = caller_refusal(caller, self.stage)
        if problem is not None:
            raise StatementError("wrong_stage", problem)
        if self._in_flight.get(caller.owner, 0) >= MAX_IN_FLIGHT_PER_CALLER:
            raise StatementError("busy", f"this worker verifies at most {MAX_IN_FLIGHT_PER_CALLER} attestations of "
                                         "one member at once; retry when one is answered")
        self._in_flight[caller.owner] = self._in_flight.get(caller.owner, 0) + 1
        return caller.owner

    def _release(self, owner: str) -> None:
        left = self._in_flight.pop(owner) - 1
        if left:
            self._in_flight[owner] = left

    def _parsed(self, text: str) -> SignedAttestation:
        size = len(text.encode())
        if size > MAX_ATTESTATION_BYTES:
            raise StatementError("oversized", f"attestation: {size} bytes, more than the {MAX_ATTESTATION_BYTES} an "
                                              "attestation may carry")
        try:
            value = json.loads(text)
        except ValueError as error:
            raise StatementError("malformed", f"attestation: not JSON ({error})") from None
        return attestation_from_json(value)

    def _keep(self, signed: SignedAttestation, bound: Optional[int]):
        stored, new_round = self.kept.keep(signed, bound)
        return stored, new_round, self.kept.totals()

    def _refused(self, error: StatementError) -> StageRefusal:
        if self._metrics is not None:
            self._metrics.attestation_refused(error.reason)
        level = logging.DEBUG if error.reason in self._warned else logging.WARNING
        self._warned.add(error.reason)
        self._logger.log(level, "attestations: refused a round attestation (%s): %s%s", error.reason, error,
                         "" if level == logging.DEBUG else " (further refusals for this reason are debug lines)",
                         extra={"milestone": "attestation_refused", "fields": {"reason": error.reason}})
        return StageRefusal(_CODES.get(error.reason) or refusal_code(error.reason),
                            f"attestation refused ({error.reason}): {error}")

    def _log_kept(self, totals: tuple[int, int, int], *, now: Optional[float] = None) -> None:
        """One line for the rounds newly attested since the last, at most every `LOG_EVERY_S`."""
        now = self._clock() if now is None else now
        if not self._unlogged or now - self._logged_at < LOG_EVERY_S:
            return
        rounds = sorted({round_number for round_number, _ in self._unlogged})
        attesters = sorted({attester for _, attester in self._unlogged})
        self._unlogged, self._logged_at = [], now
        span = f"round {rounds[0]}" if len(rounds) == 1 else f"{len(rounds)} rounds ({rounds[0]}..{rounds[-1]})"
        every, attestations, members = totals
        self._logger.info(
            "attestations: %s of stage %d attested by %s; all kept: %s attested (%s from %s)", span, self.stage,
            ", ".join(f"{peer[:12]}.." for peer in attesters), _counted(every, "round"),
            _counted(attestations, "attestation"), _counted(members, "member"),
            extra={"milestone": "rounds_attested", "fields": {
                "stage": self.stage, "rounds": rounds, "attesters": attesters, "total_rounds": every,
                "total_attestations": attestations, "total_attesters": members}})

    def close(self) -> None:
        """Say the rounds attested since the last line, and close the store."""
        if self.kept is not None:
            self._log_kept(self.kept.totals(), now=math.inf)
            self.kept.close()


def _counted(count: int, noun: str) -> str:
    """(1, "round") -> "1 round"; (3, "round") -> "3 rounds"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
