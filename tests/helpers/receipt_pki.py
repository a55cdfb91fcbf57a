"""A run's PKI in memory for the receipt tests: a root, an issuing CA, a trainer's key and credential, and
credentials for other keys and roles on demand (tests/unit/test_receipts.py, test_receipt_ledger.py,
test_receipt_book.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from cryptography.hazmat.primitives.asymmetric import rsa

from agora.auth.credentials import CredentialVerifier, Issuer, issue_credential, make_issuing_ca, make_root_ca
from agora.auth.keys import generate_key

NOW = 1_800_000_000.0
RUN = "run-a"


@dataclass(frozen=True)
class ReceiptPki:
    root: Issuer
    issuing: Issuer
    trainer_key: rsa.RSAPrivateKey
    trainer_chain: bytes

    def credential(self, key: rsa.RSAPrivateKey, role: str = "trainer", stage: Optional[int] = None) -> bytes:
        return issue_credential(self.issuing, key.public_key(), run_id=RUN, role=role, stage=stage, now=NOW,
                                lifetime_s=3600)

    def verifier(self, now: float = NOW + 200.0) -> CredentialVerifier:
        return CredentialVerifier(self.root.pem, RUN, clock=lambda: now)


def receipt_pki() -> ReceiptPki:
    root = make_root_ca(RUN, generate_key(), now=NOW, lifetime_s=30 * 86400)
    issuing = make_issuing_ca(root, generate_key(), now=NOW, lifetime_s=86400)
    trainer_key = generate_key()
    pki = ReceiptPki(root, issuing, trainer_key, b"")
    return ReceiptPki(root, issuing, trainer_key, pki.credential(trainer_key))
