"""What a typed entry's value carries, end to end: its msgpack record, its writer's credential
chain (``OwnedRecordValidator`` attaches it, dht/security.py says why), and the owner's signature
(hivemind's ``RSASignatureValidator``, as ``OwnerSignatureValidator``, appends it last).

The chain rides as its certificates' DER, length-delimited from the value's end::

    <msgpack record> <DER 1> ... <DER n> <len 1> ... <len n> <n> CHAIN_MARK

(each length 2 bytes big-endian, ``n`` one byte). Read from the end, the lengths say exactly where
the chain begins, so nothing in the record can pass for it. DER rather than base64 of PEM: an entry
is read from every holder in a read's beam, and the chain is most of it (1.9 KB against 3.6 KB).
A reader gets the chain back as PEM (``split_credential``), what ``CredentialVerifier`` takes.
An entry of an older agora (``[credential:<base64 PEM>]``) is told apart and refused naming that.
"""

from __future__ import annotations

import logging
import ssl
import struct
from typing import Optional

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.serialization import Encoding
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord

__all__ = ["CHAIN_MARK", "OwnerSignatureValidator", "credential_attachment", "attached_credential_at",
           "older_credential_format", "record_bytes", "split_credential"]

logger = logging.getLogger(__name__)

CHAIN_MARK = b"agora-chain-1"  # ends a value that carries its writer's chain (the format's version)
_LENGTH = struct.Struct(">H")
_OLDER_MARK = b"[credential:"  # how an older agora attached it: base64 of the PEM chain, then "]"


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


def credential_attachment(chain_pem: bytes) -> bytes:
    """What follows a value to attach the writer's chain (PEM, as ``NodeCredentials`` holds it)."""
    ders = [cert.public_bytes(Encoding.DER) for cert in x509.load_pem_x509_certificates(chain_pem)]
    lengths = b"".join(_LENGTH.pack(len(der)) for der in ders)
    return b"".join(ders) + lengths + bytes([len(ders)]) + CHAIN_MARK


def split_credential(value: bytes) -> tuple[bytes, Optional[bytes]]:
    """(the value, the writer's credential chain attached to it as PEM, or None if none is)."""
    found = _attached(value)
    if found is None:
        return value, None
    at, ders = found
    return value[:at], "".join(ssl.DER_cert_to_PEM_cert(der) for der in ders).encode("ascii")


def record_bytes(value: bytes) -> bytes:
    """A typed entry's value as a store carries it (signed, a credential attached) -> its msgpack record."""
    return split_credential(OwnerSignatureValidator.unsigned(value))[0]


def attached_credential_at(value: bytes) -> int:
    """Where the attached credential begins in ``value``, -1 if none is attached."""
    found = _attached(value)
    return -1 if found is None else found[0]


def older_credential_format(value: bytes) -> bool:
    """Whether ``value`` carries its chain as an older agora attached it (its writer needs upgrading)."""
    return value.endswith(b"]") and value.rfind(_OLDER_MARK) >= 0


def _attached(value: bytes) -> Optional[tuple[int, list[bytes]]]:
    """(where the chain begins, its certificates' DER), or None if ``value`` carries none."""
    if not value.endswith(CHAIN_MARK) or len(value) < len(CHAIN_MARK) + 1:
        return None
    count_at = len(value) - len(CHAIN_MARK) - 1
    count = value[count_at]
    lengths_at = count_at - _LENGTH.size * count
    if count == 0 or lengths_at < 0:
        return None
    lengths = [_LENGTH.unpack_from(value, lengths_at + _LENGTH.size * i)[0] for i in range(count)]
    at = lengths_at - sum(lengths)
    if at < 0:
        return None
    ders, offset = [], at
    for length in lengths:
        ders.append(value[offset:offset + length])
        offset += length
    return at, ders
