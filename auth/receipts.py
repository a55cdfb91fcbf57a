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
  of possession, a run description, a ban list) is never a receipt's, and changing any field,
  one token or one second, breaks the signature. RSA-PSS/SHA-256 (auth/policy.py's proofs).
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

import base64
import binascii
import json
import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa

from agora.auth.credentials import CredentialError, CredentialVerifier, Identity, load_chain
from agora.auth.policy import proof_is_valid, sign_proof

__all__ = ["Receipt", "SignedReceipt", "ReceiptError", "RECEIPT_ROLES", "RECEIPT_REFUSALS", "KEPT_REFUSALS",
           "receipt_problem", "receipt_payload", "sign_receipt", "verify_receipt", "verify_addressed",
           "receipt_to_json", "receipt_from_json"]

RECEIPT_ROLES = ("trainer", "operator")  # the credentials that may sign receipts
_DOMAIN = b"agora-receipt-v1\0"
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{10,128}")
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Why a receipt is refused: the label of the monitor's refusal counter.
RECEIPT_REFUSALS = ("malformed", "untrusted", "expired", "wrong_run", "wrong_role", "not_signer", "bad_signature",
                    "duplicate")
# Why a worker refuses a receipt delivered to it (node/worker/receipts.py): those, and one addressed to
# another worker, one over the size a receipt has, or none can be verified (no root: --insecure).
KEPT_REFUSALS = RECEIPT_REFUSALS + ("wrong_worker", "oversized", "no_root")


class ReceiptError(ValueError):
    """A receipt refused; ``reason`` is one of ``RECEIPT_REFUSALS``, the message one readable line."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


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
    if not isinstance(receipt.run_id, str) or not _RUN_ID.fullmatch(receipt.run_id):
        return f"run_id: expected 1 to 64 letters, digits, '-' or '_', got {str(receipt.run_id)[:40]!r}"
    for name in ("trainer", "worker"):
        value = getattr(receipt, name)
        if not isinstance(value, str) or not _PEER_ID.fullmatch(value):
            return f"{name}: expected a base58 peer id, got {str(value)[:40]!r}"
    for name in ("stage", "microbatches", "tokens"):
        value = getattr(receipt, name)
        if type(value) is not int or not 0 <= value < 2 ** 53:
            return f"{name}: expected an integer from 0 to 2^53, got {value!r}"
    for name in ("interval_start", "interval_end"):
        value = getattr(receipt, name)
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
            return f"{name}: expected a finite time in seconds since the epoch, got {value!r}"
    if receipt.interval_end < receipt.interval_start:
        return f"interval_end: {receipt.interval_end} is before interval_start {receipt.interval_start}"
    if receipt.tokens < receipt.microbatches:
        return f"tokens: {receipt.tokens} is fewer than the {receipt.microbatches} microbatches (one token each at least)"
    return None


def receipt_payload(receipt: Receipt) -> bytes:
    """The bytes a trainer signs: the domain tag and the canonical JSON of every field."""
    return _DOMAIN + json.dumps(asdict(receipt), sort_keys=True, separators=(",", ":")).encode()


def sign_receipt(receipt: Receipt, key: rsa.RSAPrivateKey, chain_pem: bytes) -> SignedReceipt:
    """``receipt`` signed with the trainer's node ``key``, carrying its credential ``chain_pem``."""
    problem = receipt_problem(receipt)
    if problem is not None:
        raise ValueError(f"receipt: {problem}")
    return SignedReceipt(receipt, chain_pem, sign_proof(key, receipt_payload(receipt)))


def verify_receipt(signed: SignedReceipt, verifier: CredentialVerifier) -> Identity:
    """The signing trainer's identity when ``signed`` is a valid receipt of ``verifier``'s run,
    signed by the trainer it names while its credential was valid; else ReceiptError."""
    receipt = signed.receipt
    problem = receipt_problem(receipt)
    if problem is not None:
        raise ReceiptError("malformed", f"receipt: {problem}")
    if receipt.run_id != verifier.run_id:
        raise ReceiptError("wrong_run", f"run_id: the receipt is for run {receipt.run_id!r}, this is run "
                                        f"{verifier.run_id!r}")
    try:
        identity = verifier.verify_issued(signed.chain_pem, roles=RECEIPT_ROLES)
    except CredentialError as error:
        reason = error.reason if error.reason in RECEIPT_REFUSALS else "untrusted"
        raise ReceiptError(reason, f"chain: {error}") from None
    if identity.peer_id != receipt.trainer:
        raise ReceiptError("not_signer", f"trainer: the receipt names {receipt.trainer[:16]}..., its credential is "
                                         f"{identity.describe()}")
    if not identity.not_before <= receipt.interval_end <= identity.not_after:
        raise ReceiptError("expired", f"interval_end: signed at {receipt.interval_end:.0f}, outside its credential's "
                                      f"validity [{identity.not_before:.0f}, {identity.not_after:.0f}]")
    leaf = load_chain(signed.chain_pem)[0]
    if not proof_is_valid(_leaf_key(leaf), receipt_payload(receipt), signed.signature):
        raise ReceiptError("bad_signature", f"signature: not {identity.describe()}'s signature over this receipt")
    return identity


def verify_addressed(signed: SignedReceipt, verifier: CredentialVerifier, worker: str) -> Identity:
    """``verify_receipt``, for the worker it is addressed to: one naming another worker (``wrong_worker``)
    is refused first, so a worker keeps no receipt of anyone else's work."""
    if signed.receipt.worker != worker:
        raise ReceiptError("wrong_worker", f"worker: the receipt is for worker {str(signed.receipt.worker)[:16]}..., "
                                           f"this is {worker[:16]}...")
    return verify_receipt(signed, verifier)


def _leaf_key(leaf: x509.Certificate) -> rsa.RSAPublicKey:
    key = leaf.public_key()  # verify_issued already parsed it (the peer id is derived from it)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ReceiptError("malformed", f"chain: expected an RSA key, got {type(key).__name__}")
    return key


def receipt_to_json(signed: SignedReceipt) -> dict[str, Any]:
    return {"receipt": asdict(signed.receipt), "chain": signed.chain_pem.decode("ascii"),
            "signature": base64.b64encode(signed.signature).decode("ascii")}


def receipt_from_json(value: Any) -> SignedReceipt:
    """A signed receipt from its JSON form; ReceiptError (malformed) naming the field otherwise."""
    if not isinstance(value, dict):
        raise ReceiptError("malformed", f"receipt: expected a JSON object, got {type(value).__name__}")
    body, chain, signature = value.get("receipt"), value.get("chain"), value.get("signature")
    names = [f.name for f in fields(Receipt)]
    if not isinstance(body, dict) or sorted(body) != sorted(names):
        found = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise ReceiptError("malformed", f"receipt: expected the fields {', '.join(names)}, got {found}")
    if not isinstance(chain, str) or not chain.isascii():
        raise ReceiptError("malformed", "chain: expected the trainer's credential chain as PEM text")
    try:
        raw_signature = base64.b64decode(signature, validate=True) if isinstance(signature, str) else None
    except (binascii.Error, ValueError):
        raw_signature = None
    if not raw_signature:
        raise ReceiptError("malformed", "signature: expected base64 text")
    return SignedReceipt(Receipt(**body), chain.encode("ascii"), raw_signature)
