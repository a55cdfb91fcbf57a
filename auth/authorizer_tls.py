"""TLS on the authorizer's port, anchored in the run's root CA.

Design choices:

- Why TLS on a port nodes reach before they hold a credential: a node checks every reply against
  the root it pinned, but a status carries no signature, and a renewing node leaves when it is
  refused (auth/admission.py). Over TLS a status comes from the authorizer; a man in the middle
  can only break the connection, which the node retries.
- Server: a key made at start (never written) and a certificate for ``AUTHORIZER_SERVER_NAME``
  from the current issuing CA, served with the issuing CA and the root. grpc asks
  ``_Certificates`` for a configuration on every handshake; it answers "no change" until the
  issuing CA rotates, then issues from the new one. No client certificate is asked for: a
  newcomer holds none, and a renewal proves its key in the request.
- Client: a node knows the root's fingerprint (the join file), not yet the root. ``presented_chain``
  runs one TLS handshake that verifies nothing and reads the chain the server presents;
  ``pinned_root`` keeps the certificate whose SHA-256 is the pinned fingerprint, and nothing else
  of that handshake is used. ``authorizer_channel`` then trusts that root alone and expects
  ``AUTHORIZER_SERVER_NAME``, a name no credential carries, so an admitted peer cannot pose as the
  authorizer either. A renewing node holds the root already (its state directory).
- Reading the presented chain needs ``SSLObject.get_unverified_chain``: public from Python 3.13,
  the same call on the object's ``_sslobj`` in 3.10 to 3.12. ``_unverified_chain`` is the one
  place that knows.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from typing import Any, Optional, Sequence

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from agora.auth.authority import RunAuthority
from agora.auth.credentials import AUTHORIZER_SERVER_NAME, Clock, certificate_fingerprint, issue_authorizer_certificate
from agora.auth.keys import generate_key, private_key_pem

__all__ = ["authorizer_server_credentials", "presented_chain", "pinned_root", "authorizer_channel"]

logger = logging.getLogger(__name__)


class _Certificates:
    """grpc's certificate-configuration fetcher: the authorizer's certificate from the current issuing CA."""

    def __init__(self, authority: RunAuthority, clock: Clock):
        self._authority, self._clock = authority, clock
        self._key = generate_key()
        self._lock = threading.Lock()  # grpc calls from its own threads
        self._issuer_serial: Optional[int] = None
        self.initial = self._configuration()

    def _configuration(self) -> Any:
        issuer, now = self._authority.issuing(), self._clock()
        chain = issue_authorizer_certificate(issuer, self._key.public_key(), now=now,
                                             lifetime_s=issuer.not_after - now) + self._authority.root_pem
        self._issuer_serial = issuer.certificate.serial_number
        return grpc.ssl_server_certificate_configuration([(private_key_pem(self._key), chain)])

    def __call__(self) -> Optional[Any]:
        """A new configuration once the issuing CA rotated, else None (keep serving the current one)."""
        try:
            with self._lock:
                if self._authority.issuing().certificate.serial_number == self._issuer_serial:
                    return None
                logger.info("authorizer: TLS certificate re-issued by the new issuing CA")
                return self._configuration()
        except Exception as error:  # noqa: BLE001 - grpc's thread must never see an exception
            logger.warning("authorizer: cannot re-issue its TLS certificate (%s); serving the current one", error)
            return None


def authorizer_server_credentials(authority: RunAuthority, clock: Clock = time.time) -> grpc.ServerCredentials:
    """TLS for the authorizer's port, with a certificate chained to the run's root."""
    certificates = _Certificates(authority, clock)
    return grpc.dynamic_ssl_server_credentials(certificates.initial, certificates,
                                               require_client_authentication=False)


def _host_and_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _unverified_chain(ssl_object: ssl.SSLObject) -> list[bytes]:
    chain = getattr(ssl_object, "get_unverified_chain", None)  # Python 3.13+: DER bytes
    if chain is not None:
        return [bytes(der) for der in chain() or ()]
    return [cert.public_bytes(ssl._ssl.ENCODING_DER) for cert in ssl_object._sslobj.get_unverified_chain() or ()]


async def presented_chain(address: str, timeout_s: float) -> list[bytes]:
    """The certificates (DER) the TLS server at ``address`` presents, unverified. Raises OSError
    (ssl.SSLError included) or asyncio.TimeoutError when no TLS handshake completes."""
    host, port = _host_and_port(address)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # read only: pinned_root judges
    context.set_alpn_protocols(["h2"])
    _, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, ssl=context, server_hostname=AUTHORIZER_SERVER_NAME), timeout_s)
    try:
        return _unverified_chain(writer.get_extra_info("ssl_object"))
    finally:
        writer.close()


def pinned_root(chain: Sequence[bytes], root_fingerprint: str) -> Optional[bytes]:
    """The certificate of ``chain`` whose SHA-256 is ``root_fingerprint``, as PEM; None when absent."""
    for der in chain:
        try:
            if certificate_fingerprint(der) == root_fingerprint:
                return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)
        except ValueError:  # not a certificate: it cannot be the pinned one
            continue
    return None


def authorizer_channel(address: str, root_pem: bytes) -> grpc.aio.Channel:
    """A TLS channel to the authorizer that trusts ``root_pem`` alone and expects the authorizer's name."""
    return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=root_pem),
                                   options=[("grpc.ssl_target_name_override", AUTHORIZER_SERVER_NAME)])
