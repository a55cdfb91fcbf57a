"""A would-be member's link probe over real gRPC with mutual TLS: a real authorizer on 127.0.0.1:0
(tests/helpers/authorizer_world.py) issues the probe credential on a Join's dry run, and a real
StageWorker of the stage answers the doctor's probe with its round trip and rates. A probe
credential gets nothing else: every other method of the worker refuses it, and so does the DHT's
door; a probe past its bounds, a second one at once, one over the caller's rate or for another
stage is refused, and the worker serves on. Pure pieces: tests/unit/test_link_probe_bounds.py."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hivemind.proto.auth_pb2 import AccessToken

from agora.auth.admission import hardware_report
from agora.auth.authorizer_tls import authorizer_channel
from agora.auth.credentials import PROBE_ROLE, CredentialError, CredentialVerifier
from agora.auth.grpc_policy import FINGERPRINT_METADATA
from agora.auth.join_check import PROBE_LIFETIME_S, check_join
from agora.auth.keys import openssh_public_key, private_key_pem
from agora.auth.node_state import CREDENTIAL_FILE
from agora.auth.policy import sign_proof
from agora.dht.security import CredentialTokenAuthorizer, DHTSecurity
from agora.node.doctor_links import probe_member, probe_members
from agora.node.rpc.server import run
from agora.node.rpc.tls import worker_server_name
from agora.node.worker.link_probe import MAX_PROBE_BYTES
from agora.node.worker.worker import StageWorker
from agora.protos import authorizer_adapter as adapter
from agora.protos.authorizer_adapter import StageMember
from agora.protos.link_probe_adapter import LinkProbe, LinkProbeStub
import authorizer_world as world
from authorizer_world import fingerprint_from_config, free_port, serving, serving_worker

pytestmark = pytest.mark.timeout(120)

authority, keys, nodes = world.authority, world.keys, world.nodes  # fixtures

METADATA = ((FINGERPRINT_METADATA, world.FINGERPRINT.text()),)
# Methods a probe credential tries besides its own: the pipeline, reads, inference, deliveries.
OTHER_METHODS = ("Forward", "Backward", "Step", "Abort", "Info", "Prefill", "DeliverReceipt", "DeliverAttestation")


def member_of(worker: StageWorker) -> StageMember:
    return StageMember(worker.address, 0.0, worker.credentials.peer_id)


def channel_to(worker: StageWorker, authority, key, chain: bytes) -> grpc.aio.Channel:
    """Mutual TLS to ``worker`` presenting ``chain`` with ``key``."""
    credentials = grpc.ssl_channel_credentials(authority.root_pem, private_key_pem(key), chain)
    target = worker_server_name(worker.stage_index, worker.credentials.peer_id)
    return grpc.aio.secure_channel(worker.address, credentials, options=[("grpc.ssl_target_name_override", target)])


async def status_of(call) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


async def probe_status(channel: grpc.aio.Channel, *steps: LinkProbe) -> tuple[grpc.StatusCode, str]:
    """A link probe of ``steps`` to its end: the status it ends with."""
    call = LinkProbeStub(channel).open(metadata=METADATA)

    async def answers() -> None:
        for step in steps:
            await call.write(step)
        await call.done_writing()
        while await call.read() is not None:
            pass
    return await status_of(answers())


async def renew_with(address: str, dry_run) -> tuple[grpc.StatusCode, str]:
    """A Renew of the dry run's probe credential, signed by its key over a renewal challenge: its status."""
    async with authorizer_channel(address, dry_run.root_pem) as opened:
        stub = adapter.AuthorizerStub(opened)
        challenge = await stub.get_challenge(adapter.ChallengeRequest(role="worker", renewal=True))
        request = adapter.RenewRequest(nonce=challenge.nonce, credential_pem=dry_run.check.probe_credential_pem)
        request = dataclasses.replace(request, signature=sign_proof(dry_run.key, adapter.signed_payload(request)))
        return await status_of(stub.renew(request))


async def read_all(call) -> None:
    async for _ in call:
        pass


async def open_probe(channel: grpc.aio.Channel):
    """A link probe left open after one round trip: it holds its slot."""
    call = LinkProbeStub(channel).open(metadata=METADATA)
    await call.write(LinkProbe("ping", number=1))
    assert (await call.read()).step == "ping"
    return call


def test_the_dry_run_issues_a_probe_credential_and_the_doctor_gets_a_members_rates(authority, tmp_path):
    """The dry run for a stage with a member carries a two-minute probe credential for the dry run's
    key and that stage, and admits nobody; with it the doctor's probe of the real member measures its
    round trip and its rates each way. A stage without members gets none."""
    directory = authority.mint(tmp_path / "worker", role="worker", stage=0).directory

    async def main():
        async with serving_worker(directory) as worker:
            member = member_of(worker)
            async with serving(authority, stage_members=lambda stage: [member] if stage == 0 else []) as (service,
                                                                                                         address):
                dry_runs = [await check_join(address, authority.root_fingerprint, fingerprint=fingerprint_from_config,
                                             hardware=hardware_report(), announce=("127.0.0.1", free_port()),
                                             stage=stage) for stage in (0, 1)]
                held = (dict(service._slots.admitted), service.admitted())
                renewal = await renew_with(address, dry_runs[0])
            result = dry_runs[0]
            links = await probe_members([member], stage=0, credential_pem=result.check.probe_credential_pem,
                                        key_pem=private_key_pem(result.key), root_pem=result.root_pem,
                                        fingerprint=METADATA[0][1], probe_bytes=1 << 20)
            return dry_runs, held, renewal, links

    (probed, empty), held, renewal, (link,) = run(main())
    assert held == ({}, [])  # no slot, nobody admitted
    assert renewal[0] == grpc.StatusCode.UNAUTHENTICATED and "a probe credential may not do this" in renewal[1]
    check = probed.check
    identity = CredentialVerifier(authority.root_pem, "test-run", clock=time.time).verify(
        check.probe_credential_pem, roles=[PROBE_ROLE], stage=0, public_key=probed.key.public_key())
    assert identity.not_after - time.time() <= PROBE_LIFETIME_S
    assert check.probe_lifetime_s == pytest.approx(PROBE_LIFETIME_S, abs=5)
    assert empty.check.members == () and empty.check.probe_credential_pem == b""
    assert link.error == "", link.error
    assert link.rtt_ms > 0 and link.upload_mbit > 0 and link.download_mbit > 0


def test_a_probe_credential_gets_a_bounded_link_probe_and_nothing_else(authority, keys, tmp_path):
    """Every other method refuses a probe credential (PERMISSION_DENIED naming its role), health
    checks included; one probe per caller at once and two in all (RESOURCE_EXHAUSTED); a download
    over the bound, and a caller past its rate, RESOURCE_EXHAUSTED; a probe credential of another
    stage PERMISSION_DENIED; a message that does not parse, or sets no step, INVALID_ARGUMENT. A trainer is served throughout, and a probe within the bounds after."""
    worker_dir = authority.mint(tmp_path / "worker", role="worker", stage=0).directory
    trainer = authority.mint(tmp_path / "trainer", role="trainer")
    probes = [authority.issue(key.public_key(), role="probe", stage=stage, lifetime_s=120)
              for key, stage in zip(keys, (0, 0, 1, 0))]

    async def main():
        outcomes = {}
        async with serving_worker(worker_dir) as worker, \
                channel_to(worker, authority, keys[0], probes[0]) as first, \
                channel_to(worker, authority, keys[1], probes[1]) as second, \
                channel_to(worker, authority, keys[2], probes[2]) as elsewhere, \
                channel_to(worker, authority, keys[3], probes[3]) as garbling, \
                channel_to(worker, authority, trainer.key, trainer.current()[0]) as trainer_channel:
            for method in OTHER_METHODS:
                call = first.unary_unary(f"/agora.v1.Stage/{method}", request_serializer=bytes,
                                         response_deserializer=bytes)
                outcomes[method] = await status_of(call(b"", metadata=METADATA))
            health = health_pb2_grpc.HealthStub(first)
            outcomes["health"] = await status_of(health.Check(health_pb2.HealthCheckRequest()))
            held = [await open_probe(first)]
            outcomes["same caller at once"] = await probe_status(first, LinkProbe("ping"))
            held.append(await open_probe(second))
            outcomes["a third at once"] = await probe_status(elsewhere, LinkProbe("ping"))
            for call in held:
                await call.done_writing()
                assert await call.read() is None
            outcomes["over-size"] = await probe_status(first, LinkProbe("download", number=MAX_PROBE_BYTES + 1))
            outcomes["over the rate"] = await probe_status(first, LinkProbe("ping"))
            outcomes["another stage"] = await probe_status(elsewhere, LinkProbe("ping"))
            for case, garbage in (("garbled", b"\x0a\xff"), ("no step", b"")):
                raw = garbling.stream_stream("/agora.v1.Stage/ProbeLink", request_serializer=bytes,
                                             response_deserializer=bytes)(iter([garbage]), metadata=METADATA)
                outcomes[case] = await status_of(read_all(raw))
            outcomes["trainer info"] = await status_of(trainer_channel.unary_unary(
                "/agora.v1.Stage/Info", request_serializer=bytes, response_deserializer=bytes)(b"", metadata=METADATA))
            link = await probe_member(member_of(worker), stage=0, fingerprint=METADATA[0][1], probe_bytes=1 << 16,
                                      credentials=grpc.ssl_channel_credentials(
                                          authority.root_pem, private_key_pem(keys[1]), probes[1]))
            return outcomes, link, worker.refusals.snapshot()

    outcomes, link, refusals = run(main())
    for method in (*OTHER_METHODS, "health"):
        code, details = outcomes[method]
        assert code == grpc.StatusCode.PERMISSION_DENIED and "holds a probe credential" in details, (method, details)
    for case, needle in (("same caller at once", "at most 1 per caller"), ("a third at once", "at most 2 link probes"),
                         ("over-size", f"the {MAX_PROBE_BYTES} bytes a link probe may carry"),
                         ("over the rate", "retry in")):
        code, details = outcomes[case]
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and needle in details, (case, details)
    code, details = outcomes["another stage"]
    assert code == grpc.StatusCode.PERMISSION_DENIED and "of stage 1 may not probe a worker of stage 0" in details
    for case, needle in (("garbled", "not a valid agora.v1.LinkProbe"), ("no step", "sets no step")):
        code, details = outcomes[case]
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, (case, details)
    assert outcomes["trainer info"][0] == grpc.StatusCode.OK
    assert link.error == "" and link.download_mbit > 0, link
    assert refusals["wrong_role"] == len(OTHER_METHODS) + 1
    assert refusals["link_probe_caller_limit"] == refusals["link_probe_full"] == refusals["link_probe_rate"] == 1


def test_the_dht_refuses_a_probe_credential(authority, keys, tmp_path):
    """The DHT's door (hivemind's token authorizer, ours) answers no request carrying a probe
    credential, and no node can start a DHT peer with one as its credential."""
    worker_dir = authority.mint(tmp_path / "worker", role="worker", stage=0).directory
    door = CredentialTokenAuthorizer(worker_dir, authority.root_pem, "test-run")
    chain = authority.issue(keys[0].public_key(), role="probe", stage=0, lifetime_s=120)
    token = AccessToken(username=chain.decode(), public_key=openssh_public_key(keys[0]))
    assert not door.is_token_valid(token)
    with pytest.raises(CredentialError, match="a probe credential may not do this"):
        door.identity_of(token)
    prober = authority.mint(tmp_path / "prober", role="trainer")
    (prober.directory / CREDENTIAL_FILE).write_bytes(authority.issue(prober.key.public_key(), role="probe", stage=0))
    with pytest.raises(CredentialError, match="a probe credential may not do this"):
        DHTSecurity.from_state_dir(prober.directory)
