"""Receipts: a trainer's signed statement of the work one worker served it and that it accepted.

What a receipt says (``Receipt``): in run ``run_id``, between ``interval_start`` and
``interval_end`` (seconds since the epoch, the trainer's wall clock), worker ``worker`` of stage
``stage`` served trainer ``trainer`` ``microbatches`` microbatches of ``tokens`` tokens forward
and backward, every one of them accepted: its route completed, its global batch finished, and
the worker was not flagged by the trainer's verifier, spot checks or self checks in the interval
(node/trainer/receipts.py decides what counts; this module only signs and checks).

Design choices:

- **Who signs**: the trainer, with its node key, the key its credential certifies (auth/keys.py:
  one key per node). A receipt carries the trainer's credential chain (leaf + issuing CA), so
  anyone holding the run's root certificate verifies it offline, long after the credential has
  run out: the chain is judged at the time it was valid (``CredentialVerifier.verify_issued``),
  and the receipt must have been signed within the credential's validity (``interval_end``
  between its not-before and not-after). Only ``trainer`` and ``operator`` credentials sign
  receipts: a worker cannot vouch for itself.
- **What is signed**: a domain tag of its own (``agora-receipt-v1``) and the receipt's fields as
  canonical JSON (sorted keys, no spaces), so a signature over any other agora payload (a proof
  of possession, a round attestation, a ban list) is never a receipt's, and changing any field,
  one token or one second, breaks the signature. Signing, the chain and signature checks and the
  JSON form are those of every signed statement (auth/signed_statements.py); this module says
  what a receipt's fields are, their bounds and who may sign one.
- **Bounded before anything else** (``receipt_problem``): base58 peer ids, a stage, finite
  ordered times, counts that are non-negative integers and tokens at least the microbatches: a
  receipt failing one names the field and is never stored.
- **The wire and file form** is JSON (``receipt_to_json`` / ``receipt_from_json``): the receipt's
  fields, the chain as PEM text and the signature in base64; the monitor's ledger exports it as
  it was received, so a reader re-verifies exactly what was signed. The worker a receipt names
  gets it too (its Stage service's DeliverReceipt) and keeps it only when ``verify_addressed``
  accepts it: addressed to its own peer id, then everything ``verify_receipt`` checks.
- **The fields are fixed** (``agora-receipt-v1``): readers require exactly these, so another field
  (a trainer's total at a stage, say) is a new domain tag that today's readers would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from cryptography.hazmat.primitives.asymmetric import rsa

from agora.auth.credentials import CredentialVerifier, Identity
from agora.auth.signed_statements import (STATEMENT_REFUSALS, StatementError, count_problem, peer_id_problem,
                                          run_id_problem, sign_statement, statement_from_json, statement_payload,
                                          statement_to_json, time_problem, verify_statement)

__all__ = ["Receipt", "SignedReceipt", "ReceiptError", "RECEIPT_ROLES", "RECEIPT_REFUSALS", "KEPT_REFUSALS",
           "receipt_problem", "receipt_payload", "sign_receipt", "verify_receipt", "verify_addressed",
           "receipt_to_json", "receipt_from_json"]

RECEIPT_ROLES = ("trainer", "operator")  # the credentials that may sign receipts
_DOMAIN = b"agora-receipt-v1\0"
# Why a receipt is refused: the label of the monitor's refusal counter.
RECEIPT_REFUSALS = STATEMENT_REFUSALS
# Why a worker refuses a receipt delivered to it (node/worker/receipts.py): those, and one addressed to
# another worker, one over the size a receipt has, or none can be verified (no root: --insecure).
KEPT_REFUSALS = RECEIPT_REFUSALS + ("wrong_worker", "oversized", "no_root")
# A receipt refused; ``reason`` is one of ``RECEIPT_REFUSALS``. The error of every signed statement: a
# ledger export holds receipts and round attestations, and its reader refuses either the same way.
ReceiptError = StatementError


@dataclass(frozen=True)
class Receipt:
    """The accepted work of one worker for one trainer over one interval (module docstring)."""

    run_id: str
    trainer: str  # the signing trainer's peer id
    worker: str  # the worker's peer id
    stage: int
    interval_start: float  # seconds since the epoch
    interval_end: float  # when it was signed
    microbatches: int
    tokens: int


@dataclass(frozen=True)
class SignedReceipt:
    receipt: Receipt
    chain_pem: bytes  # the trainer's credential: leaf + issuing CA
    signature: bytes


def receipt_problem(receipt: Receipt) -> Optional[str]:
    """None when every field is within bounds, else one line naming the field."""
    problems = (run_id_problem(receipt.run_id), peer_id_problem("trainer", receipt.trainer),
                peer_id_problem("worker", receipt.worker), count_problem("stage", receipt.stage),
                count_problem("microbatches", receipt.microbatches), count_problem("tokens", receipt.tokens),
                time_problem("interval_start", receipt.interval_start), time_problem("interval_end", receipt.interval_end))
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        return problem
    if receipt.interval_end < receipt.interval_start:
        return f"interval_end: {receipt.interval_end} is before interval_start {receipt.interval_start}"
    if receipt.tokens < receipt.microbatches:
        return f"tokens: {receipt.tokens} is fewer than the {receipt.microbatches} microbatches (one token each at least)"
    return None


def receipt_payload(receipt: Receipt) -> bytes:
    """The bytes a trainer signs: the domain tag and the canonical JSON of every field."""
    return statement_payload(_DOMAIN, receipt)


def sign_receipt(receipt: Receipt, key: rsa.RSAPrivateKey, chain_pem: bytes) -> SignedReceipt:
    """``receipt`` signed with the trainer's node ``key``, carrying its credential ``chain_pem``."""
    problem = receipt_problem(receipt)
    if problem is not None:
        raise ValueError(f"receipt: {problem}")
    return SignedReceipt(receipt, chain_pem, sign_statement(_DOMAIN, receipt, key))


def verify_receipt(signed: SignedReceipt, verifier: CredentialVerifier) -> Identity:
    """The signing trainer's identity when ``signed`` is a valid receipt of ``verifier``'s run,
    signed by the trainer it names while its credential was valid; else ReceiptError."""
    problem = receipt_problem(signed.receipt)
    if problem is not None:
        raise ReceiptError("malformed", f"receipt: {problem}")
    return verify_statement(signed.receipt, signed.chain_pem, signed.signature, verifier, domain=_DOMAIN,
                            kind="receipt", roles=RECEIPT_ROLES, signer_field="trainer",
                            signed_at_field="interval_end")


def verify_addressed(signed: SignedReceipt, verifier: CredentialVerifier, worker: str) -> Identity:
    """``verify_receipt``, for the worker it is addressed to: one naming another worker (``wrong_worker``)
    is refused first, so a worker keeps no receipt of anyone else's work."""
    if signed.receipt.worker != worker:
        raise ReceiptError("wrong_worker", f"worker: the receipt is for worker {str(signed.receipt.worker)[:16]}..., "
                                           f"this is {worker[:16]}...")
    return verify_receipt(signed, verifier)


def receipt_to_json(signed: SignedReceipt) -> dict[str, Any]:
    return statement_to_json("receipt", signed.receipt, signed.chain_pem, signed.signature)


def receipt_from_json(value: Any) -> SignedReceipt:
    """A signed receipt from its JSON form; ReceiptError (malformed) naming the field otherwise."""
    return SignedReceipt(*statement_from_json(value, "receipt", Receipt))
