"""Reads (dht/reads.py, dht/holder_reads.py) on a real swarm of six hivemind DHT peers on loopback: what
a reader sees of a stage's entries when a holder missed a store, an entry changed, or was withdrawn, and
which peers its reads ask."""

import functools
import time
import uuid
from contextlib import contextmanager
from typing import Iterable, Iterator

import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils.serializer import MSGPackSerializer

from dht_swarm import Remembered, held_by, swarm, worker_entry  # swarm: the module's six peers (a fixture)

from agora.dht import SwarmDHT, WorkerRecord, worker_key
from agora.dht.holder_reads import read_entry
from agora.dht.holders import neighbour_id

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


class Watch:
    """From now on, record every find request this peer sends (hivemind's and changed finds alike),
    (peer id, key ids), and every peer it sends a store to, and hold back the answers of finds sent to
    ``slow`` peers for ``delay`` seconds (the request goes out at once). Installed over the protocol's
    own requests, replacing an earlier watch; ``unwatch`` takes it away, ``asked`` and ``stored_to``
    read and clear the records, ``late_answers`` counts answers being held back. Runs in that peer's
    DHT process."""

    def __init__(self, slow: frozenset = frozenset(), delay: float = 0.0) -> None:
        self.slow, self.delay = slow, delay

    async def __call__(self, _dht, node) -> None:
        import asyncio
        protocol = node.protocol
        hivemind_find = type(protocol).call_find.__get__(protocol)
        hivemind_store = type(protocol).call_store.__get__(protocol)
        changed_find = protocol.__dict__.setdefault("unwatched_find_changed", protocol.call_find_changed)
        digests = protocol.__dict__.setdefault("unwatched_digests", protocol.call_find_changed_digests)
        watch = protocol.watch = {"asked": [], "kinds": [], "stored_to": [], "held_back": 0}
        slow, delay = self.slow, self.delay

        async def held_back(peer, answer):
            if str(peer) in slow:
                watch["held_back"] += 1
                await asyncio.sleep(delay)
                watch["held_back"] -= 1
            return answer

        async def watched(peer, keys):
            watch["asked"].append((str(peer), [int(key) for key in keys]))
            watch["kinds"].append(("find", str(peer)))
            return await held_back(peer, await hivemind_find(peer, keys))

        async def watched_changed(peer, key, held):
            watch["asked"].append((str(peer), [int(key)]))
            watch["kinds"].append(("changed", str(peer)))
            return await held_back(peer, await changed_find(peer, key, held))

        async def watched_digests(peer, key, held):
            watch["asked"].append((str(peer), [int(key)]))
            watch["kinds"].append(("digests", str(peer)))
            return await held_back(peer, await digests(peer, key, held))

        async def watched_store(peer, *args, **kwargs):
            watch["stored_to"].append(str(peer))
            return await hivemind_store(peer, *args, **kwargs)

        protocol.call_find, protocol.call_store = watched, watched_store
        protocol.call_find_changed, protocol.call_find_changed_digests = watched_changed, watched_digests


async def unwatch(_dht, node) -> None:
    node.protocol.__dict__.pop("call_find", None)
    node.protocol.__dict__.pop("call_store", None)
    node.protocol.call_find_changed = node.protocol.unwatched_find_changed
    node.protocol.call_find_changed_digests = node.protocol.unwatched_digests


async def asked(_dht, node) -> list:
    sent, node.protocol.watch["asked"] = node.protocol.watch["asked"], []
    return sent


async def kinds(_dht, node) -> list:
    """(kind, peer id) of every find request sent since the last call: "find" (hivemind's),
    "changed" (the entries), "digests"."""
    sent, node.protocol.watch["kinds"] = node.protocol.watch["kinds"], []
    return sent


async def stored_to(_dht, node) -> list:
    sent, node.protocol.watch["stored_to"] = node.protocol.watch["stored_to"], []
    return sent


async def late_answers(_dht, node) -> int:
    return node.protocol.watch["held_back"]


@contextmanager
def watching(peer: SwarmDHT, slow: Iterable[str] = (), delay: float = 0.0) -> Iterator[None]:
    peer.hivemind_dht.run_coroutine(Watch(frozenset(slow), delay))
    try:
        yield
    finally:
        peer.hivemind_dht.run_coroutine(unwatch)


def test_a_full_read_takes_the_entries_from_one_holder_digests_from_the_rest_and_what_only_one_has_from_it(swarm):
    run_id = f"reads-{uuid.uuid4().hex[:8]}"
    key = worker_key(run_id, 0)
    reader, writers = swarm[0], swarm[1:3]
    for writer in writers:
        assert writer.announce_worker(worker_entry(run_id, writer.peer_id), ttl=60.0)
    holders = remembered_after_first_read(reader, run_id)  # read 1: full
    assert seen(reader, run_id) == {w.peer_id for w in writers}  # read 2: quick
    lone = next(peer for peer in swarm if peer.peer_id in holders and peer is not reader)
    assert lone.hivemind_dht.run_coroutine(Place(key, "newcomer", worker_entry(run_id, "newcomer").to_wire(),
                                                 time.time() + 60.0))
    with watching(reader):
        full = seen(reader, run_id)  # read 3: full
        sent = reader.hivemind_dht.run_coroutine(kinds)
    assert full == {w.peer_id for w in writers} | {"newcomer"}
    others = [peer_id for peer_id in holders if peer_id != reader.peer_id]
    digests = [peer for kind, peer in sent if kind == "digests"]
    changed = [peer for kind, peer in sent if kind == "changed"]
    assert sorted(digests + changed[:1]) == sorted(others) and not [kind for kind, _ in sent if kind == "find"]
    # The first holder sent the entries; only if it was not the one holding the newcomer was that one asked too.
    assert changed == [lone.peer_id] if changed[0] == lone.peer_id else changed[1:] == [lone.peer_id]


def test_a_first_read_searches_for_the_holders_and_asks_them_for_changes_not_a_walk_for_whole_dictionaries(swarm):
    run_id = f"reads-{uuid.uuid4().hex[:8]}"
    key_id = int(DHTID.generate(source=worker_key(run_id, 0)))
    for writer in swarm[1:3]:
        assert writer.announce_worker(worker_entry(run_id, writer.peer_id), ttl=60.0)
    reader = swarm[0]  # not a writer: a writer's stores searched for the key's holders already
    with watching(reader):
        assert seen(reader, run_id) == {swarm[1].peer_id, swarm[2].peer_id}  # read 1: no holder known yet
        sent = reader.hivemind_dht.run_coroutine(kinds)
        requests = reader.hivemind_dht.run_coroutine(asked)
    of_the_key = [kind for (kind, _), (_, keys) in zip(sent, requests) if key_id in keys]
    searched = [kind for (kind, _), (_, keys) in zip(sent, requests) if int(neighbour_id(DHTID(key_id))) in keys]
    assert searched and set(searched) == {"find"}  # the search: peers only
    assert of_the_key and "find" not in of_the_key  # the key itself: changed finds and digests


def not_a_holder(swarm: list, key: str) -> SwarmDHT:
    return next(peer for peer in swarm if not held_by(peer, key))


def remembered_after_first_read(reader: SwarmDHT, run_id: str) -> list:
    """The holders the search beside ``reader``'s first read of the stage key found."""
    key = worker_key(run_id, 0)
    reader.live_workers(run_id, 0)
    deadline = time.monotonic() + 30.0
    while not (holders := list(reader.hivemind_dht.run_coroutine(Remembered(key)).values())):
        assert time.monotonic() < deadline, "the first read did not search for the key's holders"
        time.sleep(0.05)
    return holders


def test_reads_go_straight_to_the_holders_a_search_found_a_quick_one_to_one_a_full_one_to_all(swarm):
    run_id = f"reads-{uuid.uuid4().hex[:8]}"
    key_id = int(DHTID.generate(source=worker_key(run_id, 0)))
    for writer in swarm[1:3]:
        assert writer.announce_worker(worker_entry(run_id, writer.peer_id), ttl=60.0)
    reader = not_a_holder(swarm, worker_key(run_id, 0))  # a holder's own copy would answer a quick read
    holders = remembered_after_first_read(reader, run_id)  # read 1: full, after a search for the holders
    others = [peer for peer in holders if peer != reader.peer_id]
    with watching(reader):
        assert seen(reader, run_id) == {swarm[1].peer_id, swarm[2].peer_id}  # read 2: quick
        quick = reader.hivemind_dht.run_coroutine(asked)
        assert seen(reader, run_id) == {swarm[1].peer_id, swarm[2].peer_id}  # read 3: full
        full = reader.hivemind_dht.run_coroutine(asked)
    assert sorted(peer for peer, _ in full) == sorted(others) and all(keys == [key_id] for _, keys in full)
    # One holder at a time, one of the stores' holders first, until one is as new as what the reader saw
    # (the first, unless a store missed it: a peer that left this module's swarm may be among the holders).
    assert quick[0][0] in others[:5] and all(keys == [key_id] for _, keys in quick)
    assert 1 <= len(quick) < len(full) and len({peer for peer, _ in quick}) == len(quick)
    assert int(neighbour_id(DHTID(key_id))) not in {key for _, keys in quick + full for key in keys}  # no search


def test_quick_reads_start_at_a_random_holder_so_readers_spread_over_them(swarm):
    run_id = f"reads-{uuid.uuid4().hex[:8]}"
    key = worker_key(run_id, 0)
    assert swarm[2].announce_worker(worker_entry(run_id, swarm[2].peer_id), ttl=60.0)
    reader = not_a_holder(swarm, key)
    remembered_after_first_read(reader, run_id)
    quick = functools.partial(read_entry, key=key, bar=time.time(), exclude_self=False)  # any value ends it
    first_asked = set()
    with watching(reader):
        for _ in range(8):
            assert set(reader.hivemind_dht.run_coroutine(quick).value) == {swarm[2].peer_id}
            first_asked.add(reader.hivemind_dht.run_coroutine(asked)[0][0])
    assert len(first_asked) >= 2  # the same start for all 8: 5 x (1/5)^8


def test_a_full_read_leaves_the_readers_own_copy_as_it_was(swarm):
    """hivemind's read merges what it finds into its first candidate: for a holder, its own storage."""
    run_id = f"reads-{uuid.uuid4().hex[:8]}"
    key = worker_key(run_id, 0)
    writer = swarm[1]
    assert writer.announce_worker(worker_entry(run_id, writer.peer_id), ttl=60.0)
    holders = [peer for peer in swarm if held_by(peer, key)]
    reader, lone = holders[0], holders[1]
    remembered_after_first_read(reader, run_id)
    assert lone.hivemind_dht.run_coroutine(Place(key, "lone", worker_entry(run_id, "lone").to_wire(),
                                                 time.time() + 60.0))
    assert set(reader.get_entries(key, WorkerRecord, full=True)) == {writer.peer_id, "lone"}
    assert reader.hivemind_dht.run_coroutine(HeldSubkeys(key)) == {writer.peer_id}


class HeldSubkeys:
    """The subkeys this peer's own storage holds under ``key``. Runs in that peer's DHT process."""

    def __init__(self, key: str) -> None:
        self.key = key

    async def __call__(self, _dht, node) -> set:
        held = node.protocol.storage.get(DHTID.generate(source=self.key))
        return set() if held is None else {MSGPackSerializer.loads(subkey) if isinstance(subkey, bytes) else subkey
                                           for subkey, _ in held.value.items()}


def test_a_quick_read_asks_the_next_holder_when_the_one_it_asked_is_slow(swarm):
    run_id = f"reads-{uuid.uuid4().hex[:8]}"
    key = worker_key(run_id, 0)
    writer = swarm[2]
    assert writer.announce_worker(worker_entry(run_id, writer.peer_id), ttl=60.0)
    reader = not_a_holder(swarm, key)
    remembered_after_first_read(reader, run_id)
    fast = next(peer.peer_id for peer in swarm if peer is not reader and held_by(peer, key))
    quick = functools.partial(read_entry, key=key, bar=time.time(), exclude_self=False)  # any value ends it
    sent = []
    with watching(reader, slow={peer.peer_id for peer in swarm} - {fast}, delay=60.0):  # one answers at once
        for _ in range(8):  # each from a random holder: the fast one first in all 8, (1/5)^8
            assert set(reader.hivemind_dht.run_coroutine(quick).value) == {writer.peer_id}
            sent.append(len(reader.hivemind_dht.run_coroutine(asked)))
        assert max(sent) > 1  # some read asked a slow holder first, then the next ones in turn ...
        assert reader.hivemind_dht.run_coroutine(late_answers) == sum(sent) - len(sent)  # ... ending at the fast one


# Peers leave the swarm in the tests below (each started for its test):
# a peer that left stays in the others' routing tables for a while, and a read that asks it waits.


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


def test_a_full_read_does_not_wait_for_a_slow_holder_past_the_grace_unless_it_must_miss_nothing(swarm):
    run_id = f"reads-{uuid.uuid4().hex[:8]}"
    key = worker_key(run_id, 0)
    writer = swarm[1]
    assert writer.announce_worker(worker_entry(run_id, writer.peer_id), ttl=60.0)
    # A reader whose full reads wait for 3 answers (its num_replicas) of the other 6 peers, not all.
    with SwarmDHT.start(initial_peers=swarm[0].visible_maddrs(), num_replicas=3) as reader:
        remembered_after_first_read(reader, run_id)
        slow = next(peer for peer in swarm if peer is not writer and held_by(peer, key))
        assert slow.hivemind_dht.run_coroutine(Place(key, "lone", worker_entry(run_id, "lone").to_wire(),
                                                     time.time() + 60.0))
        full = functools.partial(read_entry, key=key, bar=None, exclude_self=False)
        with watching(reader, slow={slow.peer_id}, delay=5.0):  # well under a request's 10 s
            assert set(reader.hivemind_dht.run_coroutine(full).value) == {writer.peer_id}  # "lone": the slow one's
            assert reader.hivemind_dht.run_coroutine(late_answers) == 1  # returned before that answer came
            assert set(reader.hivemind_dht.run_coroutine(functools.partial(full, wait_all=True)).value) == {
                writer.peer_id, "lone"}


def test_a_holder_that_left_is_skipped_after_its_first_silence_until_a_search_replaces_it(swarm):
    """As hivemind's walk skips a peer that did not answer for a while (its blacklist), so do reads
    and stores at the holders: a dead holder is not asked at every request, nor does each walk."""
    run_id = f"reads-{uuid.uuid4().hex[:8]}"
    key = worker_key(run_id, 0)
    key_id = DHTID.generate(source=key)
    reader, writer = swarm[0], swarm[3]
    with SwarmDHT.start(initial_peers=swarm[0].visible_maddrs(), node_id=key_id) as nearest:
        assert writer.announce_worker(worker_entry(run_id, writer.peer_id), ttl=60.0)
        assert held_by(nearest, key)
        holders = remembered_after_first_read(reader, run_id)
        assert nearest.peer_id == holders[0]
        gone = nearest.peer_id
    full = functools.partial(read_entry, key=key, bar=None, exclude_self=False)
    with watching(reader):
        assert set(reader.hivemind_dht.run_coroutine(full).value) == {writer.peer_id}  # gone: no answer
        assert gone in {peer for peer, _ in reader.hivemind_dht.run_coroutine(asked)}
        for _ in range(2):
            assert set(reader.hivemind_dht.run_coroutine(full).value) == {writer.peer_id}
        assert reader.announce_worker(worker_entry(run_id, reader.peer_id), ttl=60.0)
        assert gone not in {peer for peer, _ in reader.hivemind_dht.run_coroutine(asked)}  # nor the searches
        assert gone not in reader.hivemind_dht.run_coroutine(stored_to)
    deadline = time.monotonic() + 30.0
    while gone in reader.hivemind_dht.run_coroutine(Remembered(key)).values():
        assert time.monotonic() < deadline, "the holder that left is still remembered"
        time.sleep(0.05)
    assert seen(reader, run_id) == {writer.peer_id, reader.peer_id}


class SearchNow:
    """Search for ``key``'s holders now, as a read's search does; what is remembered after. Runs in
    that peer's DHT process."""

    def __init__(self, key: str) -> None:
        self.key = key

    async def __call__(self, _dht, node) -> dict:
        from agora.dht import holders
        await holders.search(node, DHTID.generate(source=self.key), False, reading=True)
        return await Remembered(self.key)(_dht, node)


def test_an_empty_key_read_at_enough_holders_is_believed_and_read_there_until_a_search_is_due(swarm):
    """Nothing at as many holders as a store's replica count: the key is empty, not the holders wrong.
    The reads that follow go to the same holders without a search, and see an entry stored since."""
    run_id = f"reads-{uuid.uuid4().hex[:8]}"
    key = worker_key(run_id, 0)
    reader, writer = swarm[0], swarm[1]
    probe = int(neighbour_id(DHTID.generate(source=key)))
    with watching(reader):
        assert seen(reader, run_id) == set()  # the first read searches: the key was never searched
        holders = reader.hivemind_dht.run_coroutine(Remembered(key))
        assert len(holders) >= 5, holders  # the swarm's six peers, the reader among them
        reader.hivemind_dht.run_coroutine(asked)
        for _ in range(3):
            assert seen(reader, run_id) == set()
            assert reader.hivemind_dht.run_coroutine(Remembered(key)) == holders
        assert not any(probe in keys for _, keys in reader.hivemind_dht.run_coroutine(asked))  # no search
        assert writer.announce_worker(worker_entry(run_id, writer.peer_id), ttl=60.0)
        assert seen(reader, run_id) == {writer.peer_id}
        assert not any(probe in keys for _, keys in reader.hivemind_dht.run_coroutine(asked))


# Last in the module: the peer it adds leaves, and the others' searches may name it for a while.
def test_a_peer_that_knows_no_other_remembers_no_holders_and_an_empty_read_at_few_searches_again(swarm):
    """A search made while a peer knows few others may name the wrong holders: it must not stick. Fewer
    holders than a store's replica count (here the reader's 8, in a swarm of 7) is what such a search
    finds: each empty read there searches again."""
    run_id = f"reads-{uuid.uuid4().hex[:8]}"
    key = worker_key(run_id, 0)
    with SwarmDHT.start() as lone:  # no initial peers
        assert lone.live_workers(run_id, 0) == []
        assert lone.hivemind_dht.run_coroutine(SearchNow(key)) == {}
    probe = int(neighbour_id(DHTID.generate(source=key)))
    with SwarmDHT.start(initial_peers=swarm[0].visible_maddrs(), num_replicas=8) as reader, watching(reader):
        for _ in range(2):  # the key is empty: each read searches, finds nothing and forgets what it found
            assert seen(reader, run_id) == set()
            assert reader.hivemind_dht.run_coroutine(Remembered(key)) == {}
            assert any(probe in keys for _, keys in reader.hivemind_dht.run_coroutine(asked))
