"""What a typed entry's value carries, end to end: its msgpack record, its writer's credential
chain (``OwnedRecordValidator`` attaches it, dht/security.py says why), and the owner's signature
(hivemind's ``RSASignatureValidator``, as ``OwnerSignatureValidator``)."""

from __future__ import annotations

import base64
import binascii
import logging
from typing import Optional

from cryptography.exceptions import UnsupportedAlgorithm
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord

__all__ = ["OwnerSignatureValidator", "attached_credential_at", "record_bytes", "split_credential"]

logger = logging.getLogger(__name__)

# What follows a typed entry's value: the writer's credential chain, base64, then "]".
CREDENTIAL_OPEN = b"[credential:"


class OwnerSignatureValidator(RSASignatureValidator):
    """hivemind's ``RSASignatureValidator``; a malformed owner key refuses instead of raising."""

    @classmethod
    def unsigned(cls, value: bytes) -> bytes:
        """``value`` without the signature hivemind's validator attaches (its ``strip_value``)."""
        return cls._SIGNATURE_RE.sub(b"", value)

    def validate(self, record: DHTRecord) -> bool:
        try:
            return super().validate(record)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            logger.debug("refusing an entry whose owner marker is not an RSA key")
            return False


def split_credential(value: bytes) -> tuple[bytes, Optional[bytes]]:
    """(the value, the writer's credential chain attached to it, or None if none is)."""
    at = attached_credential_at(value)
    if at < 0:
        return value, None
    try:
        return value[:at], base64.b64decode(value[at + len(CREDENTIAL_OPEN):-1], validate=True)
    except binascii.Error:
        return value, None


def record_bytes(value: bytes) -> bytes:
    """A typed entry's value as a store carries it (signed, a credential attached) -> its msgpack record."""
    return split_credential(OwnerSignatureValidator.unsigned(value))[0]


def attached_credential_at(value: bytes) -> int:
    """Where the attached credential begins in ``value``, -1 if none is attached."""
    at = value.rfind(CREDENTIAL_OPEN)  # base64 has no '[' or ':': the last marker is the attachment
    return at if at >= 0 and value.endswith(b"]") else -1
