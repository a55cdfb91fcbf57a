"""Signed statements: what a trainer's receipt and a worker's round attestation have in common.

A statement is a frozen dataclass of plain fields (a run id, peer ids, integers, times) that one
node signs with its node key, the key its credential certifies (auth/keys.py: one key per node).
auth/receipts.py (a trainer vouches for a worker's work) and auth/round_attestations.py (a worker
vouches that another member completed an averaging round with it) are the two kinds; each says
what its fields mean, which roles may sign it and which field names its signer. This module signs
and checks, the same way for both:

- **What is signed**: the kind's domain tag (``agora-receipt-v1``, ``agora-round-v1``) and the
  statement's fields as canonical JSON (sorted keys, no spaces), so a signature over one kind (or
  over any other agora payload: a proof of possession, a ban list) is never another's, and
  changing any field breaks it. RSA-PSS/SHA-256 (auth/policy.py's proofs).
- **Who signed it, checked offline** (``verify_statement``): the statement carries its signer's
  credential chain (leaf + issuing CA), so anyone holding the run's root certificate verifies it
  long after the credential ran out: the chain is judged at the time it was valid
  (``CredentialVerifier.verify_issued``), of this run, of a role the kind allows (and of the
  statement's stage, for a stage role), for the peer id the statement names as its signer, and
  the statement's own time (when it was signed) must lie within that credential's validity.
- **Refused by reason** (``StatementError``): one of ``STATEMENT_REFUSALS``, with one readable line
  naming the field; the field bounds (``run_id_problem`` and the others) come first, so nothing out
  of bounds is ever stored.
- **The wire and file form** is JSON (``statement_to_json`` / ``statement_from_json``): the fields
  under the kind's name, the chain as PEM text and the signature in base64. Ledgers keep and export
  exactly that text, so a reader re-verifies what was signed.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import asdict, fields
from typing import Any, Optional, Sequence, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa

from agora.auth.credentials import CredentialError, CredentialVerifier, Identity, load_chain
from agora.auth.policy import proof_is_valid, sign_proof

__all__ = ["STATEMENT_REFUSALS", "StatementError", "count_problem", "peer_id_problem", "run_id_problem",
           "time_problem", "sign_statement", "statement_from_json", "statement_payload", "statement_to_json",
           "verify_statement"]

# Why a signed statement is refused (receipts and round attestations alike; each kind adds its own).
STATEMENT_REFUSALS = ("malformed", "untrusted", "expired", "wrong_run", "wrong_role", "not_signer", "bad_signature",
                      "duplicate")
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{10,128}")
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")

T = TypeVar("T")


class StatementError(ValueError):
    """A statement refused; ``reason`` is one of its kind's refusals, the message one readable line."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def run_id_problem(value: Any) -> Optional[str]:
    if not isinstance(value, str) or not _RUN_ID.fullmatch(value):
        return f"run_id: expected 1 to 64 letters, digits, '-' or '_', got {str(value)[:40]!r}"
    return None


def peer_id_problem(name: str, value: Any) -> Optional[str]:
    if not isinstance(value, str) or not _PEER_ID.fullmatch(value):
        return f"{name}: expected a base58 peer id, got {str(value)[:40]!r}"
    return None


def count_problem(name: str, value: Any) -> Optional[str]:
    if type(value) is not int or not 0 <= value < 2 ** 53:
        return f"{name}: expected an integer from 0 to 2^53, got {value!r}"
    return None


def time_problem(name: str, value: Any) -> Optional[str]:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        return f"{name}: expected a finite time in seconds since the epoch, got {value!r}"
    return None


def statement_payload(domain: bytes, statement: Any) -> bytes:
    """The bytes a signer signs: the kind's domain tag and the canonical JSON of every field."""
    return domain + json.dumps(asdict(statement), sort_keys=True, separators=(",", ":")).encode()


def sign_statement(domain: bytes, statement: Any, key: rsa.RSAPrivateKey) -> bytes:
    """The signature of the node ``key`` over ``statement`` (bounds are the caller's to check first)."""
    return sign_proof(key, statement_payload(domain, statement))


def verify_statement(statement: Any, chain_pem: bytes, signature: bytes, verifier: CredentialVerifier, *,
                     domain: bytes, kind: str, roles: Sequence[str], signer_field: str, signed_at_field: str,
                     stage: Optional[int] = None) -> Identity:
    """The signer's identity when ``statement`` (its bounds already checked) is of ``verifier``'s run
    and was signed, while its credential was valid, by the node its ``signer_field`` names, holding a
    credential of one of ``roles`` (and of ``stage`` when given); else StatementError."""
    if statement.run_id != verifier.run_id:
        raise StatementError("wrong_run", f"run_id: the {kind} is for run {statement.run_id!r}, this is run "
                                          f"{verifier.run_id!r}")
    try:
        identity = verifier.verify_issued(chain_pem, roles=roles)
    except CredentialError as error:
        reason = error.reason if error.reason in STATEMENT_REFUSALS else "untrusted"
        raise StatementError(reason, f"chain: {error}") from None
    if stage is not None and identity.stage != stage:
        raise StatementError("wrong_stage", f"chain: the {kind} is of stage {stage}, its signer's credential is "
                                            f"{identity.describe()}")
    signer = getattr(statement, signer_field)
    if identity.peer_id != signer:
        raise StatementError("not_signer", f"{signer_field}: the {kind} names {signer[:16]}..., its credential is "
                                           f"{identity.describe()}")
    signed_at = getattr(statement, signed_at_field)
    if not identity.not_before <= signed_at <= identity.not_after:
        raise StatementError("expired", f"{signed_at_field}: signed at {signed_at:.0f}, outside its credential's "
                                        f"validity [{identity.not_before:.0f}, {identity.not_after:.0f}]")
    leaf = load_chain(chain_pem)[0]
    if not proof_is_valid(_leaf_key(leaf), statement_payload(domain, statement), signature):
        raise StatementError("bad_signature", f"signature: not {identity.describe()}'s signature over this {kind}")
    return identity


def _leaf_key(leaf: x509.Certificate) -> rsa.RSAPublicKey:
    key = leaf.public_key()  # verify_issued already parsed it (the peer id is derived from it)
    if not isinstance(key, rsa.RSAPublicKey):
        raise StatementError("malformed", f"chain: expected an RSA key, got {type(key).__name__}")
    return key


def statement_to_json(kind: str, statement: Any, chain_pem: bytes, signature: bytes) -> dict[str, Any]:
    return {kind: asdict(statement), "chain": chain_pem.decode("ascii"),
            "signature": base64.b64encode(signature).decode("ascii")}


def statement_from_json(value: Any, kind: str, cls: type[T]) -> tuple[T, bytes, bytes]:
    """(statement, chain, signature) from the JSON form of a ``cls`` statement under the key ``kind``;
    StatementError (malformed) naming the field otherwise. The fields' bounds are the caller's to check."""
    if not isinstance(value, dict):
        raise StatementError("malformed", f"{kind}: expected a JSON object, got {type(value).__name__}")
    body, chain, signature = value.get(kind), value.get("chain"), value.get("signature")
    names = [f.name for f in fields(cls)]
    if not isinstance(body, dict) or sorted(body) != sorted(names):
        found = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise StatementError("malformed", f"{kind}: expected the fields {', '.join(names)}, got {found}")
    if not isinstance(chain, str) or not chain.isascii():
        raise StatementError("malformed", "chain: expected the signer's credential chain as PEM text")
    try:
        raw_signature = base64.b64decode(signature, validate=True) if isinstance(signature, str) else None
    except (binascii.Error, ValueError):
        raw_signature = None
    if not raw_signature:
        raise StatementError("malformed", "signature: expected base64 text")
    return cls(**body), chain.encode("ascii"), raw_signature
