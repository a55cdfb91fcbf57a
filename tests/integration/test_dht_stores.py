"""Stores (dht/stores.py) on a real swarm of six hivemind DHT peers on loopback: an entry lands on the
peers hivemind's own store picks, and the store's search is not sent the key's dictionary."""

import time
import uuid

import pytest
from hivemind.dht.routing import DHTID

from dht_swarm import Remembered, held_by, swarm, worker_entry  # swarm: the module's six peers (a fixture)

from agora.dht import SwarmDHT, worker_key
from agora.dht.holders import SEARCH_EVERY

pytestmark = pytest.mark.timeout(120)

async def node_id(_dht, node) -> int:
    return int(node.node_id)


async def replicas(_dht, node) -> int:
    return node.num_replicas


class CountFinds:
    """From now on, count the find requests this peer sends and the values they are answered with (the
    real requests still go out). Runs in that peer's DHT process; ``read_count`` and ``finds_sent``
    read the counts."""

    async def __call__(self, _dht, node) -> None:
        protocol = node.protocol
        if hasattr(protocol, "found_values"):
            return
        protocol.found_values = protocol.finds_sent = 0
        call_find = protocol.call_find

        async def counting(peer, keys):
            protocol.finds_sent += 1
            answer = await call_find(peer, keys)
            protocol.found_values += sum(value is not None for value, _ in (answer or {}).values())
            return answer

        protocol.call_find = counting


async def read_count(_dht, node) -> int:
    return node.protocol.found_values


def test_an_entry_lands_on_the_keys_nearest_peers(swarm):
    key = worker_key(f"stores-{uuid.uuid4().hex[:8]}", 0)
    writer = swarm[1]
    assert writer.store(key, worker_entry("x", writer.peer_id), ttl=60.0, subkey=writer.peer_id)
    key_id = DHTID.generate(source=key)
    ids = {peer.peer_id: peer.hivemind_dht.run_coroutine(node_id) for peer in swarm}
    nearest = sorted(ids, key=lambda peer_id: ids[peer_id] ^ key_id)[:writer.hivemind_dht.run_coroutine(replicas)]
    holders = {peer.peer_id for peer in swarm if held_by(peer, key)}
    assert holders == set(nearest)


def test_a_store_is_not_sent_the_dictionary_it_adds_to_and_readers_see_every_entry(swarm):
    run_id = f"stores-{uuid.uuid4().hex[:8]}"
    key = worker_key(run_id, 0)
    for peer in swarm[2:]:
        assert peer.announce_worker(worker_entry(run_id, peer.peer_id), ttl=60.0)
    writer = swarm[1]
    writer.hivemind_dht.run_coroutine(CountFinds())
    before = writer.hivemind_dht.run_coroutine(read_count)
    assert writer.announce_worker(worker_entry(run_id, writer.peer_id), ttl=60.0)
    assert writer.hivemind_dht.run_coroutine(read_count) == before
    # hivemind's own store of the same key, for contrast: its search is answered with the dictionary.
    assert writer.hivemind_dht.store(key, worker_entry(run_id, "other").to_wire(), time.time() + 60.0, subkey="other")
    assert writer.hivemind_dht.run_coroutine(read_count) > before
    seen = {worker.peer_id for worker in swarm[0].live_workers(run_id, 0)}
    assert seen == {peer.peer_id for peer in swarm[1:]} | {"other"}


def test_a_withdrawn_entry_is_hidden_from_every_holder(swarm):
    run_id = f"stores-{uuid.uuid4().hex[:8]}"
    leaver = swarm[3]
    assert leaver.announce_worker(worker_entry(run_id, leaver.peer_id), ttl=60.0)
    assert leaver.withdraw(run_id, 0, leaver.peer_id)
    for reader in (swarm[0], swarm[5]):
        for _ in range(2):  # a full read, then a quick one
            assert reader.live_workers(run_id, 0) == []


async def finds_sent(_dht, node) -> int:
    return node.protocol.finds_sent


def test_stores_of_a_key_reuse_the_holders_their_search_found_and_search_again_beside_a_later_one(swarm):
    run_id = f"stores-{uuid.uuid4().hex[:8]}"
    key = worker_key(run_id, 0)
    writer = swarm[4]
    writer.hivemind_dht.run_coroutine(CountFinds())
    sent = [writer.hivemind_dht.run_coroutine(finds_sent)]
    for beat in range(SEARCH_EVERY):
        assert writer.store(key, worker_entry(run_id, writer.peer_id), ttl=60.0, subkey=writer.peer_id)
        sent.append(writer.hivemind_dht.run_coroutine(finds_sent))
    searched = [after > before for before, after in zip(sent, sent[1:])]
    assert searched == [True] + [False] * (SEARCH_EVERY - 1)  # the first store searched, the next did not
    assert writer.store(key, worker_entry(run_id, writer.peer_id), ttl=60.0, subkey=writer.peer_id)
    deadline = time.monotonic() + 30.0
    while writer.hivemind_dht.run_coroutine(finds_sent) == sent[-1]:  # the search beside that store
        assert time.monotonic() < deadline, "no search beside the store due for one"
        time.sleep(0.05)
    assert {worker.peer_id for worker in swarm[0].live_workers(run_id, 0)} == {writer.peer_id}


def test_a_store_that_returns_at_the_first_holder_still_reaches_every_holder(swarm):
    run_id = f"stores-{uuid.uuid4().hex[:8]}"
    key = worker_key(run_id, 0)
    writer = swarm[2]
    assert writer.store(key, worker_entry(run_id, writer.peer_id), ttl=60.0, subkey=writer.peer_id,
                        await_all=False)
    key_id = DHTID.generate(source=key)
    ids = {peer.peer_id: peer.hivemind_dht.run_coroutine(node_id) for peer in swarm}
    nearest = sorted(ids, key=lambda peer_id: ids[peer_id] ^ key_id)[:writer.hivemind_dht.run_coroutine(replicas)]
    deadline = time.monotonic() + 30.0
    while {peer.peer_id for peer in swarm if held_by(peer, key)} != set(nearest):  # the rest land in the background
        assert time.monotonic() < deadline, "the background stores did not land"
        time.sleep(0.05)


def test_a_peer_that_joins_nearest_the_key_is_found_by_the_search_beside_a_later_store(swarm):
    run_id = f"stores-{uuid.uuid4().hex[:8]}"
    key = worker_key(run_id, 0)
    key_id = DHTID.generate(source=key)
    writer = swarm[3]
    entry = worker_entry(run_id, writer.peer_id)
    assert writer.store(key, entry, ttl=60.0, subkey=writer.peer_id)  # searched: the holders remembered
    # A peer joins at the key's own id, nearer than any holder the writer remembers.
    with SwarmDHT.start(initial_peers=swarm[0].visible_maddrs(), node_id=key_id) as nearest:
        for _ in range(SEARCH_EVERY - 1):
            assert writer.store(key, entry, ttl=60.0, subkey=writer.peer_id)
        assert int(key_id) not in writer.hivemind_dht.run_coroutine(Remembered(key))
        assert writer.store(key, entry, ttl=60.0, subkey=writer.peer_id)  # due: a search beside it
        deadline = time.monotonic() + 30.0
        while int(key_id) not in writer.hivemind_dht.run_coroutine(Remembered(key)):
            assert time.monotonic() < deadline, "the search beside the store did not find the new nearest peer"
            time.sleep(0.05)
        assert held_by(nearest, key)
