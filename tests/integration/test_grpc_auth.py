"""The gRPC data path under admission: mutual TLS, the per-call check, the run fingerprint, and
microbatches bound to their trainer. Real StageWorkers on 127.0.0.1:0, real credentials from a
RunAuthority (module-scoped: RSA keys are the slow part), one event loop per test.

Every attack asserts the exact rejection and that nothing was served: the stash, the
accumulated gradients and the step are unchanged, and (for handshake failures) no call reached
the server at all.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from dataclasses import replace

import grpc
import pytest
import torch
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agora.auth.credentials import issue_credential, server_name
from agora.auth.grpc_policy import FINGERPRINT_METADATA, NODE_POLICY, rule_for
from agora.auth.node_state import NodeCredentials
from agora.node.rpc.auth_check import Caller
from agora.node.rpc.server import announced_host, is_wildcard_host, run
from agora.node.rpc.tls import InsecureChannels, TlsChannels
from agora.node.trainer.stage_client import RequestRefused, StageClient, WorkerUnreachable
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS, ConfigError, checked
from agora.pipeline.fingerprint import run_fingerprint
from agora.protos.stage_adapter import StageStub
from run_pki import HOUR, CallerLog, OffsetClock, Pki, RawTls, build_pki, raw, self_signed

pytestmark = pytest.mark.timeout(120)

RUN = "auth-run"
CONFIG = PRESETS["tiny"].with_stages(3)
K = CONFIG.model.wire_dim
FINGERPRINT = run_fingerprint(CONFIG)


# ------------------------------------------------------------------------- PKI (tests/helpers/run_pki.py)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return build_pki(tmp_path_factory.mktemp("pki"), RUN)


# ---------------------------------------------------------------------------------------------- helpers


def batch(seed: int, size: int = 2, seq: int = 16):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.model.vocab_size, (size, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


async def start_worker(pki: Pki | None, stage: int, *, clock=time.time, synchronous: bool = False,
                       log: CallerLog | None = None) -> StageWorker:
    credentials = None if pki is None else NodeCredentials(pki.workers[stage], clock=clock)
    worker = StageWorker(CONFIG, stage, run_id=RUN, credentials=credentials,
                         options=WorkerOptions(synchronous=synchronous), interceptors=[log] if log else [])
    await worker.start()
    return worker


def client(worker: StageWorker, channels=None, *, peer_id: str | None = None, stage: int | None = None,
           fingerprint=FINGERPRINT) -> StageClient:
    if peer_id is None and worker.credentials is not None:
        peer_id = worker.credentials.peer_id
    return StageClient(worker.address, run_id=RUN, stage=worker.stage_index if stage is None else stage,
                       model=CONFIG.model, fingerprint=fingerprint, peer_id=peer_id, channels=channels,
                       timeout_s=10)


def trainer_channels(directory) -> TlsChannels:
    return TlsChannels(NodeCredentials(directory, clock=time.time))


async def state(worker: StageWorker) -> tuple:
    """What a served call would change: stash, accumulated microbatches and gradients, step."""
    def read(compute):
        grads = tuple(None if p.grad is None else p.grad.clone() for p in compute.optimizer.parameters)
        return len(compute.stash), compute.accumulated_microbatches, grads, compute.optimizer.steps
    return await worker.on_compute(read)


def same_state(a: tuple, b: tuple) -> bool:
    def same(x, y) -> bool:
        return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
    return a[:2] == b[:2] and a[3] == b[3] and all(same(x, y) for x, y in zip(a[2], b[2]))


async def refused(call, code: grpc.StatusCode, *needles: str, error=RequestRefused):
    with pytest.raises(error) as caught:
        await call
    assert caught.value.code == code, (caught.value.code, caught.value.details)
    for needle in needles:
        assert needle in caught.value.details, (needle, caught.value.details)
    return caught.value


# ---------------------------------------------------------------------------------------------- pure


def test_the_policy_lets_only_trainers_drive_the_pipeline_and_refuses_unknown_methods():
    for method in ("Forward", "ForwardStream", "Backward", "BackwardStream", "Abort", "Step"):
        rule = rule_for(f"/agora.v1.Stage/{method}")
        assert rule.roles == {"trainer"} and rule.fingerprint, method
    info = rule_for("/agora.v1.Stage/Info")
    assert info.roles == {"worker", "trainer", "monitor", "operator", "client"} and info.fingerprint
    for method in ("Prefill", "Decode", "CloseSession"):
        rule = rule_for(f"/agora.v1.Stage/{method}")
        assert rule.roles == {"client", "trainer", "operator"} and rule.fingerprint, method
    receipts = rule_for("/agora.v1.Stage/DeliverReceipt")  # the roles that sign receipts, not a worker for itself
    assert receipts.roles == {"trainer", "operator"} and receipts.fingerprint
    attestations = rule_for("/agora.v1.Stage/DeliverAttestation")  # a round's members: workers (of its stage)
    assert attestations.roles == {"worker"} and attestations.fingerprint
    link_probe = rule_for("/agora.v1.Stage/ProbeLink")  # a would-be member's probe credential, and an operator
    assert link_probe.roles == {"probe", "operator"} and link_probe.fingerprint
    other_rules = [rule for methods in NODE_POLICY.values() for name, rule in methods.items() if name != "ProbeLink"]
    assert all("probe" not in rule.roles for rule in other_rules)  # health and reflection included
    for probe in ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
                  "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"):
        assert rule_for(probe).roles == info.roles and not rule_for(probe).fingerprint
    for unknown in ("/agora.v1.Stage/Export", "/agora.v1.Other/Info", "Forward", "/agora.v1.Stage/", ""):
        assert rule_for(unknown) is None, unknown
    assert set(NODE_POLICY) >= {"agora.v1.Stage", "grpc.health.v1.Health"}


def test_a_wildcard_bind_announces_a_concrete_address_and_never_the_wildcard():
    routes = {socket.AF_INET: "10.1.2.3", socket.AF_INET6: "2001:db8::7"}
    outbound = routes.get
    assert announced_host("127.0.0.1", outbound=outbound) == "127.0.0.1"
    assert announced_host("0.0.0.0", outbound=outbound) == "10.1.2.3"
    assert announced_host("::", outbound=outbound) == "2001:db8::7"
    assert announced_host("[::]", outbound={socket.AF_INET: "10.1.2.3"}.get) == "10.1.2.3"
    assert announced_host("0.0.0.0", outbound=lambda family: None) == "127.0.0.1"  # no route out
    assert announced_host("0.0.0.0", "node.example.org", outbound=outbound) == "node.example.org"
    assert announced_host("127.0.0.1", "203.0.113.9", outbound=outbound) == "203.0.113.9"
    for wildcard in ("0.0.0.0", "::", "[::]", ""):
        assert is_wildcard_host(wildcard)
        with pytest.raises(ValueError, match="every interface"):
            announced_host("127.0.0.1", wildcard, outbound=outbound)
    with pytest.raises(ConfigError, match="announce_host"):
        checked(WorkerOptions, "worker", announce_host="0.0.0.0")
    assert not is_wildcard_host(announced_host("0.0.0.0"))  # this machine, for real


def test_an_insecure_caller_is_anonymous_by_host():
    assert Caller.anonymous_from_peer("ipv4:10.0.0.5:53122").owner == "anonymous@10.0.0.5"
    assert Caller.anonymous_from_peer("ipv6:[::1]:53122").owner == "anonymous@[::1]"
    assert Caller.anonymous_from_peer("unix:/tmp/s").owner == "anonymous@unix:/tmp/s"
    assert Caller.anonymous_from_peer("ipv4:10.0.0.5:1").anonymous


def test_a_worker_serves_only_under_a_worker_credential_of_its_run_and_stage(pki):
    with pytest.raises(ConfigError, match="it is for stage 1, this worker serves stage 0"):
        StageWorker(CONFIG, 0, run_id=RUN, credentials=NodeCredentials(pki.workers[1], clock=time.time))
    with pytest.raises(ConfigError, match="needs a worker credential, this one is a trainer"):
        StageWorker(CONFIG, 0, run_id=RUN, credentials=NodeCredentials(pki.trainer, clock=time.time))
    with pytest.raises(ConfigError, match="this worker serves run 'other'"):
        StageWorker(CONFIG, 0, run_id="other", credentials=NodeCredentials(pki.workers[0], clock=time.time))


# ---------------------------------------------------------------------------------------------- numerics


def test_a_trainer_over_tls_computes_exactly_what_an_insecure_channel_computes(pki):
    """Forward, Backward and Step through three stages, twice, over TLS and in plaintext: the
    losses, the gradients on the wire, the step replies and the final weights are bit-identical."""
    batches = [[batch(10 * step + m) for m in range(2)] for step in range(2)]

    async def train(secure: bool):
        workers = [await start_worker(pki if secure else None, i, synchronous=True) for i in range(3)]
        channels = trainer_channels(pki.trainer) if secure else None
        clients = [client(w, channels) for w in workers]
        trace = []
        try:
            for step, microbatches in enumerate(batches):
                for m, (tokens, targets) in enumerate(microbatches):
                    mb = f"s{step}m{m}"
                    head = await clients[0].forward(mb, tokens)
                    body = await clients[1].forward(mb, tokens, head.wire_frame)
                    tail = await clients[2].forward(mb, tokens, body.wire_frame, targets)
                    body_back = await clients[1].backward(mb, tail.grad_frame)
                    await clients[0].backward(mb, body_back.grad_frame)
                    trace.append((tail.loss, head.wire_frame, tail.grad_frame, body_back.grad_frame))
                trace.extend([(r.step, r.grad_norm, r.lr) for r in [await c.step(2, step=step) for c in clients]])
            weights = [await w.on_compute(lambda c: [p.detach().clone() for p in c.optimizer.parameters])
                       for w in workers]
            return trace, weights, [w.refusals.total() for w in workers]
        finally:
            await asyncio.gather(*(c.close() for c in clients))
            await asyncio.gather(*(w.stop(0) for w in workers))

    async def main():
        return await train(True), await train(False)

    (tls_trace, tls_weights, tls_refusals), (plain_trace, plain_weights, _) = run(main())
    assert tls_trace == plain_trace
    for ours, theirs in zip(tls_weights, plain_weights):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert tls_refusals == [0, 0, 0]


# ---------------------------------------------------------------------------------------------- handshake


def test_callers_without_a_valid_credential_fail_the_handshake_and_nothing_is_served(pki):
    tokens, _ = batch(1)
    socket_closed = "Socket closed"  # what a client sees when the server refuses its certificate
    cases = {
        "plaintext to a TLS port": (InsecureChannels(), socket_closed),
        "TLS without a client certificate": (RawTls(pki.root_pem, None, None), socket_closed),
        "a self-signed certificate": (self_signed(pki.trainer_b, RUN), socket_closed),
        "a credential of another PKI": (raw(pki.other_pki, root=pki.root_pem), socket_closed),
        "an expired credential": (raw(pki.expired), socket_closed),
        "a credential not valid yet": (raw(pki.future), socket_closed),
        # The victim's chain with the attacker's key: TLS cannot even start (key and certificate differ).
        "a credential without its private key": (raw(pki.trainer, key_from=pki.trainer_b),
                                                 "Failed to create security handshaker"),
    }

    async def main():
        log = CallerLog()
        worker = await start_worker(pki, 0, log=log)
        try:
            before = await state(worker)
            for case, (channels, needle) in cases.items():
                attacker = client(worker, channels)
                try:
                    with pytest.raises(WorkerUnreachable) as caught:
                        await attacker.forward(f"attack {case}", tokens)
                    assert caught.value.code == grpc.StatusCode.UNAVAILABLE, case
                    assert needle in caught.value.details, (case, caught.value.details)
                finally:
                    await attacker.close()
            assert log.calls == [] and worker.refusals.total() == 0  # no call reached the server
            assert same_state(before, await state(worker)) and before[:2] == (0, 0)
            genuine = client(worker, trainer_channels(pki.trainer))  # and the worker still serves
            assert (await genuine.forward("genuine", tokens)).wire.shape == (2, 16, K)
            await genuine.close()
        finally:
            await worker.stop(0)

    run(main())


def test_a_client_refuses_a_worker_whose_credential_is_not_for_the_peer_and_stage_it_dialled(pki):
    """A forged DHT record (someone else's address under this peer id, or another stage) cannot
    make a trainer talk to the wrong worker: the handshake checks the name the record implies."""
    tokens, _ = batch(2)

    async def main():
        log = CallerLog()
        worker = await start_worker(pki, 0, log=log)
        channels = trainer_channels(pki.trainer)
        other_peer = NodeCredentials(pki.workers[1], clock=time.time).peer_id
        try:
            for peer_id, stage in ((other_peer, 0), (worker.credentials.peer_id, 1)):
                misled = client(worker, channels, peer_id=peer_id, stage=stage)
                await refused(misled.forward("m", tokens), grpc.StatusCode.UNAVAILABLE,
                              "Hostname Verification Check failed", error=WorkerUnreachable)
                await misled.close()
            assert log.calls == []
            honest = client(worker, channels)
            assert (await honest.forward("m", tokens)).wire.shape == (2, 16, K)
            await honest.close()
        finally:
            await worker.stop(0)

    run(main())


# ---------------------------------------------------------------------------------------------- per call


def test_the_per_call_check_refuses_a_credential_that_expired_on_an_open_connection(pki):
    tokens, _ = batch(3)
    grad = torch.ones(2, 16, K)
    clock = OffsetClock()

    async def main():
        worker = await start_worker(pki, 0, clock=clock)
        trainer = client(worker, trainer_channels(pki.trainer))
        try:
            await trainer.forward("m", tokens)
            before = await state(worker)
            clock.offset = 2 * HOUR  # the trainer's 1-hour credential is past its expiry now
            await refused(trainer.forward("m2", tokens), grpc.StatusCode.UNAUTHENTICATED,
                          "/agora.v1.Stage/Forward", "expired")
            await refused(trainer.backward("m", grad), grpc.StatusCode.UNAUTHENTICATED, "expired")
            clock.offset = -HOUR  # and before its start
            await refused(trainer.info(), grpc.StatusCode.UNAUTHENTICATED, "valid only from")
            assert same_state(before, await state(worker))
            assert trainer.channels_opened == 1  # all on the one connection the handshake accepted
            clock.offset = 0.0
            await trainer.backward("m", grad)  # nothing was lost meanwhile
            assert worker.refusals.snapshot() == {"expired": 2, "not_yet_valid": 1}
        finally:
            await trainer.close()
            await worker.stop(0)

    run(main())


def test_a_credential_of_another_run_from_the_same_ca_is_refused_per_call(pki):
    """The handshake only checks the chain; the run id in the credential is checked per call."""
    node = NodeCredentials(pki.trainer, clock=time.time)
    chain = issue_credential(pki.authority.issuing(), node.key.public_key(), run_id="other-run", role="trainer",
                             stage=None, now=time.time(), lifetime_s=HOUR)
    tokens, _ = batch(4)

    async def main():
        worker = await start_worker(pki, 0)
        stranger = client(worker, RawTls(pki.root_pem, node.key_pem(), chain))
        try:
            await refused(stranger.forward("m", tokens), grpc.StatusCode.UNAUTHENTICATED,
                          "credential is for run 'other-run'", f"this is run '{RUN}'")
            assert (await state(worker))[:2] == (0, 0) and worker.refusals.snapshot() == {"wrong_run": 1}
        finally:
            await stranger.close()
            await worker.stop(0)

    run(main())


def test_only_a_trainer_may_drive_the_pipeline_and_every_role_may_read_info(pki):
    tokens, _ = batch(5)

    async def main():
        worker = await start_worker(pki, 0)
        trainer = client(worker, trainer_channels(pki.trainer))
        monitor = client(worker, trainer_channels(pki.monitor))
        peer = client(worker, trainer_channels(pki.workers[1]))  # another worker's credential
        try:
            await trainer.forward("owned", tokens)
            before = await state(worker)
            for caller, role in ((monitor, "monitor"), (peer, "worker")):
                calls = {
                    "Forward": caller.forward("m", tokens),
                    "Backward": caller.backward("owned", torch.ones(2, 16, K)),
                    "Abort": caller.abort("owned"),
                    "Step": caller.batch_done(2**62, 4, 1),  # the schedule-wrecking report of issue 10
                }
                for method, call in calls.items():
                    await refused(call, grpc.StatusCode.PERMISSION_DENIED,
                                  f"/agora.v1.Stage/{method} needs a trainer credential",
                                  f"the caller holds a {role} credential")
                info = await caller.info()
                assert info.stage == 0 and info.stashed == 1
            assert same_state(before, await state(worker))
            assert worker.refusals.snapshot() == {"wrong_role": 8}
        finally:
            for c in (trainer, monitor, peer):
                await c.close()
            await worker.stop(0)

    run(main())


def test_a_microbatch_belongs_to_the_trainer_that_ran_its_forward(pki):
    tokens, targets = batch(6)
    wire = torch.randn(2, 16, K) * 0.1
    grad = torch.ones(2, 16, K)

    async def main():
        head, tail = await start_worker(pki, 0), await start_worker(pki, 2)
        a, b = trainer_channels(pki.trainer), trainer_channels(pki.trainer_b)
        head_a, head_b, tail_a, tail_b = client(head, a), client(head, b), client(tail, a), client(tail, b)
        try:
            await head_a.forward("mb", tokens)
            stashed = await state(head)
            denied = "microbatch 'mb' belongs to another trainer"
            await refused(head_b.backward("mb", grad), grpc.StatusCode.PERMISSION_DENIED, denied)
            await refused(head_b.abort("mb"), grpc.StatusCode.PERMISSION_DENIED, denied)
            for who in (head_b, head_a):  # a Forward never replaces pending work, whoever sends it
                await refused(who.forward("mb", tokens), grpc.StatusCode.ALREADY_EXISTS, "already pending")
            assert same_state(stashed, await state(head)) and stashed[:2] == (1, 0)
            await head_a.backward("mb", grad)  # the owner's backward still works
            assert (await state(head))[:2] == (0, 1)

            await tail_a.forward("t", tokens, wire, targets)  # the tail accumulates inside Forward
            accumulated = await state(tail)
            await refused(tail_b.abort("t"), grpc.StatusCode.PERMISSION_DENIED,
                          "microbatch 't' belongs to another trainer")
            await refused(tail_b.forward("t", tokens, wire, targets), grpc.StatusCode.ALREADY_EXISTS)
            assert same_state(accumulated, await state(tail)) and accumulated[1] == 1
            assert (await tail_a.abort("t")).outcome == "reverted"
            assert head.refusals.snapshot() == {"not_owner": 2, "duplicate_microbatch": 2}
            assert tail.refusals.snapshot() == {"not_owner": 1, "duplicate_microbatch": 1}
        finally:
            for c in (head_a, head_b, tail_a, tail_b):
                await c.close()
            await asyncio.gather(head.stop(0), tail.stop(0))

    run(main())


@pytest.mark.parametrize("secure", [True, False], ids=["tls", "insecure"])
def test_a_request_of_another_run_configuration_is_refused_naming_the_field(pki, secure):
    tokens, _ = batch(7)
    other_seed = run_fingerprint(replace(CONFIG, seed=CONFIG.seed + 1,
                                         model=replace(CONFIG.model, basis_seed=CONFIG.seed + 1)))
    other_schedule = run_fingerprint(replace(CONFIG, optim=replace(CONFIG.optim, total_steps=7)))

    async def main():
        log = CallerLog()
        worker = await start_worker(pki if secure else None, 0, log=log)
        channels = trainer_channels(pki.trainer) if secure else None
        clients = []
        try:
            for fingerprint, field in ((other_seed, "seed"), (other_schedule, "config")):
                stranger = client(worker, channels, fingerprint=fingerprint)
                clients.append(stranger)
                await refused(stranger.forward("m", tokens), grpc.StatusCode.FAILED_PRECONDITION,
                              f"run fingerprint mismatch in {field}")
                await refused(stranger.info(), grpc.StatusCode.FAILED_PRECONDITION, field)
            if secure:
                target = server_name("worker", 0, worker.credentials.peer_id)
                channel = channels.open(worker.address, target_name=target)
            else:
                channel = grpc.aio.insecure_channel(worker.address)
            async with channel:
                stub = StageStub(channel)
                for metadata, code, needle in (((), grpc.StatusCode.FAILED_PRECONDITION, "no run fingerprint"),
                                               (((FINGERPRINT_METADATA, "seed=zero"),),
                                                grpc.StatusCode.INVALID_ARGUMENT, "malformed")):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await stub.info(metadata=metadata)
                    assert caught.value.code() == code and needle in caught.value.details()
                # Health checks carry no fingerprint and need none.
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert (await state(worker))[:2] == (0, 0)
            assert worker.refusals.snapshot() == {"fingerprint_mismatch": 4, "no_fingerprint": 1, "bad_fingerprint": 1}
            honest = client(worker, channels)
            clients.append(honest)
            await honest.forward("m", tokens)
            method, caller = log.calls[-1]
            assert method == "Forward"
            if secure:
                trainer_peer = NodeCredentials(pki.trainer, clock=time.time).peer_id
                assert caller.role == "trainer" and caller.owner == trainer_peer
            else:
                assert caller.anonymous and caller.owner == "anonymous@127.0.0.1"
        finally:
            for c in clients:
                await c.close()
            await worker.stop(0)

    run(main())


# ---------------------------------------------------------------------------------------------- rotation


async def served_certificate(address: str, trainer_dir, target: str) -> x509.Certificate:
    """The certificate a new connection to the worker is served (Python's own TLS client)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=(trainer_dir / "root.pem").read_text())
    context.load_cert_chain(trainer_dir / "credential.pem", trainer_dir / "node.key")
    context.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), ssl=context, server_hostname=target)
    try:
        return x509.load_der_x509_certificate(writer.get_extra_info("ssl_object").getpeercert(binary_form=True))
    finally:
        writer.close()


def test_renewed_credentials_are_used_on_new_connections_without_a_failed_call(pki):
    """Worker and trainer renew mid-stream (a new credential.pem in their directories, as the
    renewal loop writes it): every call succeeds, the trainer moves to a new channel, both sides
    present their new certificates on it, and a call in flight on a retired channel completes."""
    worker_dir, trainer_dir = pki.workers[0], pki.trainer

    def serial(directory) -> int:
        return x509.load_pem_x509_certificate((directory / "credential.pem").read_bytes()).serial_number

    async def main():
        log = CallerLog()
        worker = await start_worker(pki, 0, log=log)
        trainer = client(worker, trainer_channels(trainer_dir))
        target = server_name("worker", 0, worker.credentials.peer_id)
        old_worker, old_trainer = serial(worker_dir), serial(trainer_dir)
        assert (await served_certificate(worker.address, trainer_dir, target)).serial_number == old_worker
        renewal = None
        try:
            for i in range(40):
                tokens, _ = batch(100 + i)
                pending = [asyncio.ensure_future(trainer.forward(f"m{i}.{j}", tokens)) for j in range(2)]
                if i == 10:  # renew both while those calls are in flight
                    renewal = asyncio.ensure_future(asyncio.to_thread(lambda: (
                        pki.authority.mint(worker_dir, role="worker", stage=0),
                        pki.authority.mint(trainer_dir, role="trainer"))))
                await asyncio.gather(*pending)
                for j in range(2):
                    await trainer.backward(f"m{i}.{j}", torch.ones(2, 16, K))
                if renewal is not None and renewal.done() and trainer.channels_opened > 1 and i > 25:
                    break
            await renewal
            new_worker, new_trainer = serial(worker_dir), serial(trainer_dir)
            assert new_worker != old_worker and new_trainer != old_trainer
            assert trainer.channels_opened == 2
            serials = [caller.identity.serial for _, caller in log.calls]
            assert serials[0] == old_trainer and serials[-1] == new_trainer
            assert set(serials) == {old_trainer, new_trainer}
            assert (await served_certificate(worker.address, trainer_dir, target)).serial_number == new_worker

            # A call still running on the old channel when the next renewal retires it finishes.
            release = threading.Event()
            blocker = asyncio.ensure_future(worker.on_compute(lambda _: release.wait(30)))
            log.arrived.clear()
            held = asyncio.ensure_future(trainer.forward("held", batch(200)[0]))
            await asyncio.wait_for(log.arrived.wait(), 20)  # the worker has it: it is on the old channel
            await asyncio.to_thread(pki.authority.mint, trainer_dir, role="trainer")
            await trainer.info()  # a new call: a third channel; the second retires with "held" in flight
            assert trainer.channels_opened == 3 and held.done() is False
            release.set()
            await blocker
            assert (await held).wire.shape == (2, 16, K)
            await trainer.backward("held", torch.ones(2, 16, K))  # the same peer id owns it after renewal
            assert log.calls[-1][1].identity.serial == serial(trainer_dir)
            assert worker.refusals.total() == 0 and (await state(worker))[0] == 0
        finally:
            await trainer.close()
            await worker.stop(0)

    run(main())


def test_a_streamed_call_refused_at_the_door_gets_its_status_not_internal(pki):
    """grpc.aio clients that are still writing when the server aborts see INTERNAL (grpc/grpc#36066):
    the check reads a refused stream to its end first, so the trainer gets the readable reason."""
    from agora.protos import stage_pb2

    stranger = run_fingerprint(replace(CONFIG, seed=CONFIG.seed + 1, model=replace(CONFIG.model, basis_seed=CONFIG.seed + 1)))
    part = stage_pb2.BackwardRequest(run_id=RUN, microbatch_id="m", stage=0, output_grad=b"\0" * 30_000)

    async def main():
        worker = await start_worker(pki, 0)
        channels = trainer_channels(pki.trainer)
        try:
            before = await state(worker)
            async with channels.open(worker.address, target_name=server_name("worker", 0, worker.credentials.peer_id)) as channel:
                call = channel.stream_stream("/agora.v1.Stage/BackwardStream", request_serializer=lambda m: m,
                                             response_deserializer=lambda b: b)
                for _ in range(20):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call(iter([part.SerializeToString()] * 10),
                                   metadata=((FINGERPRINT_METADATA, stranger.text()),), timeout=20).read()
                    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, caught.value.details()
                    assert "run fingerprint mismatch in seed" in caught.value.details()
            assert same_state(before, await state(worker))
        finally:
            await worker.stop()

    run(main())
