"""A node's credential directory: its key, its current credential, the pinned root and the run.

Layout of ``--state-dir`` (every file written atomically; secrets 0600):

    node.key          the node's RSA key (auth/keys.py): TLS, libp2p identity, record signatures
    identity.p2p      the same key in libp2p's format, for hivemind's ``identity_path``
    credential.pem    the current credential: leaf + issuing CA, PEM (renewed at half life)
    root.pem          the run's root CA, whose fingerprint the node pinned
    run.json          what the authorizer told the node: run id, role, stage, the run config,
                      the bootstrap peers, the authorizer's address and the root fingerprint
    receipts.sqlite   a worker's: the receipts trainers delivered for its work and the attestations
                      of its averaging rounds by their other members, verified and kept
                      (node/worker/receipts.py, attestations.py; `agora-node ledger export`)

The directory is the one place where a renewed credential appears. Every consumer re-reads it
when it changes (``NodeCredentials.current`` compares the file's mtime and size): the gRPC
server's certificate fetcher, new client channels, and hivemind's DHT authorizer running in
another process. So renewal is one atomic file replace and needs no cross-process messaging.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from agora.auth.credentials import Clock, CredentialError, CredentialVerifier, Identity, certificate_fingerprint
from agora.auth.keys import load_or_create_key, peer_id_of, private_key_pem, write_libp2p_identity, write_private_file

__all__ = ["NodeCredentials", "RunInfo", "CREDENTIAL_FILE", "ROOT_FILE", "RUN_FILE", "IDENTITY_FILE"]

CREDENTIAL_FILE = "credential.pem"
ROOT_FILE = "root.pem"
RUN_FILE = "run.json"
IDENTITY_FILE = "identity.p2p"


@dataclass(frozen=True)
class RunInfo:
    """What a node learned at admission (``run.json``)."""

    run_id: str
    role: str
    stage: Optional[int]
    root_fingerprint: str
    authorizer: str = ""  # host:port; empty for a credential minted offline by `authorizer issue`
    config: Optional[dict] = None  # the run config as config_to_dict writes it
    initial_peers: tuple[str, ...] = ()

    def to_json(self) -> str:
        data = dict(self.__dict__)
        data["initial_peers"] = list(self.initial_peers)
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunInfo":
        data = json.loads(text)
        data["initial_peers"] = tuple(data.get("initial_peers") or ())
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class NodeCredentials:
    """One node's state directory; thread-safe reads of the current credential."""

    def __init__(self, directory: str | Path, *, clock: Clock):
        self.directory = Path(directory)
        self.key: rsa.RSAPrivateKey = load_or_create_key(self.directory)
        self.peer_id = peer_id_of(self.key)
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: tuple[int, int] | None = None
        self._chain: bytes | None = None
        self._identity: Identity | None = None
        self._verifier: CredentialVerifier | None = None
        self.generation = 0  # bumped whenever a new credential is loaded: clients rebuild channels

    # ---- paths and static parts

    @property
    def credential_path(self) -> Path:
        return self.directory / CREDENTIAL_FILE

    @property
    def identity_path(self) -> Path:
        """hivemind's ``identity_path``: the node key in libp2p's format (written on first use)."""
        path = self.directory / IDENTITY_FILE
        if not path.exists():
            write_libp2p_identity(self.key, path)
        return path

    def key_pem(self) -> bytes:
        return private_key_pem(self.key)

    def root_pem(self) -> bytes:
        return (self.directory / ROOT_FILE).read_bytes()

    def run_info(self) -> RunInfo:
        return RunInfo.from_json((self.directory / RUN_FILE).read_text())

    def has_credential(self) -> bool:
        return all((self.directory / name).exists() for name in (CREDENTIAL_FILE, ROOT_FILE, RUN_FILE))

    def verifier(self) -> CredentialVerifier:
        """A verifier pinned to this directory's root, for this run."""
        if self._verifier is None:
            self._verifier = CredentialVerifier(self.root_pem(), self.run_info().run_id, clock=self._clock)
        return self._verifier

    # ---- writing (admission, renewal)

    def save(self, chain_pem: bytes, root_pem: bytes, run: RunInfo) -> Identity:
        """Store a new credential after checking it against the pinned root and this node's key."""
        if certificate_fingerprint(root_pem) != run.root_fingerprint:
            raise CredentialError("untrusted", "the root CA received does not match the pinned fingerprint "
                                               f"{run.root_fingerprint[:16]}...")
        verifier = CredentialVerifier(root_pem, run.run_id, clock=self._clock)
        identity = verifier.verify(chain_pem, public_key=self.key.public_key())
        write_private_file(self.directory / ROOT_FILE, root_pem, mode=0o644)
        write_private_file(self.directory / RUN_FILE, run.to_json().encode(), mode=0o644)
        write_private_file(self.credential_path, chain_pem, mode=0o644)
        self._verifier = verifier
        self.current()
        return identity

    # ---- reading

    def current(self) -> tuple[bytes, Identity]:
        """The current credential chain and its identity, re-read when the file changed."""
        try:
            stat = os.stat(self.credential_path)
        except FileNotFoundError:
            raise CredentialError("missing", f"no credential in {self.directory}: join through an "
                                             "authorizer first (or mint one with `agora-node authorizer issue`)") from None
        seen = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            if seen != self._seen:
                chain = self.credential_path.read_bytes()
                identity = self.verifier().verify(chain, public_key=self.key.public_key())
                self._chain, self._identity, self._seen = chain, identity, seen
                self.generation += 1
            return self._chain, self._identity

    def identity(self) -> Identity:
        return self.current()[1]

    def remaining_s(self) -> float:
        return self.identity().remaining_s(self._clock())

    def describe(self) -> dict[str, Any]:
        identity = self.identity()
        return {"peer_id": identity.peer_id, "role": identity.role, "stage": identity.stage,
                "run_id": identity.run_id, "expires_in_s": round(identity.remaining_s(self._clock()), 1)}


def public_key_pem(key: rsa.RSAPrivateKey | rsa.RSAPublicKey) -> bytes:
    public = key.public_key() if isinstance(key, rsa.RSAPrivateKey) else key
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
