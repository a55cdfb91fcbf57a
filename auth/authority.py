"""The run's certificate authority and ban list, kept in the authorizer's ``--state-dir``.

Layout (keys 0600, every write atomic, every change under one file lock so the serving
authorizer and the operator's ``ban``/``issue`` commands can run at once):

    authority.json     run id, creation time
    root.key/.pem      the root CA (its fingerprint is what nodes pin; default lifetime 1 year)
    issuing.key/.pem   the current issuing CA (default 24 h), replaced at half life
    bans.json          banned peer ids with reason and time

The root key is only used to sign issuing CAs; credentials are signed by the issuing CA. The ban
list is re-read whenever it changes on disk, so `agora-node authorizer ban` takes effect on the
running service's next admission or renewal.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from filelock import FileLock

from agora.auth.credentials import (
    Clock,
    Issuer,
    certificate_fingerprint,
    issue_credential,
    make_issuing_ca,
    make_root_ca,
)
from agora.auth.keys import generate_key, node_key_problem, private_key_pem, write_private_file
from agora.auth.node_state import NodeCredentials, RunInfo

__all__ = ["RunAuthority", "BanEntry", "DEFAULT_CREDENTIAL_LIFETIME_S", "DEFAULT_ISSUING_LIFETIME_S"]

DEFAULT_CREDENTIAL_LIFETIME_S = 3600.0
DEFAULT_ISSUING_LIFETIME_S = 24 * 3600.0
DEFAULT_ROOT_LIFETIME_S = 365 * 24 * 3600.0


@dataclass(frozen=True)
class BanEntry:
    peer_id: str
    reason: str
    banned_at: float


class RunAuthority:
    """Open (or create, on first start) the authority of one run in ``state_dir``."""

    def __init__(self, state_dir: str | Path, *, run_id: Optional[str] = None, clock: Clock = time.time,
                 issuing_lifetime_s: float = DEFAULT_ISSUING_LIFETIME_S,
                 root_lifetime_s: float = DEFAULT_ROOT_LIFETIME_S):
        self.directory = Path(state_dir)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self.issuing_lifetime_s = issuing_lifetime_s
        self._lock = FileLock(str(self.directory / ".authority.lock"))
        self._issuing: Optional[Issuer] = None
        self._bans_seen: Optional[tuple[int, int]] = None
        self._bans: dict[str, BanEntry] = {}
        with self._lock:
            meta_path = self.directory / "authority.json"
            if meta_path.exists():
                meta = json.loads(meta_path.read_text())
                if run_id is not None and run_id != meta["run_id"]:
                    raise ValueError(f"--state-dir {self.directory} holds run {meta['run_id']!r}, not {run_id!r}")
            else:
                if run_id is None:
                    raise ValueError(f"--state-dir {self.directory} holds no authority yet: give the run id")
                key = generate_key()
                root = make_root_ca(run_id, key, now=clock(), lifetime_s=root_lifetime_s)
                write_private_file(self.directory / "root.key", private_key_pem(key))
                write_private_file(self.directory / "root.pem", root.pem, mode=0o644)
                meta = {"run_id": run_id, "created_at": clock()}
                write_private_file(meta_path, json.dumps(meta, indent=1).encode(), mode=0o644)
            self.run_id: str = meta["run_id"]
            self.root = self._load_issuer("root")

    # ---- CAs

    def _load_issuer(self, name: str) -> Issuer:
        key = serialization.load_pem_private_key((self.directory / f"{name}.key").read_bytes(), password=None)
        assert isinstance(key, rsa.RSAPrivateKey)
        cert = x509.load_pem_x509_certificate((self.directory / f"{name}.pem").read_bytes())
        return Issuer(key, cert)

    @property
    def root_pem(self) -> bytes:
        return self.root.pem

    @property
    def root_fingerprint(self) -> str:
        return certificate_fingerprint(self.root.pem)

    def issuing(self) -> Issuer:
        """The current issuing CA, replaced once past half its life (SPIRE's rule)."""
        now = self._clock()
        issuer = self._issuing
        if issuer is not None and now < issuer.not_before + (issuer.not_after - issuer.not_before) / 2:
            return issuer
        with self._lock:
            path = self.directory / "issuing.pem"
            if path.exists():
                issuer = self._load_issuer("issuing")
                if now < issuer.not_before + (issuer.not_after - issuer.not_before) / 2:
                    self._issuing = issuer
                    return issuer
            key = generate_key()
            issuer = make_issuing_ca(self.root, key, now=now, lifetime_s=self.issuing_lifetime_s)
            write_private_file(self.directory / "issuing.key", private_key_pem(key))
            write_private_file(path, issuer.pem, mode=0o644)
            self._issuing = issuer
            return issuer

    def issue(self, public_key: rsa.RSAPublicKey, *, role: str, stage: Optional[int],
              lifetime_s: float = DEFAULT_CREDENTIAL_LIFETIME_S) -> bytes:
        """A credential chain for ``public_key`` (no policy here: the service decides who gets one)."""
        return issue_credential(self.issuing(), public_key, run_id=self.run_id, role=role, stage=stage,
                                now=self._clock(), lifetime_s=lifetime_s)

    def mint(self, out_dir: str | Path, *, role: str, stage: Optional[int] = None,
             lifetime_s: float = DEFAULT_CREDENTIAL_LIFETIME_S, config: Optional[dict] = None,
             initial_peers: tuple[str, ...] = (), authorizer: str = "") -> NodeCredentials:
        """`agora-node authorizer issue`: a credential for a node state directory on this machine
        (its key is created there if absent; the key never leaves it)."""
        node = NodeCredentials(out_dir, clock=self._clock)
        problem = node_key_problem(node.key.public_key())
        if problem is not None:
            raise ValueError(f"the node key in {out_dir}: {problem}")
        chain = self.issue(node.key.public_key(), role=role, stage=stage, lifetime_s=lifetime_s)
        node.save(chain, self.root_pem, RunInfo(run_id=self.run_id, role=role, stage=stage,
                                                root_fingerprint=self.root_fingerprint, authorizer=authorizer,
                                                config=config, initial_peers=tuple(initial_peers)))
        return node

    # ---- bans

    def _bans_path(self) -> Path:
        return self.directory / "bans.json"

    def bans(self) -> dict[str, BanEntry]:
        path = self._bans_path()
        try:
            stat = path.stat()
        except FileNotFoundError:
            self._bans, self._bans_seen = {}, None
            return {}
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen != self._bans_seen:
            entries = json.loads(path.read_text() or "[]")
            self._bans = {e["peer_id"]: BanEntry(e["peer_id"], e.get("reason", ""), float(e.get("banned_at", 0)))
                          for e in entries}
            self._bans_seen = seen
        return dict(self._bans)

    def is_banned(self, peer_id: str) -> Optional[BanEntry]:
        return self.bans().get(peer_id)

    def _write_bans(self, bans: dict[str, BanEntry]) -> None:
        entries = [e.__dict__ for e in sorted(bans.values(), key=lambda e: e.banned_at)]
        write_private_file(self._bans_path(), json.dumps(entries, indent=1).encode(), mode=0o644)

    def ban(self, peer_id: str, reason: str = "") -> BanEntry:
        with self._lock:
            bans = self.bans()
            entry = bans.get(peer_id) or BanEntry(peer_id, reason, self._clock())
            bans[peer_id] = entry
            self._write_bans(bans)
            return entry

    def unban(self, peer_id: str) -> bool:
        with self._lock:
            bans = self.bans()
            found = bans.pop(peer_id, None) is not None
            if found:
                self._write_bans(bans)
            return found
