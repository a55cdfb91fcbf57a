"""A ban reaches the whole swarm: real hivemind DHT peers under one RunAuthority, the authorizer's
publisher (its client-mode operator peer), and each consumer of the list on its real path: the DHT's
token check and record validator, readers, trainers' and clients' discovery, unit commits,
averaging, a worker's gRPC server.

The module shares one swarm: a bootstrap (operator), honest workers A and B of stage 0, a worker W
and a trainer T that tests ban, and the authorizer's peer. Every test that bans lifts its bans
again (a newer list), so tests do not see each other's.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import threading
import time

import grpc
import pytest
import torch
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from agora.auth.authority import RunAuthority
from agora.auth.keys import hivemind_private_key, openssh_public_key
from agora.auth.node_state import NodeCredentials
from agora.dht.averaging import SliceAverager, round_group_bits
from agora.dht.averaging_admission import AveragingAdmission
from agora.dht.bans import BAN_REFRESH_S, sign_ban_list
from agora.dht.heartbeat import Heartbeat
from agora.dht.leases import LeaseBoard
from agora.dht.keys import averaging_prefix, owned_subkey, worker_key
from agora.dht.records import WorkerRecord
from agora.dht.security import DHTSecurity, OwnedRecordValidator, OwnerSignatureValidator
from agora.dht.storage_bounds import STORE_CONTEXT, StoreContext
from agora.dht.swarm import SwarmDHT
from agora.node.ban_publisher import BanPublisher
from agora.node.inference.discovery import DHTReplicas
from agora.node.rpc.server import run
from agora.node.rpc.tls import TlsChannels
from agora.node.trainer.discovery import DHTDiscovery
from agora.node.trainer.stage_client import RequestRefused, StageClient
from agora.node.worker.worker import StageWorker
from agora.pipeline.config import PRESETS
from agora.pipeline.fingerprint import run_fingerprint
from polling import eventually

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

RUN = "ban-run"
CONFIG = PRESETS["tiny"].with_stages(2)
FINGERPRINT = run_fingerprint(CONFIG)


class Swarm:
    """The module's peers and the authorizer's side of the ban list."""

    def __init__(self, base):
        self.authority = RunAuthority(base / "ca", run_id=RUN)
        self.dirs = {name: self.authority.mint(base / name, role=role, stage=stage).directory
                     for name, role, stage in (("boot", "operator", None), ("a", "worker", 0), ("b", "worker", 0),
                                               ("w", "worker", 0), ("t", "trainer", None),
                                               ("authorizer", "operator", None))}
        self.peers: dict[str, SwarmDHT] = {}
        self.publisher = None

    def start(self) -> None:
        boot = self.peers["boot"] = SwarmDHT.start(security=DHTSecurity.from_state_dir(self.dirs["boot"]))
        for name in ("a", "b", "w", "t", "authorizer"):
            self.peers[name] = SwarmDHT.start(initial_peers=boot.visible_maddrs(), client_mode=name == "authorizer",
                                              security=DHTSecurity.from_state_dir(self.dirs[name]))
        self.publisher = BanPublisher(self.authority, self.peers["authorizer"])

    def shutdown(self) -> None:
        for peer in self.peers.values():
            peer.shutdown()

    def honest(self) -> list[SwarmDHT]:
        return [self.peers[name] for name in ("boot", "a", "b")]

    def publish(self, *banned: str) -> float:
        """`agora-node authorizer ban`/`unban` to exactly `banned`, then the publisher's next check
        and every honest peer's next heartbeat read; the seconds that took."""
        started = time.monotonic()
        for peer_id in set(self.authority.bans()) - set(banned):
            self.authority.unban(peer_id)
        for peer_id in banned:
            self.authority.ban(peer_id, "test")
        self.publisher.publish_if_due()
        for peer in self.honest():
            assert peer.refresh_bans(max_age_s=0).banned == frozenset(banned)
        return time.monotonic() - started


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    built = Swarm(tmp_path_factory.mktemp("bans"))
    try:
        built.start()
        yield built
    finally:
        built.shutdown()


@pytest.fixture
def lift(swarm):
    yield
    swarm.publish()


def worker_record(peer: SwarmDHT, **overrides) -> WorkerRecord:
    fields = dict(peer_id=peer.peer_id, run_id=RUN, endpoint="127.0.0.1:50051", stage=0, n_stages=2,
                  throughput=10.0, queue_depth=0, step=1, phase="member", version="0.1.0",
                  updated_at=peer.clock(), fingerprint=FINGERPRINT.text())
    return WorkerRecord(**{**fields, **overrides})


async def _store_at(_dht, node, *, peer_id: str, key: str, value, subkey=None):
    """Run in a DHT process: one raw store RPC at ``peer_id`` (None: no answer)."""
    stored = await node.protocol.call_store(PeerID.from_base58(peer_id), [DHTID.generate(source=key)],
                                            [MSGPackSerializer.dumps(value)], get_dht_time() + 30,
                                            subkeys=None if subkey is None else [subkey])
    return None if stored is None else list(stored)


def store_at(sender: SwarmDHT, target: SwarmDHT, key: str, value, subkey=None):
    probe = functools.partial(_store_at, peer_id=target.peer_id, key=key, value=value, subkey=subkey)
    return sender.hivemind_dht.run_coroutine(probe, return_future=True).result(20)


# ---- the DHT, its readers and discovery ------------------------------------------------------------


def test_a_banned_workers_new_record_is_refused_by_every_peer_and_its_old_one_dropped_by_readers(swarm, lift):
    a, w = swarm.peers["a"], swarm.peers["w"]
    assert w.announce_worker(worker_record(w), ttl=120)
    for reader in swarm.honest():
        eventually(lambda: w.peer_id in {r.peer_id for r in reader.live_workers(RUN, 0)}, timeout=10,
                   what="W's record")
    delay = swarm.publish(w.peer_id)
    print(f"ban to refusal on every honest peer: {delay:.2f} s")
    for reader in swarm.honest():  # its entry has two minutes to live; nobody believes it now
        assert w.peer_id not in {r.peer_id for r in reader.live_workers(RUN, 0)}
    assert a.rejections()[worker_key(RUN, 0)] >= 1
    trainers_view = run(DHTDiscovery(a, RUN, 2, CONFIG.train.seq_len).workers())
    clients_view = run(DHTReplicas(a, RUN, 2).replicas())
    assert w.peer_id not in {v.peer_id for v in trainers_view} | {v.peer_id for v in clients_view}
    # Every honest peer leaves W's requests unanswered: it can neither store nor read there.
    for target in swarm.honest():
        assert store_at(w, target, f"{averaging_prefix(RUN, 0, 'sparta')}.0b0000", True,
                        subkey=PeerID.from_base58(w.peer_id).to_bytes()) is None
    assert not any(w.peer_id == r.peer_id for r in a.live_workers(RUN, 0))

    swarm.publish()  # unban: a newer list without W
    assert w.announce_worker(worker_record(w, step=2), ttl=60)
    eventually(lambda: any(r.peer_id == w.peer_id and r.step == 2 for r in a.live_workers(RUN, 0)), timeout=10,
               what="W's record after the unban")


def test_a_ban_reaches_a_node_through_the_publishers_loop_and_its_heartbeat(swarm, lift):
    """What `authorizer ban` sets going on a running swarm: the ban file written by another process
    (the CLI), the serving authorizer's publishing loop, a worker's 5 s heartbeat. Prints the delay."""
    a, w = swarm.peers["a"], swarm.peers["w"]

    async def main() -> float:
        publishing = asyncio.create_task(swarm.publisher.run())
        heartbeat = Heartbeat(a, lambda: worker_record(a), interval=5.0)
        await heartbeat.start()
        try:
            banned_at = time.monotonic()
            RunAuthority(swarm.authority.directory).ban(w.peer_id, "from the command line")
            while not a.bans.is_banned(w.peer_id):
                assert time.monotonic() - banned_at < 60, "the ban never reached A"
                await asyncio.sleep(0.02)
            return time.monotonic() - banned_at
        finally:
            publishing.cancel()
            await asyncio.gather(publishing, return_exceptions=True)
            await heartbeat.stop()

    print(f"authorizer ban -> A refuses W: {run(main()):.2f} s")
    assert w.peer_id not in {r.peer_id for r in a.live_workers(RUN, 0)}


def test_a_read_reads_the_ban_list_again_only_once_it_is_older_than_the_peers_ban_refresh(swarm):
    peer = swarm.peers["a"]
    peer.refresh_bans(max_age_s=0)

    def ban_reads() -> int:
        return peer.timings.snapshot()[("call", "bans")].count

    before = ban_reads()
    try:
        peer.ban_refresh_s = 3600.0  # a bench's stretched time: the list read a moment ago is fresh
        peer.live_workers(RUN, 0)
        assert ban_reads() == before
        peer.ban_refresh_s = 0.0
        peer.live_workers(RUN, 0)
        assert ban_reads() == before + 1
    finally:
        peer.ban_refresh_s = BAN_REFRESH_S


def test_the_record_validator_refuses_a_relayed_new_entry_of_a_banned_writer_but_not_a_dictionary(swarm):
    """A peer that stores W's freshly signed record for it (W itself is cut off) is refused; a whole
    dictionary an honest peer hands on, with W's old entry in it, is not (hivemind takes a
    dictionary whole: its other writers' entries would go with W's); a find checks no ban."""
    w_dir = swarm.dirs["w"]
    w_node = NodeCredentials(w_dir, clock=time.time)
    writer = CompositeValidator([OwnerSignatureValidator(hivemind_private_key(w_node.key)),
                                 OwnedRecordValidator(RUN, swarm.authority.root_pem, state_dir=w_dir)])
    honest = OwnedRecordValidator(RUN, swarm.authority.root_pem)
    reader = CompositeValidator([OwnerSignatureValidator(), honest])
    ban_list = sign_ban_list(swarm.authority.issuing(), run_id=RUN, serial=1, banned=[w_node.peer_id], now=time.time())
    honest.ban_book().offer({"1": ban_list.to_wire()})
    subkey = MSGPackSerializer.dumps(owned_subkey(w_node.peer_id, openssh_public_key(w_node.key).decode()))
    record = DHTRecord(DHTID.generate(source=worker_key(RUN, 0)).to_bytes(), subkey,
                       MSGPackSerializer.dumps(worker_record(swarm.peers["w"]).to_wire()), time.time() + 30)
    record = dataclasses.replace(record, value=writer.sign_value(record))

    def stored_by_another(single: bool) -> bool:
        context = StoreContext("QmRelay", frozenset({(record.key, record.subkey)} if single else ()))
        return contextvars.copy_context().run(lambda: (STORE_CONTEXT.set(context), reader.validate(record))[1])

    assert reader.validate(record)  # a find: readers drop it (SwarmDHT), the dictionary stays whole
    assert not stored_by_another(single=True)
    assert stored_by_another(single=False)
    assert honest.refused.snapshot() == {"banned": 1}


def test_a_banned_trainers_unit_commits_no_longer_count(swarm, lift):
    a, t = swarm.peers["a"], swarm.peers["t"]

    async def commit() -> None:
        board = LeaseBoard(t, run_id=RUN, lease_s=30)
        assert await board.claim(5)
        assert (await board.commit(5)).committed

    reader = LeaseBoard(a, run_id=RUN, lease_s=30)
    run(commit())
    state = eventually(lambda: run(reader.read(0)).get(5), timeout=10, what="T's commit")
    assert state.committed and state.holder == t.peer_id
    swarm.publish(t.peer_id)
    assert 5 not in run(reader.read(0))  # its chain still judges as issued; the ban decides
    swarm.publish()
    assert run(reader.read(0))[5].committed


# ---- averaging ----------------------------------------------------------------------------------------

# The group of three never fills (W is refused): A and B wait out the window, then average as two. 3 s
# was too short beside the suite's demos on two cores (A ended its round alone once).
TIMEOUTS = dict(matchmaking_s=6.0, request_s=1.0, sender_s=2.0, reducer_s=4.0, round_s=20.0)
SIZE = 1000


def test_a_banned_replica_is_left_out_of_the_averaging_round(swarm, lift):
    """W holds a valid worker credential of stage 0: only the ban keeps it out."""
    prefix = averaging_prefix(RUN, 0, "sparta")
    averagers = []
    try:
        for name in ("a", "b", "w"):
            security = DHTSecurity.from_state_dir(swarm.dirs[name])
            peer = swarm.peers[name]
            averagers.append(SliceAverager.start(peer.hivemind_dht, prefix=prefix, size=SIZE,
                                                 part_size_bytes=16 * 1024, **TIMEOUTS,
                                                 admission=AveragingAdmission.for_node(security, 0),
                                                 banned=lambda peer=peer: peer.bans.banned))
        swarm.publish(swarm.peers["w"].peer_id)
        a, b, w = averagers
        results = [None] * 3
        values = (torch.ones(SIZE), torch.full((SIZE,), 2.0), torch.full((SIZE,), 1000.0))

        def one(index: int) -> None:
            results[index] = averagers[index].average(values[index], round_number=1, weight=1.0, group_size=3)

        threads = [threading.Thread(target=one, args=(index,)) for index in range(3)]
        for thread in threads[:2]:
            thread.start()
        eventually(lambda: _declared(swarm.peers["a"], prefix, 1) >= 2, timeout=10, what="A and B to declare")
        threads[2].start()
        for thread in threads:
            thread.join(timeout=60)
        honest_a, honest_b, banned = results
        assert honest_a.outcome == honest_b.outcome == "committed", (honest_a.error, honest_b.error)
        assert torch.equal(honest_a.averaged, torch.full((SIZE,), 1.5))  # nothing of W's 1000s
        assert sorted(honest_a.participants) == sorted([a.peer_id, b.peer_id])
        assert banned.outcome != "committed"
    finally:
        for averager in averagers:
            averager.shutdown()


def _declared(reader: SwarmDHT, prefix: str, round_number: int) -> int:
    found = reader.hivemind_dht.get(f"{prefix}.0b{round_group_bits(round_number)}", latest=True)
    if found is None or not isinstance(found.value, dict):
        return 0
    return sum(1 for item in found.value.values() if item.value)


# ---- a worker's gRPC server ----------------------------------------------------------------------------


def test_a_banned_caller_is_refused_by_a_real_worker_grpc_server(swarm, lift):
    a, t = swarm.peers["a"], swarm.peers["t"]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIG.model.vocab_size, (2, 16), generator=generator)

    async def main():
        worker = StageWorker(CONFIG, 0, run_id=RUN, credentials=NodeCredentials(swarm.dirs["a"], clock=time.time),
                             fingerprint=FINGERPRINT, banned=a.bans.is_banned)
        await worker.start()
        channels = TlsChannels(NodeCredentials(swarm.dirs["t"], clock=time.time))
        trainer = StageClient(worker.address, run_id=RUN, stage=0, model=CONFIG.model, fingerprint=FINGERPRINT,
                              peer_id=a.peer_id, channels=channels, timeout_s=10)
        try:
            await trainer.forward("before", tokens)
            await asyncio.to_thread(swarm.publish, t.peer_id)
            for call in (trainer.forward("during", tokens), trainer.info()):
                with pytest.raises(RequestRefused) as caught:
                    await call
                assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED
                assert "banned" in caught.value.details and t.peer_id[:16] in caught.value.details
            assert worker.refusals.snapshot() == {"banned": 2}
            await asyncio.to_thread(swarm.publish)
            await trainer.forward("after", tokens)  # the same connection: lifted as soon as read
        finally:
            await trainer.close()
            await worker.stop(0)

    run(main())
