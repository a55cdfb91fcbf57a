"""A run's PKI as tests/integration/test_grpc_auth.py presents it: workers of every stage, two trainers and a
monitor, and the credentials an attacker or a stale node holds (expired, not yet valid, of another
root, self-signed, a chain without its key), plus the channel factory that presents any of them
and a hook that records who got through.
"""

from __future__ import annotations

import asyncio
import datetime
import shutil
import time
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from agora.auth.authority import RunAuthority
from agora.auth.credentials import identity_uri
from agora.auth.keys import private_key_pem
from agora.auth.node_state import NodeCredentials
from agora.node.rpc.auth_check import Caller, current_caller
from agora.node.rpc.interceptors import CallHook

HOUR = 3600.0




@dataclass(frozen=True)
class Pki:
    authority: RunAuthority
    workers: list  # state dirs of workers of stages 0, 1, 2
    trainer: object  # trainer A
    trainer_b: object
    monitor: object
    expired: object  # trainer A's key, a credential that expired an hour ago
    future: object  # trainer A's key, a credential valid from two hours on
    other_pki: object  # a trainer of a same-shaped PKI with another root
    root_pem: bytes


def _copy_key(source, target) -> None:
    target.mkdir(parents=True)
    shutil.copy(source / "node.key", target / "node.key")


def build_pki(base, run_id: str) -> Pki:
    """Every credential the tests present, under `base`."""
    now = time.time()
    # The CA is back-dated three hours, so credentials minted "in the past" still chain to it.
    RunAuthority(base / "ca", run_id=run_id, clock=lambda: now - 3 * HOUR).issuing()
    authority = RunAuthority(base / "ca")
    workers = [authority.mint(base / f"worker{i}", role="worker", stage=i).directory for i in range(3)]
    trainer = authority.mint(base / "trainer", role="trainer").directory
    trainer_b = authority.mint(base / "trainer_b", role="trainer").directory
    monitor = authority.mint(base / "monitor", role="monitor").directory
    _copy_key(trainer, base / "expired")
    RunAuthority(base / "ca", clock=lambda: now - 2 * HOUR).mint(base / "expired", role="trainer")
    _copy_key(trainer, base / "future")
    RunAuthority(base / "ca", clock=lambda: now + 2 * HOUR).mint(base / "future", role="trainer")
    _copy_key(trainer_b, base / "other")  # another run's authority, same shape, another root
    other = RunAuthority(base / "other_ca", run_id=run_id).mint(base / "other", role="trainer").directory
    return Pki(authority, workers, trainer, trainer_b, monitor, base / "expired", base / "future", other,
               authority.root_pem)


class OffsetClock:
    """Wall time plus an offset a test moves (the worker's view of time, for the per-call check)."""

    def __init__(self):
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@dataclass
class RawTls:
    """A channel factory presenting any key and chain (attackers do not use our directory layout)."""

    root_pem: bytes
    key_pem: bytes | None
    chain_pem: bytes | None
    secure = True

    def generation(self) -> int:
        return 0

    def open(self, address, *, target_name, options=()):
        credentials = grpc.ssl_channel_credentials(self.root_pem, self.key_pem, self.chain_pem)
        return grpc.aio.secure_channel(address, credentials,
                                       options=[*options, ("grpc.ssl_target_name_override", target_name)])


def raw(directory, *, root: bytes | None = None, key_from=None) -> RawTls:
    """The files of a state directory as a channel factory; `key_from`: another directory's key."""
    chain = (directory / "credential.pem").read_bytes()
    key = ((key_from or directory) / "node.key").read_bytes()
    return RawTls(root or (directory / "root.pem").read_bytes(), key, chain)


def self_signed(directory, run_id: str) -> RawTls:
    """A certificate that claims to be a trainer of this run, signed by its own key."""
    node = NodeCredentials(directory, clock=time.time)
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "trainer")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(node.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.UniformResourceIdentifier(identity_uri(run_id, "trainer", None, node.peer_id))]), critical=False)
            .sign(node.key, hashes.SHA256()))
    return RawTls(node.root_pem(), private_key_pem(node.key), cert.public_bytes(serialization.Encoding.PEM))


class CallerLog(CallHook):
    """After CallerCheck in the chain: records every call that got through, with its caller."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, Caller]] = []
        self.arrived = asyncio.Event()  # set by every call that gets through; clear it to wait for the next

    async def before(self, call, context):
        self.calls.append((call.method.rsplit("/", 1)[-1], current_caller()))
        self.arrived.set()
