"""Weight sync's state transfer over real gRPC on 127.0.0.1:0: a donor StageWorker that trains while
a joiner downloads, through a TCP relay that holds or cuts the real connection mid-transfer.

What is pinned: the joiner's state equals the donor's snapshot exactly (every parameter, every Adam
moment, the step and sample counts, the averaging state), while the donor's own state has moved on;
a dropped transfer resumes from the bytes held on the same snapshot; a full donor answers
RESOURCE_EXHAUSTED and the joiner takes the next; who may download (a worker of the stage, an
operator) under mutual TLS; and the byte stream's own checks (pipeline/state_wire.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import time

import grpc
import pytest
import torch

from agora.auth.authority import RunAuthority
from agora.auth.grpc_policy import FINGERPRINT_METADATA
from agora.node.rpc.server import run
from agora.node.rpc.tls import InsecureChannels, TlsChannels, worker_server_name
from agora.node.trainer.stage_client import StageClient
from agora.node.membership.state_download import Donor, DonorPlan, StateDownloader
from agora.node.membership.state_transfer import apply_state, download_refusal, expected_state_bytes
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.node.rpc.auth_check import Caller
from agora.pipeline.config import PRESETS
from agora.pipeline.fingerprint import run_fingerprint
from agora.pipeline.state_wire import StateReceiver, StateStream, StateWireError
from agora.protos.state_adapter import StateRequest, StateStub
from tail_training import tail_batch, train_tail
from tcp_relay import TcpRelay

pytestmark = pytest.mark.timeout(120)

CONFIG = PRESETS["tiny"].with_stages(2)
RUN = "state-run"
FINGERPRINT = run_fingerprint(CONFIG)
TAIL = 1
CHUNK = 64 * 2**10


async def _train(client: StageClient, first_batch: int, batches: int) -> None:
    """`batches` global batches of one microbatch each through a tail worker, each reported done."""
    await train_tail(client, CONFIG.model, first_batch, batches, first_report=first_batch)


def _state_of(compute) -> dict:
    optimizer = compute.optimizer.state_dict()
    return {"model": {k: v.clone() for k, v in compute.stage.state_dict().items()},
            "moments": {i: {k: v.clone() for k, v in entry.items()} for i, entry in optimizer["optimizer"]["state"].items()},
            "steps": compute.optimizer.steps, "samples": compute.samples_total}


def _assert_state_equals(state: dict, tree: dict) -> None:
    assert state["model"].keys() == tree["model"].keys()
    for name, tensor in tree["model"].items():
        assert torch.equal(state["model"][name], tensor), name
    moments = tree["optimizer"]["optimizer"]["state"]
    assert state["moments"].keys() == moments.keys() and moments
    for index, entry in moments.items():
        for key, value in entry.items():
            assert torch.equal(state["moments"][index][key], value), (index, key)
    assert state["steps"] == tree["step"] == tree["optimizer"]["steps"]
    assert state["samples"] == tree["optimizer"]["samples_total"]


class NarrowWindowChannels(InsecureChannels):
    """Plaintext channels whose HTTP/2 window does not grow (no BDP probing)."""

    def open(self, address, *, target_name=None, options=()):
        return super().open(address, target_name=target_name, options=[*options, ("grpc.http2.bdp_probe", 0)])


def _downloader(channels=None, **kwargs) -> StateDownloader:
    """The transfer alone: what the state holds is checked in test_state_poisoning.py."""
    kwargs.setdefault("max_bytes", 64 * 2**20)
    return StateDownloader(run_id=RUN, stage=TAIL, fingerprint=FINGERPRINT, channels=channels or InsecureChannels(),
                           checks=None, show_progress=False, **kwargs)


def _worker(**options) -> StageWorker:
    return StageWorker(CONFIG, TAIL, run_id=RUN, options=WorkerOptions(stream_chunk_bytes=CHUNK, **options))


@contextlib.asynccontextmanager
async def _donor_and_joiner(**relay):
    """A donor, a joiner, a trainer's client of the donor, and a relay in front of the donor."""
    donor, joiner = _worker(), _worker()
    await donor.start()
    await joiner.start()
    client = StageClient(donor.address, run_id=RUN, stage=TAIL, model=CONFIG.model, fingerprint=FINGERPRINT)
    relay = TcpRelay(donor.address, **relay)
    try:
        yield donor, joiner, client, relay
    finally:
        await relay.close()
        await client.close()
        await donor.stop()
        await joiner.stop()


def test_a_joiner_gets_the_donors_snapshot_exactly_while_the_donor_keeps_training():
    async def main():
        async with _donor_and_joiner(hold_after=4 * CHUNK) as (donor, joiner, client, relay):
            joiner.start_in_phase("weight_sync")  # a joiner behind its stage
            await _train(client, 0, 3)
            donor.state_donor.averaging = _FixedAveragingState({"method": "sparta", "last_round": 7})
            address = await relay.start()
            download = asyncio.create_task(_downloader().download(DonorPlan((Donor("donor", address, 3),))))
            await asyncio.wait_for(relay.held.wait(), 30)  # mid-transfer: the donor trains on meanwhile
            await _train(client, 3, 4)
            relay.release()
            result = await download
            (snapshot,) = donor.state_donor.snapshots
            assert snapshot["step"] == 3 and result.step == 3 and result.resumes == 0
            assert result.tree["averaging"] == {"method": "sparta", "last_round": 7}
            donor_now = await donor.on_compute(_state_of)
            assert donor_now["steps"] == 7  # trained through the transfer, its state moved on
            assert any(not torch.equal(donor_now["model"][k], v) for k, v in snapshot["model"].items())
            step = await joiner.on_compute(lambda c: apply_state(c, result.tree))
            assert step == 3
            _assert_state_equals(await joiner.on_compute(_state_of), snapshot)
            # The joiner refuses training calls while in weight sync (trainers never route there).
            joiner_client = StageClient(joiner.address, run_id=RUN, stage=TAIL, model=CONFIG.model,
                                        fingerprint=FINGERPRINT)
            tokens, wire, targets = tail_batch(CONFIG.model, 99)
            with pytest.raises(Exception, match="weight sync"):
                await joiner_client.forward("x", tokens, wire, targets)
            await joiner_client.close()

    run(main())


class _FixedAveragingState:
    def __init__(self, state):
        self.state = state

    def state_dict(self, samples_total: int) -> dict:
        return dict(self.state)


def test_a_dropped_transfer_resumes_on_the_same_snapshot_from_the_bytes_held():
    async def main():
        # The first connection is held after 10 chunks and cut once the joiner has taken 2 (a cut by
        # bytes relayed alone could land before the joiner read any: it then, rightly, starts over).
        async with _donor_and_joiner(hold_after=10 * CHUNK) as (donor, joiner, client, relay):
            await _train(client, 0, 2)
            address = await relay.start()
            taken = asyncio.Event()
            # (A window that cannot grow keeps what the donor hands its transport near what the relay let
            # through, so the bytes sent in all measure the resume.)
            downloader = _downloader(NarrowWindowChannels(),
                                     on_progress=lambda held, total: held >= 2 * CHUNK and taken.set())
            download = asyncio.create_task(downloader.download(DonorPlan((Donor("donor", address, 2),))))
            await asyncio.wait_for(taken.wait(), 60)
            relay.cut()
            relay.release()  # the resumed connection passes whole
            result = await download
            assert relay.dropped.is_set() and relay.connections == 2
            # One resume reached the donor; a call made while the channel still reconnects may fail
            # fast (UNAVAILABLE) before it and count a resume of its own.
            assert 1 <= result.resumes <= 3
            stats = donor.state_donor.stats
            assert stats.snapshots == 1 and stats.downloads == 2 and stats.completed == 1 and stats.resumed == 1
            assert stats.offsets[0] == 0 and 0 < stats.offsets[1] < result.total_bytes
            # What was sent in all is about one stream: the resume did not start over.
            assert stats.bytes_sent < result.total_bytes + 12 * CHUNK
            await joiner.on_compute(lambda c: apply_state(c, result.tree))
            _assert_state_equals(await joiner.on_compute(_state_of), donor.state_donor.snapshots[0])

    run(main())


def test_a_full_donor_answers_resource_exhausted_and_the_joiner_takes_the_next():
    async def main():
        busy, spare = _worker(max_state_downloads=1), _worker()
        await busy.start()
        await spare.start()
        relay = TcpRelay(busy.address, hold_after=2 * CHUNK)
        try:
            address = await relay.start()
            # The holding joiner's flow-control window must stay small: with BDP probing it can grow past
            # the whole state on loopback, the donor then hands every byte to the transport, ends its
            # call and frees the slot while the relay still holds the bytes.
            holding = asyncio.create_task(
                _downloader(NarrowWindowChannels()).download(DonorPlan((Donor("busy", address, 0),))))
            await asyncio.wait_for(relay.held.wait(), 30)  # the busy donor's one slot is taken
            result = await _downloader().download(DonorPlan((Donor("busy", busy.address, 0),
                                                             Donor("spare", spare.address, 0))))
            assert result.donor.peer_id == "spare"
            assert busy.state_donor.stats.refused_busy == 1 and any("RESOURCE_EXHAUSTED" in a for a in result.attempts)
            relay.release()
            assert (await holding).donor.peer_id == "busy"
        finally:
            await relay.close()
            await busy.stop()
            await spare.stop()

    run(main())


def test_a_donor_that_left_is_given_up_for_the_members_the_dht_has_now():
    """The plan's only donor is gone (its port refuses): after a round of it, `replan` names the
    stage's members now, and the state comes from one of them long before the deadline."""
    async def main():
        live = _worker()
        await live.start()
        with socket.socket() as probe:  # a port nothing listens on: a member that left
            probe.bind(("127.0.0.1", 0))
            gone = f"127.0.0.1:{probe.getsockname()[1]}"
        replans = []

        async def replan() -> DonorPlan:
            replans.append(1)
            return DonorPlan((Donor("live", live.address, 0),))
        try:
            downloader = _downloader(timeout_s=60.0)
            started = time.monotonic()
            result = await downloader.download(DonorPlan((Donor("gone", gone, 0),)), replan=replan)
            assert result.donor.peer_id == "live" and len(replans) == 1 and time.monotonic() - started < 30
            assert any(attempt.startswith(gone) for attempt in result.attempts)
        finally:
            await live.stop()

    run(main())


def test_only_a_worker_of_the_stage_or_an_operator_may_download_it_under_mutual_tls(tmp_path):
    authority = RunAuthority(tmp_path / "ca", run_id=RUN)
    donor_dir = authority.mint(tmp_path / "donor", role="worker", stage=TAIL)
    callers = {name: authority.mint(tmp_path / name, role=role, stage=stage)
               for name, role, stage in (("same", "worker", TAIL), ("other", "worker", 0),
                                         ("operator", "operator", None), ("trainer", "trainer", None))}

    async def attempt(donor: StageWorker, node) -> str:
        channels = TlsChannels(node)
        channel = channels.open(donor.address, target_name=worker_server_name(TAIL, donor.credentials.identity().peer_id))
        call = StateStub(channel).download(StateRequest(run_id=RUN, stage=TAIL),
                                           metadata=((FINGERPRINT_METADATA, FINGERPRINT.text()),), timeout=20)
        try:
            while await call.next() is not None:
                pass
            return "OK"
        except grpc.aio.AioRpcError as error:
            return error.code().name
        finally:
            await channel.close()

    async def main():
        donor = StageWorker(CONFIG, TAIL, run_id=RUN, credentials=donor_dir,
                            options=WorkerOptions(stream_chunk_bytes=CHUNK))
        await donor.start()
        try:
            outcomes = {name: await attempt(donor, node) for name, node in callers.items()}
        finally:
            await donor.stop()
        assert outcomes == {"same": "OK", "other": "PERMISSION_DENIED", "operator": "OK",
                            "trainer": "PERMISSION_DENIED"}

    run(main())


def test_a_replica_that_is_not_a_member_gives_no_state():
    async def main():
        syncing = _worker()
        await syncing.start()
        syncing.start_in_phase("weight_sync")
        syncing.phase = "optimizer_sync"  # its weights are the stage's, its moments are not yet
        try:
            with pytest.raises(Exception) as raised:
                await _downloader(timeout_s=0.5).download(DonorPlan((Donor("syncing", syncing.address, 0),)))
            assert "FAILED_PRECONDITION" in str(raised.value) and "not a member" in str(raised.value)
        finally:
            await syncing.stop()

    run(main())


# ---------------------------------------------------------------------------------------------- pure


def _tree():
    return {"stage": 1, "step": 4, "model": {"w": torch.randn(3, 5), "empty": torch.zeros(0)},
            "optimizer": {"optimizer": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.randn(3, 5)}},
                                        "param_groups": [{"betas": (0.9, 0.95), "lr": 3e-4, "params": [0]}]},
                          "steps": 4, "samples_total": 32},
            "averaging": None, "flags": torch.tensor([True, False]), "half": torch.randn(4).to(torch.bfloat16),
            "edge": [math.inf, -0.0, 1e-310]}


def _receive(stream: StateStream, pieces: int = 7, max_bytes: int = 10**7):
    receiver = StateReceiver(stream.total_bytes, max_bytes=max_bytes)
    offset = 0
    while offset < stream.total_bytes:
        data = stream.read(offset, pieces)
        receiver.add(data)
        offset += len(data)
    return receiver


def test_the_byte_stream_round_trips_a_state_exactly_in_any_chunking():
    tree = _tree()
    stream = StateStream(tree)
    receiver = _receive(stream)
    assert receiver.sha256() == stream.sha256()
    out = receiver.result()
    assert out["optimizer"]["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)  # a tuple stays a tuple
    assert list(out["optimizer"]["optimizer"]["state"]) == [0]  # an int key stays an int
    assert out["edge"][0] == math.inf and math.copysign(1, out["edge"][1]) == -1 and out["edge"][2] == 1e-310
    for path in (("model", "w"), ("flags",), ("half",)):
        a, b = tree, out
        for key in path:
            a, b = a[key], b[key]
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_receiver_refuses_what_does_not_add_up_before_allocating():
    stream = StateStream(_tree())
    with pytest.raises(StateWireError, match="at most"):
        StateReceiver(stream.total_bytes, max_bytes=stream.total_bytes - 1)  # larger than this stage's state
    head = stream.read(0, stream.total_bytes)
    manifest_end = 8 + int.from_bytes(head[:8], "big")
    text = head[8:manifest_end].replace(b'"shape":[3,5]', b'"shape":[9,5]', 1)
    forged = len(text).to_bytes(8, "big") + text + head[manifest_end:]
    receiver = StateReceiver(len(forged), max_bytes=10**7)
    with pytest.raises(StateWireError, match="add up"):
        receiver.add(forged)
    pickled = (b"\x80\x04" * 8)
    with pytest.raises(StateWireError):
        StateReceiver(len(pickled) + 100, max_bytes=10**7).add(pickled + b"\0" * 100)


def test_apply_state_refuses_another_stage_shape_or_optimizer_setting_and_changes_nothing():
    from agora.node.replica.compute import StageCompute
    from agora.node.replica.stash import ForwardStash
    from agora.pipeline.codec import WireCodec

    compute = StageCompute(CONFIG, TAIL, run_id=RUN, codec=WireCodec("fp32"), stash=ForwardStash(4, 60.0),
                           synchronous=False)
    before = _state_of(compute)
    other = StageCompute(CONFIG, 0, run_id=RUN, codec=WireCodec("fp32"), stash=ForwardStash(4, 60.0),
                         synchronous=False)
    from agora.node.membership.state_transfer import snapshot_stage, state_tree

    with pytest.raises(StateWireError, match="not stage 1"):
        apply_state(compute, state_tree(snapshot_stage(other), 0))
    good = state_tree(snapshot_stage(compute), 0)
    name = next(iter(good["model"]))
    bad = dict(good, model=dict(good["model"], **{name: torch.zeros(1)}))
    with pytest.raises(StateWireError, match="parameters are not"):
        apply_state(compute, bad)
    # Torch takes an optimizer's settings from the state it loads: a donor may not choose them.
    inner = good["optimizer"]["optimizer"]
    maximizing = [dict(group, maximize=True) for group in inner["param_groups"]]
    maximize = dict(good, optimizer=dict(good["optimizer"], optimizer=dict(inner, param_groups=maximizing)))
    with pytest.raises(StateWireError, match="maximize"):
        apply_state(compute, maximize)
    after = _state_of(compute)
    assert all(torch.equal(before["model"][k], after["model"][k]) for k in before["model"])
    assert expected_state_bytes(compute) > StateStream(good).total_bytes


def test_who_may_download():
    from agora.auth.credentials import Identity

    def caller(role, stage):
        identity = Identity(run_id=RUN, role=role, stage=stage, peer_id="p", serial=1, not_before=0, not_after=time.time())
        return Caller.of_identity(identity)

    assert download_refusal(caller("worker", 1), 1) is None
    assert download_refusal(caller("operator", None), 1) is None
    assert download_refusal(Caller.anonymous_from_peer("ipv4:127.0.0.1:5"), 1) is None  # --insecure
    assert "stage 0" in download_refusal(caller("worker", 0), 1)
    assert download_refusal(caller("trainer", None), 1) is not None
