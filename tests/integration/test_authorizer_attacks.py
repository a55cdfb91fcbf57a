"""The authorizer under attack, over real grpc.aio on loopback: floods of newcomers from one network
while admitted nodes renew, greedy preflights, odd keys, a forged authorizer, dial-backs aimed at
the authorizer's own neighbourhood. Callers of several addresses of one network are real
connections from 127.0.0.x (tests/helpers/tcp_relay.py dials from a chosen source address)."""

from __future__ import annotations

import contextlib
import logging
import threading

import grpc
import pytest

from agora.auth.admission import (AdmissionError, AdmissionRefused, AuthorizerUntrusted, CredentialRenewer,
                                  RenewalRefused, reachability_listener)
from agora.auth.authority import RunAuthority
from agora.auth.authorizer_tls import authorizer_server_credentials
from agora.node.rpc.server import bind, run
from agora.protos import authorizer_adapter as adapter
from agora.protos import authorizer_pb2, authorizer_pb2_grpc
import authorizer_world as world
from authorizer_world import Clock, challenges_until_refused, from_sources, join, serving

pytestmark = pytest.mark.timeout(60)

authority, keys, nodes = world.authority, world.keys, world.nodes  # fixtures


def test_a_flood_from_one_network_is_refused_while_a_node_there_renews(authority, tmp_path):
    """Six addresses of 127.0.0.0/24, the renewing node's own among them, ask for join challenges
    until refused, ten each at most: the network's share of the challenge book (32 by default)
    stops them, and the node still renews from its address."""
    clock = Clock()
    node = authority.mint(tmp_path / "trainer", role="trainer", lifetime_s=600.0)

    async def main():
        async with serving(authority, join_rate_per_s=0.01, join_burst=10, credential_lifetime_s=600.0,
                           clock=clock) as (service, address):
            refusals = [await challenges_until_refused(address, authority.root_pem)]  # from 127.0.0.1, the node's own address
            async with from_sources(address, [f"127.0.0.{i}" for i in range(2, 7)]) as relays:
                refusals += [await challenges_until_refused(relay, authority.root_pem) for relay in relays]
            clock.offset = 30.0
            renewed = await CredentialRenewer(address, node, on_revoked=pytest.fail).renew_once()
            return refusals, renewed

    refusals, renewed = run(main())
    assert sum(granted for granted, _ in refusals) == 32
    assert all(error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED for _, error in refusals)
    assert "network 127.0.0.0/24" in refusals[-1][1].details()
    assert float(dict(refusals[-1][1].trailing_metadata())["retry-after"]) > 0
    assert renewed.role == "trainer" and renewed.not_after > clock() + 500


def test_one_network_cannot_fill_the_challenge_book(authority, tmp_path):
    """Two addresses of one network without rate limits of their own: 32 outstanding challenges
    (the network's share) and the next is refused with when to retry; other networks and renewals
    still get theirs."""
    clock = Clock()
    node = authority.mint(tmp_path / "trainer", role="trainer", lifetime_s=600.0)

    async def main():
        async with serving(authority, join_rate_per_s=100.0, join_burst=100, credential_lifetime_s=600.0,
                           clock=clock) as (service, address):
            async with from_sources(address, ["127.0.0.2", "127.0.0.3", "127.0.1.1"]) as (first, second, other):
                granted, _ = await challenges_until_refused(first, authority.root_pem, limit=20)
                more, refused = await challenges_until_refused(second, authority.root_pem)
                elsewhere, _ = await challenges_until_refused(other, authority.root_pem, limit=1)
            clock.offset = 30.0
            renewed = await CredentialRenewer(address, node, on_revoked=pytest.fail).renew_once()
            return granted + more, refused, elsewhere, renewed

    granted, refused, elsewhere, renewed = run(main())
    assert granted == 32 and refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "32 challenges outstanding for network 127.0.0.0/24" in refused.details()
    assert 0 < float(dict(refused.trailing_metadata())["retry-after"]) <= 60
    assert elsewhere == 1, "127.0.1.0/24 is another network"
    assert renewed.role == "trainer"


def test_a_challenge_runs_one_measurement_at_a_time(authority):
    async def main():
        async with serving(authority, preflight_bytes=4 << 20) as (service, address):
            async with world.channel(address, authority) as channel:
                stub = adapter.AuthorizerStub(channel)
                challenge = await stub.get_challenge(adapter.ChallengeRequest(role="worker"))
                first = authorizer_pb2_grpc.AuthorizerStub(channel).MeasureDownload()
                await first.write(authorizer_pb2.TransferControl(nonce=challenge.nonce))
                await first.read()  # the first download is under way (and held by flow control)
                refusals = []
                for transfer in (stub.download(challenge.nonce, max_bytes=challenge.download_bytes),
                                 stub.upload(challenge.nonce, size=challenge.upload_bytes)):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await transfer
                    refusals.append(refused.value)
                first.cancel()
                return refusals

    refusals = run(main())
    assert [error.code() for error in refusals] == [grpc.StatusCode.FAILED_PRECONDITION] * 2
    assert all("the download measurement of this challenge is still running" in error.details()
               for error in refusals)


def test_an_admission_and_a_renewal_sign_off_the_event_loop(authority, nodes, monkeypatch):
    """The RSA signatures of an admission (credential, run description) and of a renewal run on a
    worker thread: the loop keeps serving other nodes meanwhile."""
    from agora.auth import joining as joining_module

    signed: list[tuple[str, bool]] = []

    def recorded(function):
        def call(*args, **kwargs):
            signed.append((function.__name__, threading.current_thread() is threading.main_thread()))
            return function(*args, **kwargs)
        return call

    for name in ("issue_credential", "sign_proof"):
        monkeypatch.setattr(joining_module, name, recorded(getattr(joining_module, name)))
    clock = Clock()

    async def main():
        async with serving(authority, credential_lifetime_s=600.0, clock=clock) as (service, address):
            node = nodes(0)
            await join(address, node, authority, role="trainer")
            clock.offset = 30.0
            await CredentialRenewer(address, node, on_revoked=pytest.fail).renew_once()

    run(main())
    assert signed == [("issue_credential", False), ("sign_proof", False), ("issue_credential", False)]


def test_the_dial_back_goes_only_to_public_addresses_and_says_only_unreachable(authority, nodes, caplog):
    """A worker announcing loopback, though its listener answers there, is refused unless the run is
    local; the refusal reads as a closed port's does, and only the operator's log says why."""
    caplog.set_level(logging.INFO, logger="agora.auth.service")
    closed = world.free_port()
    counted: list[str] = []

    async def main():
        async with serving(authority, local_network=False, on_refused=counted.append) as (service, address):
            async with reachability_listener("127.0.0.1", 0) as listener:
                with pytest.raises(AdmissionRefused) as listening:
                    await join(address, nodes(0), authority, announce=("127.0.0.1", listener.port), listener=listener)
                with pytest.raises(AdmissionRefused) as closed_port:
                    await join(address, nodes(1), authority, announce=("127.0.0.1", closed), listener=listener)
                refused = (listening.value, listener.port), (closed_port.value, closed)
            admitted = service.admitted()
        async with serving(authority, local_network=True) as (service, address):
            local = await join(address, nodes(0), authority)
        return refused, admitted, local

    refused, admitted, local = run(main())
    reasons = [error.reason.replace(str(port), "PORT") for error, port in refused]
    assert reasons[0] == reasons[1] and "127.0.0.1:PORT is unreachable from the authorizer" in reasons[0]
    assert all(error.field == "reachability" for error, _ in refused) and admitted == []
    assert counted == ["reachability", "reachability"], "each refusal is counted by its field (a metric)"
    logged = " ".join(record.getMessage() for record in caplog.records)
    assert "resolves to 127.0.0.1: no public address" in logged and "--local-network" in logged
    assert local.role == "worker", "a local run dials loopback"


class Forger:
    """A man in the middle without the run's CA: it answers every call PERMISSION_DENIED, as a ban would."""

    async def _refuse(self, *args):
        await args[-1].abort(grpc.StatusCode.PERMISSION_DENIED, "banned: forged by a man in the middle")

    get_run = get_challenge = measure_latency = measure_download = measure_upload = join = renew = _refuse


@contextlib.asynccontextmanager
async def forger(tls_authority=None):
    """A fake authorizer on 127.0.0.1:0: plaintext, or TLS with `tls_authority`'s certificate."""
    server = grpc.aio.server()
    adapter.add_authorizer_service(server, Forger())
    credentials = None if tls_authority is None else authorizer_server_credentials(tls_authority)
    port = bind(server, "127.0.0.1", 0, credentials)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "another-ca"])
def test_a_forged_refusal_does_not_revoke_a_renewing_node(authority, nodes, tmp_path, tls):
    """One forged PERMISSION_DENIED used to make a renewing node leave (exit 3). Now the node talks
    only to a server holding a certificate under its pinned root: it refuses the forger and retries."""
    other = RunAuthority(tmp_path / "other-ca", run_id="test-run") if tls else None
    node = authority.mint(tmp_path / "trainer", role="trainer", lifetime_s=600.0)
    revoked: list[str] = []

    async def main():
        async with forger(other) as address:
            renewer = CredentialRenewer(address, node, on_revoked=revoked.append, rpc_timeout_s=5.0)
            with pytest.raises(AdmissionError) as renewing:
                await renewer.renew_once()
            with pytest.raises(AdmissionError) as joining:
                await join(address, nodes(0), authority, role="trainer", rpc_timeout_s=5.0)
            return renewing.value, joining.value, renewer

    renewing, joining, renewer = run(main())
    assert not isinstance(renewing, RenewalRefused) and "unreachable" in str(renewing)
    assert renewer.revoked is None and revoked == []
    if tls:
        assert isinstance(joining, AuthorizerUntrusted) and "not the pinned" in str(joining)
    else:
        assert "unreachable over TLS" in str(joining)
    assert not nodes(0).has_credential()


async def _held_download(address: str, authority) -> tuple[object, object]:
    """A download under way from the caller of `address`, held by flow control: one newcomer call in flight."""
    channel = world.channel(address, authority)
    challenge = await adapter.AuthorizerStub(channel).get_challenge(adapter.ChallengeRequest(role="worker"))
    stream = authorizer_pb2_grpc.AuthorizerStub(channel).MeasureDownload()
    await stream.write(authorizer_pb2.TransferControl(nonce=challenge.nonce))
    await stream.read()
    return channel, stream


async def _refused_download(address: str, authority) -> grpc.aio.AioRpcError:
    async with world.channel(address, authority) as channel:
        stub = adapter.AuthorizerStub(channel)
        challenge = await stub.get_challenge(adapter.ChallengeRequest(role="worker"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.download(challenge.nonce, max_bytes=challenge.download_bytes)
        return refused.value


def test_newcomers_calls_in_flight_are_capped_per_network_and_below_the_ports_cap(authority, tmp_path):
    """A port of 8 calls: newcomers may hold 6, 2 per network; renewals get through all the while."""
    clock = Clock()
    node = authority.mint(tmp_path / "trainer", role="trainer", lifetime_s=600.0)

    async def main():
        async with serving(authority, max_concurrent_rpcs=8, max_calls_per_network=2, preflight_bytes=64 << 20,
                           join_rate_per_s=100.0, join_burst=100, credential_lifetime_s=600.0,
                           clock=clock) as (service, address):
            async with from_sources(address, ["127.0.1.1", "127.0.2.1", "127.0.3.1"]) as (second, third, fourth):
                held = [await _held_download(address, authority) for _ in range(2)]
                per_network = await _refused_download(address, authority)
                clock.offset = 30.0
                first_renewal = await CredentialRenewer(address, node, on_revoked=pytest.fail).renew_once()
                held += [await _held_download(relay, authority) for relay in (second, second, third, third)]
                in_all = await _refused_download(fourth, authority)
                clock.offset = 60.0
                second_renewal = await CredentialRenewer(address, node, on_revoked=pytest.fail).renew_once()
                for channel, stream in held:
                    stream.cancel()
                    await channel.close()
            return per_network, in_all, first_renewal, second_renewal

    per_network, in_all, first_renewal, second_renewal = run(main())
    assert per_network.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "2 calls in flight from network 127.0.0.0/24" in per_network.details()
    assert in_all.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "6 calls of newcomers in flight" in in_all.details()
    assert second_renewal.not_after > first_renewal.not_after
