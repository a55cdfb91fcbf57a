"""One authorizer world for the integration tests of the authorizer: the run, its config, node keys
and a freshly started authorizer per test (tests/integration/test_authorizer*.py).

The fixtures are module-scoped where they are costly (a run authority, RSA keys at 50-200 ms each);
a test module takes them with `authority, keys, nodes = world.authority, world.keys, world.nodes`.
"""

from __future__ import annotations

import contextlib
import socket
import time

import grpc
import pytest

from agora.auth.admission import admit
from agora.auth.admitted import ADMITTED_DB
from agora.auth.authority import RunAuthority
from agora.auth.authorizer_tls import authorizer_channel
from agora.auth.keys import KEY_FILE, generate_key, private_key_pem, write_private_file
from agora.auth.node_state import NodeCredentials
from agora.auth.policy import Floors
from agora.auth.service import AuthorizerService
from agora.auth.settings import JOIN_ROLES, AuthorizerSettings
from agora.node.authorizer import start_authorizer_server
from agora.node.worker.worker import StageWorker
from agora.pipeline.config import PRESETS, config_to_dict
from agora.pipeline.fingerprint import run_fingerprint
from agora.protos import authorizer_adapter as adapter
from tcp_relay import TcpRelay

CONFIG = PRESETS["tiny"].with_stages(3)
FINGERPRINT = run_fingerprint(CONFIG)
PEERS = ("/ip4/203.0.113.5/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",)
# Tests run on loopback: no floor but the one a test raises.
OPEN = Floors(min_upload_mbit=0, min_download_mbit=0, max_rtt_ms=float("inf"), min_accelerator_gb=0, min_ram_gb=0)
# The dial-back reaches workers on loopback only in a local run.
# Every role may join by itself here: these tests exercise each role's own join. What a served
# authorizer admits by default (workers and monitors only) has a test of its own.
SMALL = dict(preflight_bytes=256 << 10, latency_probes=3, local_network=True, join_roles=JOIN_ROLES)


@pytest.fixture(scope="module")
def authority(tmp_path_factory) -> RunAuthority:
    return RunAuthority(tmp_path_factory.mktemp("authority"), run_id="test-run")


@pytest.fixture(scope="module")
def keys() -> list:
    return [generate_key() for _ in range(4)]


@pytest.fixture
def nodes(tmp_path, keys):
    """Node state directories with keys from the pool (node i gets key i)."""
    def node(i: int) -> NodeCredentials:
        directory = tmp_path / f"node{i}"
        write_private_file(directory / KEY_FILE, private_key_pem(keys[i]))
        return NodeCredentials(directory, clock=time.time)
    return node


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Clock:
    """Wall time plus an offset a test can advance (the authorizer's clock)."""

    def __init__(self):
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@contextlib.asynccontextmanager
async def serving(authority: RunAuthority, *, floors: Floors = OPEN, handler=None, restart: bool = False,
                  **settings):
    """A fresh authorizer for `authority` on 127.0.0.1:0 (with no admitted nodes, unless `restart`);
    yields (service, address)."""
    if not restart:
        for name in (ADMITTED_DB, f"{ADMITTED_DB}-wal", f"{ADMITTED_DB}-shm"):
            (authority.directory / name).unlink(missing_ok=True)
    clock = settings.pop("clock", time.time)
    hooks = {name: settings.pop(name) for name in ("on_refused", "on_report", "on_leave", "on_join_check",
                                                  "stage_members")
             if name in settings}
    service = AuthorizerService(authority, AuthorizerSettings(floors=floors, **{**SMALL, **settings}),
                                run_config=config_to_dict(CONFIG), fingerprint=FINGERPRINT, initial_peers=PEERS,
                                clock=clock, **hooks)
    started = await start_authorizer_server(handler(service) if handler else service, "127.0.0.1", 0)
    try:
        yield service, f"127.0.0.1:{started.port}"
    finally:
        await started.stop(None)
        service.close()


async def join(address: str, node: NodeCredentials, authority: RunAuthority, *, role: str = "worker", **kwargs):
    if role == "worker":
        kwargs.setdefault("announce", ("127.0.0.1", free_port()))
    kwargs.setdefault("fingerprint", FINGERPRINT.text())
    return await admit(address, authority.root_fingerprint, node, role=role, **kwargs)


@contextlib.asynccontextmanager
async def serving_worker(directory, stage: int = 0, *, run_id: str = "test-run"):
    """A real StageWorker of this world's run on 127.0.0.1:0, over mutual TLS with the credential in
    ``directory`` (a state directory minted for ``stage``); yields it."""
    worker = StageWorker(CONFIG, stage, run_id=run_id, credentials=NodeCredentials(directory, clock=time.time))
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


def fingerprint_from_config(config: dict) -> str:
    from agora.pipeline.config import config_from_dict

    return run_fingerprint(config_from_dict(config)).text()


def channel(address: str, authority: RunAuthority):
    """A TLS channel to `authority`'s authorizer at `address`, for tests that speak its protocol by hand."""
    return authorizer_channel(address, authority.root_pem)


async def challenges_until_refused(address: str, root_pem: bytes, *, role: str = "trainer",
                                   limit: int = 100) -> tuple[int, grpc.aio.AioRpcError | None]:
    """Ask the authorizer at `address` (of the run whose root is `root_pem`) for join challenges as
    `role` until refused (`limit` at most): how many were granted, and the refusal."""
    async with authorizer_channel(address, root_pem) as opened:
        stub = adapter.AuthorizerStub(opened)
        for granted in range(limit):
            try:
                await stub.get_challenge(adapter.ChallengeRequest(role=role))
            except grpc.aio.AioRpcError as error:
                return granted, error
    return limit, None


@contextlib.asynccontextmanager
async def from_sources(address: str, sources: list[str]):
    """For each local address in `sources` (127.0.0.x), an address that reaches the authorizer at
    `address` from it (a TCP relay dialling from that source): callers of several addresses."""
    relays = [TcpRelay(address, source=source) for source in sources]
    try:
        yield [await relay.start() for relay in relays]
    finally:
        for relay in relays:
            await relay.close()
