"""The authorizer over real grpc.aio on 127.0.0.1:0, driven by the node's own admission client.

One run authority and a pool of node keys per module (tests/helpers/authorizer_world.py); one event
loop and one freshly started authorizer per test.
"""

from __future__ import annotations

import asyncio
import logging
import contextlib
import dataclasses
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agora.auth.admission import (AdmissionError, AdmissionRefused, AuthorizerUntrusted, CredentialRenewer,
                                  RenewalRefused, admit, reachability_listener, renew_if_past_half_life)
from agora.auth.credentials import CredentialVerifier
from agora.auth.keys import KEY_FILE, private_key_pem, write_private_file
from agora.auth.node_state import NodeCredentials, RunInfo, public_key_pem
from agora.auth.policy import Floors, sign_proof
from agora.auth.service import AuthorizerService
from agora.auth.settings import AuthorizerSettings
from agora.node.rpc.server import run
from agora.pipeline.config import config_to_dict
from agora.pipeline.fingerprint import run_fingerprint
from agora.pipeline.schema import ConfigError, checked
from agora.protos import authorizer_adapter as adapter
import authorizer_world as world
from authorizer_world import (CONFIG, FINGERPRINT, OPEN, PEERS, Clock, fingerprint_from_config, free_port, join,
                              serving)
from odd_keys import same_modulus_with_exponent

pytestmark = pytest.mark.timeout(60)

authority, keys, nodes = world.authority, world.keys, world.nodes  # fixtures


# ---- admission

def test_workers_are_admitted_with_verified_credentials_on_the_least_covered_stages(authority, nodes):
    async def main():
        async with serving(authority) as (service, address):
            runs = [await join(address, nodes(i), authority, fingerprint=fingerprint_from_config) for i in range(3)]
            requested = await join(address, nodes(3), authority, stage=1)
            return runs, requested, service.admitted()

    runs, requested, admitted = run(main())
    assert [r.stage for r in runs] == [0, 1, 2], "each went to the stage with the fewest workers"
    assert requested.stage == 1, "a requested stage is honoured"
    first = runs[0]
    assert first.run_id == "test-run" and first.config == config_to_dict(CONFIG) and first.initial_peers == PEERS
    assert first.root_fingerprint == authority.root_fingerprint
    node = NodeCredentials(nodes(0).directory, clock=time.time)
    chain, identity = node.current()
    verified = CredentialVerifier(authority.root_pem, "test-run", clock=time.time).verify(
        chain, roles=("worker",), stage=0, public_key=node.key.public_key())
    assert verified.peer_id == node.peer_id
    assert node.run_info() == first
    by_peer = {entry.peer_id: entry for entry in admitted}
    assert by_peer[node.peer_id].rtt_ms > 0 and by_peer[node.peer_id].upload_mbit > 0
    assert len(admitted) == 4 and {entry.stage for entry in admitted} == {0, 1, 2}


def test_trainers_skip_floors_and_the_cap_and_operators_cannot_join(authority, nodes):
    high = Floors(min_upload_mbit=1e9, min_download_mbit=1e9, max_rtt_ms=0.0, min_accelerator_gb=1e9, min_ram_gb=1e9)

    async def main():
        async with serving(authority, floors=high, max_workers=1) as (service, address):
            trainer = await join(address, nodes(0), authority, role="trainer")
            monitor = await join(address, nodes(1), authority, role="monitor")
            with pytest.raises(AdmissionError, match="operator credentials are minted offline"):
                await join(address, nodes(2), authority, role="operator")
            return trainer, monitor, service.admitted()

    trainer, monitor, admitted = run(main())
    assert (trainer.role, trainer.stage, monitor.role) == ("trainer", None, "monitor")
    assert {entry.role for entry in admitted} == {"trainer", "monitor"}


def test_by_default_trainers_and_clients_need_a_credential_their_operator_mints(authority, nodes, tmp_path):
    """A stranger joins as a worker or a monitor only; a trainer or client the operator minted renews."""
    clock = Clock()
    minted = authority.mint(tmp_path / "ci-trainer", role="trainer", lifetime_s=600.0)
    default = AuthorizerSettings().join_roles
    assert default == ("worker", "monitor")

    async def main():
        async with serving(authority, join_roles=default, credential_lifetime_s=600.0,
                           clock=clock) as (service, address):
            for role in ("trainer", "client"):
                with pytest.raises(AdmissionError, match=rf"admits {role}s with a credential from its operator only "
                                                         rf"\(`agora-node authorizer issue --role {role}`\)"):
                    await join(address, nodes(0), authority, role=role)
            worker = await join(address, nodes(1), authority)
            monitor = await join(address, nodes(2), authority, role="monitor")
            clock.offset = 30.0
            renewed = await CredentialRenewer(address, minted, on_revoked=pytest.fail).renew_once()
            return worker, monitor, renewed

    worker, monitor, renewed = run(main())
    assert (worker.role, monitor.role, renewed.role) == ("worker", "monitor", "trainer")
    with pytest.raises(ConfigError, match=r"^authorizer.join_roles: expected some of .* \(operator is not one\)"):
        checked(AuthorizerSettings, "authorizer", join_roles=("worker", "operator"))


def _signed(request: adapter.JoinRequest, key) -> adapter.JoinRequest:
    return dataclasses.replace(request, signature=sign_proof(key, adapter.signed_payload(request)))


def test_a_challenge_is_single_use(authority, keys):
    async def main():
        async with serving(authority) as (service, address):
            async with world.channel(address, authority) as channel:
                stub = adapter.AuthorizerStub(channel)
                challenge = await stub.get_challenge(adapter.ChallengeRequest(role="trainer"))
                request = _signed(adapter.JoinRequest(nonce=challenge.nonce, public_key_pem=public_key_pem(keys[0]),
                                                      role="trainer", fingerprint=FINGERPRINT.text()), keys[0])
                first = await stub.join(request)
                with pytest.raises(grpc.aio.AioRpcError) as replay:
                    await stub.join(request)
                return first, replay.value

    first, replay = run(main())
    assert first.admitted is not None
    assert replay.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "already used" in replay.details()


def test_a_join_signed_by_another_key_is_refused(authority, keys):
    async def main():
        async with serving(authority) as (service, address):
            async with world.channel(address, authority) as channel:
                stub = adapter.AuthorizerStub(channel)
                challenge = await stub.get_challenge(adapter.ChallengeRequest(role="trainer"))
                claimed = adapter.JoinRequest(nonce=challenge.nonce, public_key_pem=public_key_pem(keys[0]),
                                              role="trainer", fingerprint=FINGERPRINT.text())
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.join(_signed(claimed, keys[1]))
                return refused.value, service.admitted()

    refused, admitted = run(main())
    assert refused.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "proof of possession" in refused.details()
    assert admitted == []


def test_a_key_with_another_exponent_is_refused_at_join_and_renewal(authority, keys, tmp_path):
    odd = same_modulus_with_exponent(keys[0])
    directory = tmp_path / "odd"
    write_private_file(directory / KEY_FILE, private_key_pem(odd))
    node = NodeCredentials(directory, clock=time.time)
    # A credential for that key, as an authorizer without the rule would have issued it.
    chain = authority.issue(odd.public_key(), role="trainer", stage=None, lifetime_s=600.0)
    node.save(chain, authority.root_pem, RunInfo(run_id="test-run", role="trainer", stage=None,
                                                 root_fingerprint=authority.root_fingerprint))

    async def main():
        async with serving(authority, credential_lifetime_s=600.0) as (service, address):
            with pytest.raises(AdmissionError, match="INVALID_ARGUMENT: public_key_pem: expected an RSA key of 2048 "
                                                     "bits with public exponent 65537") as joined:
                await join(address, node, authority, role="trainer")
            with pytest.raises(RenewalRefused) as renewed:
                await CredentialRenewer(address, node, on_revoked=pytest.fail).renew_once()
            return joined.value, renewed.value, service.admitted()

    joined, renewed, admitted = run(main())
    assert renewed.code is grpc.StatusCode.INVALID_ARGUMENT and "exponent 65539" in renewed.reason
    assert admitted == []
    with pytest.raises(ValueError, match="exponent 65539"):
        authority.mint(directory, role="trainer")


@pytest.mark.parametrize("floor, value, shown", [
    ("min_upload_mbit", 1e9, r"upload rate measured [\d.]+ Mbit/s"),
    ("min_download_mbit", 1e9, r"download rate measured [\d.]+ Mbit/s"),
    ("max_rtt_ms", 1e-6, r"round-trip time to the authorizer measured [\d.]+ ms"),
    ("min_accelerator_gb", 1e6, r"accelerator memory \(cpu\) reported 0.0 GB"),
    ("min_ram_gb", 1e6, r"RAM reported [\d.]+ GB"),
])
def test_a_worker_below_a_floor_is_refused_naming_the_floor_and_the_measured_value(authority, nodes, floor, value,
                                                                                   shown):
    async def main():
        async with serving(authority, floors=dataclasses.replace(OPEN, **{floor: value})) as (service, address):
            with pytest.raises(AdmissionRefused) as refused:
                await join(address, nodes(0), authority)
            return refused.value, service.admitted()

    refused, admitted = run(main())
    assert refused.field == floor
    assert floor in refused.reason
    import re
    assert re.search(shown, refused.reason), refused.reason
    assert admitted == [] and not nodes(0).has_credential()


def test_an_unreachable_announced_address_is_refused_with_what_to_open(authority, nodes):
    closed = free_port()

    async def main():
        async with serving(authority, dialback_timeout_s=1.0) as (service, address):
            async with reachability_listener("127.0.0.1", 0) as listener:  # listening, but not where announced
                with pytest.raises(AdmissionRefused) as refused:
                    await join(address, nodes(0), authority, announce=("127.0.0.1", closed), listener=listener)
            return refused.value, service.admitted()

    refused, admitted = run(main())
    assert refused.field == "reachability"
    assert f"127.0.0.1:{closed} is unreachable from the authorizer" in refused.reason
    assert f"open TCP port {closed} on 127.0.0.1" in refused.reason and "--announce-host" in refused.reason
    assert admitted == []


def test_another_service_on_the_announced_port_is_not_mistaken_for_the_node(authority, nodes, caplog):
    caplog.set_level(logging.INFO, logger="agora.auth.service")
    async def impostor(reader, writer):
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        writer.close()

    async def main():
        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with serving(authority) as (service, address):
                async with reachability_listener("127.0.0.1", 0) as listener:
                    with pytest.raises(AdmissionRefused) as refused:
                        await join(address, nodes(0), authority, announce=("127.0.0.1", port), listener=listener)
            return refused.value, port
        finally:
            server.close()
            await server.wait_closed()

    refused, port = run(main())
    assert refused.field == "reachability" and f"127.0.0.1:{port} is unreachable" in refused.reason
    assert "something else answers" not in refused.reason, "the node is told only that it is unreachable"
    assert any("something else answers" in record.getMessage() for record in caplog.records), "the log says why"


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_an_unspecified_announce_host_is_refused(authority, nodes, host):
    async def main():
        async with serving(authority) as (service, address):
            with pytest.raises(AdmissionRefused) as refused:
                await join(address, nodes(0), authority, announce=(host, free_port()), listen_host="127.0.0.1")
            return refused.value

    refused = run(main())
    assert refused.field == "announce_host"
    assert f"{host} means 'every interface'" in refused.reason and "--announce-host" in refused.reason


def test_a_mismatched_seed_is_refused_naming_seed(authority, nodes):
    other = dataclasses.replace(CONFIG, seed=1, model=dataclasses.replace(CONFIG.model, basis_seed=1),
                                data=dataclasses.replace(CONFIG.data, seed=1))

    async def main():
        async with serving(authority) as (service, address):
            with pytest.raises(AdmissionRefused) as refused:
                await join(address, nodes(0), authority, role="trainer", fingerprint=run_fingerprint(other).text())
            return refused.value

    refused = run(main())
    assert refused.field == "fingerprint.seed"
    assert "seed=0" in refused.reason and "seed=1" in refused.reason


# ---- the cap

@pytest.mark.parametrize("frees_by", ["ban", "expiry", "leave"])
def test_the_cap_queues_the_next_worker_and_admits_it_when_a_slot_frees(authority, nodes, frees_by):
    clock = Clock()
    first, second, third = nodes(0), nodes(1), nodes(2)

    async def main():
        async with serving(authority, max_workers=1, queue_retry_after_s=0.05, join_rate_per_s=100.0,
                           credential_lifetime_s=30.0, clock=clock) as (service, address):
            await join(address, first, authority)
            positions: list[int] = []
            queued, polled_again = asyncio.Event(), asyncio.Event()

            def on_queued(position: int) -> None:
                positions.append(position)
                queued.set()
                if len(positions) >= 3:
                    polled_again.set()

            waiting = asyncio.ensure_future(join(address, second, authority, on_queued=on_queued))
            await asyncio.wait_for(queued.wait(), 20)
            async with world.channel(address, authority) as channel:  # polls carry no transfers
                stub = adapter.AuthorizerStub(channel)
                poll = await stub.get_challenge(adapter.ChallengeRequest(peer_id=second.peer_id, role="worker"))
                fresh = await stub.get_challenge(adapter.ChallengeRequest(peer_id=third.peer_id, role="worker"))
            # The queued node has polled again and been told to wait again: the cap holds.
            await asyncio.wait_for(polled_again.wait(), 20)
            assert not waiting.done(), "the cap holds while the first worker's slot is taken"
            left = None
            if frees_by == "ban":
                authority.ban(first.peer_id, "test")
            elif frees_by == "leave":  # a clean leave frees the slot at once, long before the expiry
                left = await CredentialRenewer(address, first, on_revoked=pytest.fail).leave("signal")
            else:
                clock.offset = 31.0  # the first credential expired unrenewed (within the 60 s back-dating)
            try:
                admitted = await asyncio.wait_for(waiting, 20)
            finally:
                authority.unban(first.peer_id)
            return positions, poll, fresh, admitted, service.admitted(), left

    positions, poll, fresh, admitted, entries, left = run(main())
    assert left is (True if frees_by == "leave" else None)
    assert positions and set(positions) == {1}
    assert (poll.download_bytes, poll.upload_bytes, poll.latency_probes) == (0, 0, 0)
    assert fresh.download_bytes == 256 << 10
    assert admitted.role == "worker"
    assert [entry.peer_id for entry in entries] == [second.peer_id]


def test_a_restarted_authorizer_keeps_its_slots(authority, nodes):
    async def main():
        async with serving(authority, max_workers=1) as (service, address):
            await join(address, nodes(0), authority)
        async with serving(authority, max_workers=1, restart=True) as (service, address):
            queued = asyncio.Event()
            waiting = asyncio.ensure_future(join(address, nodes(1), authority, on_queued=lambda p: queued.set()))
            await asyncio.wait_for(queued.wait(), 20)
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            return [entry.peer_id for entry in service.admitted()]

    assert run(main()) == [nodes(0).peer_id], "the second worker was queued behind the restored slot"


def test_a_leave_is_the_signer_own_and_outlives_a_restart(authority, nodes):
    """A Leave signed by another key than its credential's frees nothing; the leaver's own frees its
    slot, is counted, and a restarted authorizer does not hold that slot again."""
    outcomes: list[str] = []

    async def main():
        async with serving(authority, max_workers=1, on_leave=outcomes.append) as (service, address):
            await join(address, nodes(0), authority)
            chain, _ = nodes(0).current()
            async with world.channel(address, authority) as channel:
                stub = adapter.AuthorizerStub(channel)
                challenge = await stub.get_challenge(adapter.ChallengeRequest(role="worker", renewal=True))
                forged = adapter.LeaveRequest(nonce=challenge.nonce, credential_pem=chain, reason="forged")
                forged = dataclasses.replace(forged, signature=sign_proof(nodes(1).key, adapter.signed_payload(forged)))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.leave(forged)
            still = [entry.peer_id for entry in service.admitted()]
            freed = await CredentialRenewer(address, nodes(0), on_revoked=pytest.fail).leave("watchdog: banned")
        async with serving(authority, max_workers=1, restart=True) as (service, address):
            await asyncio.wait_for(join(address, nodes(1), authority), 20)  # admitted at once: no slot restored
            return refused.value.code(), still, freed, [entry.peer_id for entry in service.admitted()]

    code, still, freed, admitted = run(main())
    assert code is grpc.StatusCode.UNAUTHENTICATED and still == [nodes(0).peer_id]
    assert freed is True and outcomes == ["unauthenticated", "freed"]
    assert admitted == [nodes(1).peer_id]


def test_an_unanswered_leave_does_not_hold_up_the_leaver(authority, nodes):
    async def main():
        async with serving(authority) as (service, address):
            await join(address, nodes(0), authority)
        return await CredentialRenewer(address, nodes(0), on_revoked=pytest.fail).leave("signal", timeout_s=2.0)

    assert run(main()) is None


def test_join_attempts_are_rate_limited_per_address(authority):
    async def main():
        async with serving(authority, join_burst=2, join_rate_per_s=0.01) as (service, address):
            async with world.channel(address, authority) as channel:
                stub = adapter.AuthorizerStub(channel)
                for _ in range(2):
                    await stub.get_challenge(adapter.ChallengeRequest(role="trainer"))
                with pytest.raises(grpc.aio.AioRpcError) as limited:
                    await stub.get_challenge(adapter.ChallengeRequest(role="trainer"))
                return limited.value

    limited = run(main())
    assert limited.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry after" in limited.details() and "127.0.0.1" in limited.details()
    retry_after = dict(limited.trailing_metadata())["retry-after"]
    assert 90.0 <= float(retry_after) <= 100.0


# ---- renewal

def test_renewal_yields_a_new_credential_with_a_later_expiry(authority, nodes):
    clock = Clock()
    node = nodes(0)

    async def main():
        async with serving(authority, credential_lifetime_s=600.0, clock=clock) as (service, address):
            await join(address, node, authority, role="trainer")
            _, before = node.current()
            generation = node.generation
            clock.offset = 30.0
            after = await CredentialRenewer(address, node, on_revoked=pytest.fail).renew_once()
            return before, after, generation

    before, after, generation = run(main())
    assert after.not_after >= before.not_after + 29
    assert after.serial != before.serial and (after.role, after.peer_id) == (before.role, before.peer_id)
    assert node.current()[1] == after and node.generation > generation


def test_a_start_renews_a_credential_past_half_its_life_first_and_goes_on_without_an_authorizer(authority, nodes,
                                                                                                 caplog):
    """`renew_if_past_half_life` (run before a node's DHT peer starts, off the authorizer's loop as a
    node's start is): under half its life, nothing; past it, a renewal; no authorizer answering, a
    warning and the credential held."""
    clock = Clock()
    node = NodeCredentials(nodes(0).directory, clock=clock)  # the node's time is the authorizer's

    async def main():
        async with serving(authority, credential_lifetime_s=600.0, clock=clock) as (service, address):
            await join(address, node, authority, role="trainer")
            generation = node.generation
            clock.offset = 200.0
            await asyncio.to_thread(renew_if_past_half_life, address, node, clock=clock)
            fresh = node.generation
            clock.offset = 320.0
            await asyncio.to_thread(renew_if_past_half_life, address, node, clock=clock)
            return generation, fresh

    generation, fresh = run(main())
    assert fresh == generation  # a third of its life gone: not renewed
    # A fresh 600 s credential (the old one had 280 s left); certificate times are whole seconds and the
    # clock moved on while it was issued.
    assert node.generation > generation and node.current()[1].not_after >= clock() + 590
    renewed = node.generation
    clock.offset += 310.0
    with caplog.at_level(logging.WARNING, logger="agora.auth.admission"):
        renew_if_past_half_life(f"127.0.0.1:{free_port()}", node, clock=clock)
    assert node.generation == renewed and "could not renew the credential before starting" in caplog.text
    renew_if_past_half_life(None, node, clock=clock)  # an offline credential: nothing to renew with


def test_a_banned_node_cannot_renew_and_is_told_to_stop(authority, nodes):
    node = nodes(1)
    revoked: list[str] = []

    async def main():
        async with serving(authority, credential_lifetime_s=600.0) as (service, address):
            await join(address, node, authority)
            authority.ban(node.peer_id, "poisoned gradients")
            try:
                # The renewer's clock says half the lifetime has passed: it renews at once.
                renewer = CredentialRenewer(address, node, on_revoked=revoked.append, clock=lambda: time.time() + 400)
                await asyncio.wait_for(renewer.run(), 20)
                return renewer, service.admitted()
            finally:
                authority.unban(node.peer_id)

    renewer, admitted = run(main())
    assert revoked == ["banned: poisoned gradients"] and renewer.revoked == revoked[0]
    assert admitted == [], "the banned worker's slot is freed"


def test_an_expired_credential_is_not_renewed(authority, nodes):
    clock = Clock()
    node = nodes(0)

    async def main():
        async with serving(authority, credential_lifetime_s=10.0, clock=clock) as (service, address):
            await join(address, node, authority, role="trainer")
            clock.offset = 11.0
            with pytest.raises(RenewalRefused) as refused:
                await CredentialRenewer(address, node, on_revoked=pytest.fail).renew_once()
            return refused.value

    refused = run(main())
    assert refused.code is grpc.StatusCode.UNAUTHENTICATED
    assert "expired" in refused.reason and "join again" in refused.reason


def test_the_renewer_retries_an_unreachable_authorizer_and_gives_up_at_expiry(authority, nodes, tmp_path):
    node = authority.mint(tmp_path / "minted", role="trainer", lifetime_s=2.0)
    revoked: list[str] = []

    async def main():
        renewer = CredentialRenewer(f"127.0.0.1:{free_port()}", node, on_revoked=revoked.append,
                                    retry_initial_s=0.05, retry_max_s=0.2, rpc_timeout_s=1.0)
        await asyncio.wait_for(renewer.run(), 20)
        return renewer

    renewer = run(main())
    assert renewer.renewals == 0
    assert len(revoked) == 1 and "could not renew it in time" in revoked[0]


# ---- trusting the authorizer

def test_a_node_pinning_another_root_refuses_the_authorizer(authority, nodes):
    async def main():
        async with serving(authority) as (service, address):
            with pytest.raises(AuthorizerUntrusted, match="not the pinned"):
                await admit(address, "00" * 32, nodes(0), role="trainer", fingerprint=FINGERPRINT.text())
            # It checked the root before joining: the authorizer never admitted it (no slot held).
            assert not any(node.peer_id == nodes(0).peer_id for node in service.admitted())

    run(main())
    assert not nodes(0).has_credential()


class Tampering:
    """A man in the middle: forwards to the real authorizer and rewrites the run config it hands out."""

    def __init__(self, inner: AuthorizerService):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def join(self, request, context):
        reply = await self._inner.join(request, context)
        if reply.admitted is None:
            return reply
        return dataclasses.replace(reply, admitted=dataclasses.replace(reply.admitted, config_json='{"evil": 1}'))


def test_a_tampered_run_description_is_refused(authority, nodes):
    async def main():
        async with serving(authority, handler=Tampering) as (service, address):
            with pytest.raises(AuthorizerUntrusted, match="not signed by the issuing CA"):
                await join(address, nodes(0), authority, role="trainer")

    run(main())
    assert not nodes(0).has_credential()


def test_the_authorizer_serves_health_and_reflection(authority):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def main():
        async with serving(authority) as (service, address):
            async with world.channel(address, authority) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=adapter.SERVICE_NAME))
                stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                listed = [s.name async for reply in stream for s in reply.list_services_response.service]
                return health.status, listed

    status, listed = run(main())
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert adapter.SERVICE_NAME in listed
