"""Quick reads (dht/reads.py) on a real swarm of six hivemind DHT peers on loopback: what a reader
sees of a stage's entries when a holder missed a store, an entry changed, or was withdrawn."""

import time
import uuid

import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils.serializer import MSGPackSerializer

from dht_swarm import held_by, swarm, worker_entry  # swarm: the module's six peers (a fixture)

from agora.dht import SwarmDHT, worker_key

pytestmark = pytest.mark.timeout(120)

class Place:
    """Put an entry into one peer's own storage and nowhere else: a store that reached that holder only
    (the others missed it). Runs in that peer's DHT process."""

    def __init__(self, key: str, subkey: str, wire: dict, expiration: float) -> None:
        self.key, self.subkey, self.wire, self.expiration = key, subkey, wire, expiration

    async def __call__(self, _dht, node) -> bool:
        return node.protocol.storage.store(DHTID.generate(source=self.key), MSGPackSerializer.dumps(self.wire),
                                           self.expiration, subkey=self.subkey)


def seen(reader: SwarmDHT, run_id: str) -> set[str]:
    return {worker.peer_id for worker in reader.live_workers(run_id, 0)}


def test_an_entry_only_one_holder_got_is_missed_by_one_read_at_most_and_then_stays_visible(swarm):
    run_id = f"reads-{uuid.uuid4().hex[:8]}"
    key = worker_key(run_id, 0)
    reader, writers = swarm[1], swarm[2:4]
    for writer in writers:
        assert writer.announce_worker(worker_entry(run_id, writer.peer_id), ttl=60.0)
    assert seen(reader, run_id) == {w.peer_id for w in writers}  # the first read: full
    # The newcomer's store reached one holder other than the reader; every other holder missed it.
    lone = next(peer for peer in swarm if peer is not reader and held_by(peer, key))
    newcomer = worker_entry(run_id, "newcomer")
    assert lone.hivemind_dht.run_coroutine(Place(key, "newcomer", newcomer.to_wire(), time.time() + 60.0))
    answers = [seen(reader, run_id) for _ in range(6)]  # quick, full, quick, full, ...
    missed = [i for i, answer in enumerate(answers) if "newcomer" not in answer]
    assert missed in ([], [0]), answers
    assert all(answer >= {w.peer_id for w in writers} for answer in answers)


def test_a_quick_read_returns_an_entry_rewritten_since_and_hides_one_withdrawn_since(swarm):
    run_id = f"reads-{uuid.uuid4().hex[:8]}"
    reader, writer, leaver = swarm[0], swarm[4], swarm[5]
    for peer in (writer, leaver):
        assert peer.announce_worker(worker_entry(run_id, peer.peer_id), ttl=60.0)
    assert seen(reader, run_id) == {writer.peer_id, leaver.peer_id}  # full
    assert writer.announce_worker(worker_entry(run_id, writer.peer_id, step=11), ttl=60.0)
    assert [w.step for w in reader.live_workers(run_id, 0) if w.peer_id == writer.peer_id] == [11]  # quick
    assert seen(reader, run_id) == {writer.peer_id, leaver.peer_id}  # full
    assert leaver.withdraw(run_id, 0, leaver.peer_id)
    assert seen(reader, run_id) == {writer.peer_id}  # quick


def test_reads_are_all_full_where_hivemind_caches_found_values_itself(swarm):
    """A cached copy, as new as anything seen, would answer a quick read locally every time."""
    cached = SwarmDHT.start(initial_peers=swarm[0].visible_maddrs(), cache_locally=True)
    try:
        run_id = f"reads-{uuid.uuid4().hex[:8]}"
        assert swarm[2].announce_worker(worker_entry(run_id, swarm[2].peer_id), ttl=60.0)
        for _ in range(3):
            assert seen(cached, run_id) == {swarm[2].peer_id}
        assert cached._memory.next_bar(worker_key(run_id, 0)) is None
    finally:
        cached.shutdown()
