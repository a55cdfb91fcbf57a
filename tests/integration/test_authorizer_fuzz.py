"""Fuzz the authorizer's request parsing (hypothesis, fixed budget): arbitrary bytes and arbitrary
field values into Join, Renew, Report and Leave get only clean statuses, never UNKNOWN or INTERNAL, and the
authorizer then still admits a well-formed node."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agora.auth.admission import admit
from agora.auth.authority import RunAuthority
from agora.auth.authorizer_tls import authorizer_channel
from agora.auth.keys import KEY_FILE, generate_key, private_key_pem, write_private_file
from agora.auth.node_state import NodeCredentials, public_key_pem
from agora.auth.policy import Floors, sign_proof
from agora.auth.service import AuthorizerService
from agora.auth.settings import JOIN_ROLES, AuthorizerSettings
from agora.node.authorizer import start_authorizer_server
from agora.node.rpc.server import new_event_loop
from agora.pipeline.config import PRESETS, config_to_dict
from agora.pipeline.fingerprint import run_fingerprint
from agora.protos import authorizer_adapter as adapter

pytestmark = pytest.mark.timeout(120)

CONFIG = PRESETS["tiny"].with_stages(3)
FINGERPRINT = run_fingerprint(CONFIG)
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
         grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.NOT_FOUND}
BUDGET = settings(max_examples=100, deadline=None, database=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
U32, U64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
HOSTS = st.sampled_from(["", "127.0.0.1", "0.0.0.0", "::", "::1", "localhost", "not a host!", "a" * 300,
                         "999.1.1.1", "\u00e9t\u00e9.example", "127.0.0.1:80"])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One authorizer on its own event loop for the whole module (hypothesis drives it example by example)."""
    authority = RunAuthority(tmp_path_factory.mktemp("fuzz-authority"), run_id="fuzz")
    service = AuthorizerService(
        authority, AuthorizerSettings(floors=Floors(0, 0, float("inf"), 0, 0), preflight_bytes=4096,
                                      latency_probes=1, join_rate_per_s=1e6, join_burst=10**6,
                                      network_join_rate_per_s=1e6, network_join_burst=10**6,
                                      challenges_per_network=4096, renew_rate_per_s=1e6, renew_burst=10**6,
                                      dialback_timeout_s=0.2, join_roles=JOIN_ROLES),  # every role's path
        run_config=config_to_dict(CONFIG), fingerprint=FINGERPRINT)
    loop = new_event_loop()
    started = loop.run_until_complete(start_authorizer_server(service, "127.0.0.1", 0))
    port = started.port
    async def open_channel():  # grpc.aio binds a channel to the loop it is created on
        return authorizer_channel(f"127.0.0.1:{port}", authority.root_pem)

    channel = loop.run_until_complete(open_channel())
    key = generate_key()
    trainer_dir = tmp_path_factory.mktemp("fuzz-trainer")
    write_private_file(trainer_dir / KEY_FILE, private_key_pem(key))
    chain = authority.mint(trainer_dir, role="trainer").current()[0]
    yield loop, channel, authority, key, chain, f"127.0.0.1:{port}"
    loop.run_until_complete(channel.close())
    loop.run_until_complete(started.stop(None))
    loop.close()


def _on(loop, call):
    """Run `call()` (which starts an RPC) on the authorizer's loop; grpc.aio calls belong to the loop they start on."""
    async def go():
        return await call()
    return loop.run_until_complete(go())


def _status(loop, call) -> grpc.StatusCode:
    try:
        _on(loop, call)
    except grpc.aio.AioRpcError as error:
        assert error.code() in CLEAN, f"{error.code()}: {error.details()}"
        return error.code()
    return grpc.StatusCode.OK


def test_arbitrary_bytes_get_clean_statuses(world):
    loop, channel, *_ = world
    methods = [f"/{adapter.SERVICE_NAME}/{name}" for name in ("Join", "Renew", "Report", "Leave", "GetChallenge",
                                                                        "GetRun", "CheckJoin")]

    @BUDGET
    @given(method=st.sampled_from(methods), payload=st.binary(max_size=512))
    def check(method, payload):
        call = channel.unary_unary(method)  # no serializer: the bytes go out as they are
        _status(loop, lambda: call(payload, timeout=10))

    check()


def test_arbitrary_join_fields_get_clean_statuses(world):
    """Half the examples are garbage throughout; the other half carry a real challenge for their role,
    the real key, a valid signature, mostly the run's fingerprint and (workers) a finished preflight,
    so that the arbitrary values reach the stage, announce, hardware, floor and dial-back checks."""
    loop, channel, authority, key, *_ = world
    stub = adapter.AuthorizerStub(channel)
    real_pem = public_key_pem(key)

    async def preflight(challenge):
        await stub.echo_latency(challenge.nonce, timeout=10)
        await stub.download(challenge.nonce, max_bytes=challenge.download_bytes, timeout=10)
        await stub.upload(challenge.nonce, size=challenge.upload_bytes, timeout=10)

    @BUDGET
    @given(deep=st.booleans(), deep_role=st.sampled_from(["worker", "worker", "trainer", "monitor"]),
           keep_fingerprint=st.sampled_from([True, True, True, False]),
           role=st.one_of(st.sampled_from(["worker", "trainer", "monitor", "operator", ""]), st.text(max_size=20)),
           pem=st.one_of(st.just(real_pem), st.binary(max_size=600), st.just(b"-----BEGIN PUBLIC KEY-----\n")),
           nonce=st.binary(max_size=40), signature=st.binary(max_size=300),
           fingerprint=st.one_of(st.just(FINGERPRINT.text()), st.text(max_size=80),
                                 st.builds(lambda s: dataclasses.replace(FINGERPRINT, seed=s).text(), U32)),
           hardware=st.one_of(st.none(), st.builds(adapter.Hardware, st.text(max_size=30), U64, U64)),
           stage=st.one_of(st.none(), st.integers(0, 3), U32), host=HOSTS, port=st.one_of(st.integers(0, 70000), U32))
    def check(deep, deep_role, keep_fingerprint, role, pem, nonce, signature, fingerprint, hardware, stage, host,
              port):
        if deep:
            role, pem = deep_role, real_pem
            fingerprint = FINGERPRINT.text() if keep_fingerprint else fingerprint
            challenge = _on(loop, lambda: stub.get_challenge(adapter.ChallengeRequest(role=role)))
            nonce = challenge.nonce
            if challenge.download_bytes:
                _on(loop, lambda: preflight(challenge))
        request = adapter.JoinRequest(nonce=nonce, public_key_pem=pem, role=role, fingerprint=fingerprint,
                                      hardware=hardware, stage=stage, announce_host=host, announce_port=port,
                                      signature=signature)
        if deep:
            request = dataclasses.replace(request, signature=sign_proof(key, adapter.signed_payload(request)))
        _status(loop, lambda: stub.join(request, timeout=10))

    check()


def test_arbitrary_renewals_get_clean_statuses(world):
    loop, channel, authority, key, chain, _ = world
    stub = adapter.AuthorizerStub(channel)

    @BUDGET
    @given(fresh=st.booleans(), signed=st.booleans(), nonce=st.binary(max_size=40),
           credential=st.one_of(st.just(chain), st.binary(max_size=800),
                                st.builds(lambda cut: chain[:cut], st.integers(0, len(chain))),
                                st.builds(lambda at, byte: chain[:at] + bytes([byte]) + chain[at + 1:],
                                          st.integers(0, len(chain) - 1), st.integers(0, 255))),
           signature=st.binary(max_size=300))
    def check(fresh, signed, nonce, credential, signature):
        if fresh:
            challenge = _on(loop, lambda: stub.get_challenge(adapter.ChallengeRequest(role="trainer", renewal=True)))
            nonce = challenge.nonce
        request = adapter.RenewRequest(nonce=nonce, credential_pem=credential, signature=signature)
        if signed:
            request = dataclasses.replace(request, signature=sign_proof(key, adapter.signed_payload(request)))
        _status(loop, lambda: stub.renew(request, timeout=10))

    check()


def test_arbitrary_reports_get_clean_statuses(world):
    """Half the examples carry a fresh challenge and the trainer's valid signature over their fields,
    so that the arbitrary values reach the bounds, the worker's check and the store."""
    loop, channel, authority, key, chain, _ = world
    stub = adapter.AuthorizerStub(channel)

    @BUDGET
    @given(deep=st.booleans(), nonce=st.binary(max_size=40),
           credential=st.one_of(st.just(chain), st.binary(max_size=800)),
           peer_id=st.one_of(st.text(max_size=140), st.just("Qm" + "z" * 44)), stage=st.one_of(st.integers(0, 3), U32),
           kind=st.text(max_size=60), feature=st.text(max_size=60), cusum=st.floats(), replies=U32,
           reason=st.text(max_size=600), signature=st.binary(max_size=300))
    def check(deep, nonce, credential, peer_id, stage, kind, feature, cusum, replies, reason, signature):
        if deep:
            challenge = _on(loop, lambda: stub.get_challenge(adapter.ChallengeRequest(role="trainer", renewal=True)))
            nonce, credential = challenge.nonce, chain
        report = adapter.WorkerReport(nonce=nonce, credential_pem=credential, peer_id=peer_id, stage=stage, kind=kind,
                                      feature=feature, cusum=cusum, replies=replies, reason=reason, signature=signature)
        if deep:
            report = dataclasses.replace(report, signature=sign_proof(key, adapter.signed_payload(report)))
        _status(loop, lambda: stub.report(report, timeout=10))

    check()
    assert authority.bans() == {}  # no admitted worker here: nothing was banned


def test_arbitrary_leaves_get_clean_statuses(world):
    """Half the examples are signed over a fresh challenge with the node's key, so the arbitrary reason
    reaches the log and the slot's release."""
    loop, channel, authority, key, chain, _ = world
    stub = adapter.AuthorizerStub(channel)

    @BUDGET
    @given(deep=st.booleans(), nonce=st.binary(max_size=40),
           credential=st.one_of(st.just(chain), st.binary(max_size=800)), reason=st.text(max_size=600),
           signature=st.binary(max_size=300))
    def check(deep, nonce, credential, reason, signature):
        if deep:
            challenge = _on(loop, lambda: stub.get_challenge(adapter.ChallengeRequest(role="trainer", renewal=True)))
            nonce, credential = challenge.nonce, chain
        leave = adapter.LeaveRequest(nonce=nonce, credential_pem=credential, reason=reason, signature=signature)
        if deep:
            leave = dataclasses.replace(leave, signature=sign_proof(key, adapter.signed_payload(leave)))
        _status(loop, lambda: stub.leave(leave, timeout=10))

    check()


def test_the_authorizer_still_admits_after_the_fuzzing(world, tmp_path):
    loop, channel, authority, key, chain, address = world
    node = NodeCredentials(tmp_path / "late", clock=time.time)
    run = _on(loop, lambda: admit(address, authority.root_fingerprint, node, role="trainer",
                                  fingerprint=FINGERPRINT.text()))
    assert run.run_id == "fuzz" and node.identity().role == "trainer"
