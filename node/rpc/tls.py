"""Mutual TLS between peers, with the run's credentials (auth/credentials.py, auth/node_state.py).

Design choices:

- Why TLS rather than per-request signed tokens: the handshake proves possession of the
  credential's key once per connection (a signature per request would cost an RSA operation on
  every microbatch, and a nonce cache against replays); the chain is checked by BoringSSL against
  the pinned root alone, locally, with no call to the authorizer; and every byte of activations
  is encrypted and integrity-protected on the way. What TLS checks only at the handshake (expiry
  on a long-lived connection, run, role per method) the per-call check does
  (node/rpc/auth_check.py).
- Server: ``grpc.dynamic_ssl_server_credentials`` with client authentication required. grpc asks
  the fetcher for a new certificate configuration on every new handshake; the fetcher re-reads
  the node's credential directory (``NodeCredentials.current``: a stat, and a parse only when the
  file changed) and hands grpc a new configuration only when the generation moved. A renewed
  credential (an atomic replace of credential.pem, by whatever process renews it) is thus served
  on new connections without a restart, while open connections keep going.
- Client: ``TlsChannels`` builds ``grpc.aio.secure_channel`` with the node's key and chain and the
  TLS target name the dialled worker's credential must carry (``server_name(role, stage,
  peer_id)``, from the DHT record): whoever answers must hold a credential of this run for that
  peer id and stage, so a forged record pointing at another worker gets a failed handshake, not
  a session. ``generation()`` tells a client when the credential changed; the client then opens a
  new channel for new calls and closes the old one after a grace period (in-flight calls finish:
  node/trainer/stage_client.py).
- ``InsecureChannels`` has the same interface for ``--insecure`` (plaintext; the caller decided).
- grpc calls the fetcher from its own threads and must never see it raise: on an unreadable or
  invalid new credential the server keeps serving the last good one (which then simply expires).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional, Protocol, Sequence

import grpc

from agora.auth.credentials import CredentialError, server_name
from agora.auth.node_state import NodeCredentials

__all__ = [
    "ChannelFactory",
    "InsecureChannels",
    "TlsChannels",
    "server_credentials",
    "worker_server_name",
]

logger = logging.getLogger("agora.node.rpc.tls")


def worker_server_name(stage: int, peer_id: str) -> str:
    """The TLS target name of the worker of `stage` with `peer_id` (what its credential carries)."""
    return server_name("worker", stage, peer_id)


class _CertificateFetcher:
    """grpc's certificate-configuration fetcher over one node's credential directory."""

    def __init__(self, node: NodeCredentials):
        self._node = node
        self._lock = threading.Lock()  # grpc may call from several threads
        chain, _ = node.current()
        self.served_generation = node.generation
        self.initial = self._configuration(chain)

    def _configuration(self, chain: bytes) -> Any:
        return grpc.ssl_server_certificate_configuration([(self._node.key_pem(), chain)],
                                                         root_certificates=self._node.root_pem())

    def __call__(self) -> Optional[Any]:
        """A new configuration when the credential changed since the last one served, else None."""
        try:
            with self._lock:
                chain, identity = self._node.current()
                if self._node.generation == self.served_generation:
                    return None
                self.served_generation = self._node.generation
                logger.info("serving the renewed credential (serial %x) on new connections", identity.serial)
                return self._configuration(chain)
        except Exception as error:  # noqa: BLE001 - grpc's thread must never see an exception
            logger.warning("credential in %s unreadable (%s); still serving the previous one",
                           self._node.directory, error)
            return None


def server_credentials(node: NodeCredentials) -> grpc.ServerCredentials:
    """Server credentials that require a client certificate from the run's CA and serve the node's
    current credential, re-read on every new connection (renewal needs no restart).

    Raises CredentialError when the node has no valid credential to start with."""
    fetcher = _CertificateFetcher(node)
    return grpc.dynamic_ssl_server_credentials(fetcher.initial, fetcher, require_client_authentication=True)


class ChannelFactory(Protocol):
    """How a client opens channels to peers; `generation` changes when new channels are due."""

    secure: bool  # TLS: `open` needs the target name the peer's credential must carry

    def generation(self) -> int: ...

    def open(self, address: str, *, target_name: Optional[str],
             options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel: ...


class InsecureChannels:
    """Plaintext channels (``--insecure``): no credential, no target-name check."""

    secure = False

    def generation(self) -> int:
        return 0

    def open(self, address: str, *, target_name: Optional[str] = None,
             options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(address, options=list(options))


class TlsChannels:
    """Mutual-TLS channels presenting `node`'s current credential."""

    secure = True

    def __init__(self, node: NodeCredentials):
        self.node = node
        self._lock = threading.Lock()
        self._credentials: Optional[grpc.ChannelCredentials] = None
        self._credentials_generation = -1
        node.current()  # fail now, not at the first call, without a credential

    def generation(self) -> int:
        """The credential generation (re-reads the directory when the file changed)."""
        try:
            self.node.current()
        except CredentialError as error:
            # Keep the last good credential: new handshakes will show what is wrong with it.
            logger.warning("credential in %s unreadable (%s); keeping the previous one", self.node.directory, error)
        return self.node.generation

    def channel_credentials(self) -> grpc.ChannelCredentials:
        with self._lock:
            chain, _ = self.node.current()
            if self._credentials is None or self._credentials_generation != self.node.generation:
                self._credentials = grpc.ssl_channel_credentials(self.node.root_pem(), self.node.key_pem(), chain)
                self._credentials_generation = self.node.generation
            return self._credentials

    def open(self, address: str, *, target_name: Optional[str],
             options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        if not target_name:
            raise ValueError("a TLS channel needs the target name the peer's credential must carry "
                             "(the peer id and stage from its DHT record)")
        return grpc.aio.secure_channel(address, self.channel_credentials(),
                                       options=[*options, ("grpc.ssl_target_name_override", target_name)])
