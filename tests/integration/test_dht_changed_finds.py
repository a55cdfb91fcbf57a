"""Changed finds (dht/changed_finds.py) between real hivemind DHT peers on loopback: a holder answers a
reader that names what it holds with the changes alone, the reader still sees the whole stage, and
between admitted peers a request without the run's credentials is refused."""

from __future__ import annotations

import functools
import time
import uuid

import pytest
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2

from dht_swarm import admitted_swarm, dht_swarm, held_by, worker_entry

from agora.auth.authority import RunAuthority
from agora.dht import SwarmDHT, WorkerRecord, worker_key
from agora.dht.changed_finds import HANDLER, ChangedFindRequest
from agora.dht.security import DHTSecurity
from agora.pipeline.fingerprint import RunFingerprint
from polling import eventually

pytestmark = pytest.mark.timeout(120)


async def _find_changed(_dht, node, *, holder: str, key: str, held: dict):
    """Run in the reader's DHT process: {subkey: expiration} of what ``holder`` answers."""
    answer = await node.protocol.call_find_changed(PeerID.from_base58(holder), DHTID.generate(source=key), held)
    if answer is None:
        return None
    found, _ = next(iter(answer.values()))
    return {} if found is None else {subkey: item.expiration_time for subkey, item in found.value.items()}


def find_changed(reader: SwarmDHT, holder: SwarmDHT, key: str, held: dict):
    call = functools.partial(_find_changed, holder=holder.peer_id, key=key, held=held)
    return reader.hivemind_dht.run_coroutine(call)


def test_a_holder_answers_with_the_entries_changed_since_and_the_reader_still_sees_the_whole_stage():
    with dht_swarm(4) as swarm:
        run_id = f"changed-{uuid.uuid4().hex[:8]}"
        key = worker_key(run_id, 0)
        reader, writers = swarm[0], swarm[1:]
        for writer in writers:
            assert writer.announce_worker(worker_entry(run_id, writer.peer_id), ttl=60.0)
        assert {w.peer_id for w in reader.live_workers(run_id, 0)} == {w.peer_id for w in writers}
        holder = next(peer for peer in swarm if peer is not reader and held_by(peer, key))
        held = reader._memory.held(key)
        assert len(held) == 3
        assert find_changed(reader, holder, key, held) == {}  # nothing changed since the read
        assert set(find_changed(reader, holder, key, {})) == {w.peer_id for w in writers}  # nothing held: all
        # One writer beats again: the answer is that entry alone, and the reader's reads show it with the rest.
        assert writers[0].announce_worker(worker_entry(run_id, writers[0].peer_id, step=11), ttl=60.0)
        eventually(lambda: find_changed(reader, holder, key, held) != {}, timeout=10, what="the beat at the holder")
        assert set(find_changed(reader, holder, key, held)) == {writers[0].peer_id}
        for _ in range(4):  # quick and full reads alike
            steps = {w.peer_id: w.step for w in reader.live_workers(run_id, 0)}
            assert steps == {writers[0].peer_id: 11, writers[1].peer_id: 10, writers[2].peer_id: 10}
        # A withdrawal is a change too: the tombstone comes back and hides the entry.
        assert writers[2].withdraw(run_id, 0, writers[2].peer_id)
        eventually(lambda: {w.peer_id for w in reader.live_workers(run_id, 0)} == {w.peer_id for w in writers[:2]},
                   timeout=10, what="the withdrawal seen")


RUN = "changedrun"
FINGERPRINT = RunFingerprint(seed=0, stages=2, basis="b0", data="d0", config="c0").text()


async def _unsigned(_dht, node, *, holder: str, key: str) -> str:
    """Run in a DHT process: a changed find sent without credentials; what came back."""
    request = ChangedFindRequest(key=DHTID.generate(source=key).to_bytes())
    try:
        await node.protocol.p2p.call_protobuf_handler(PeerID.from_base58(holder), HANDLER, request,
                                                      dht_pb2.FindResponse)
    except Exception as error:
        return f"refused: {error}"
    return "answered"


def test_admitted_peers_answer_changed_finds_signed_by_the_run_and_refuse_one_without_credentials(tmp_path):
    authority = RunAuthority(tmp_path / "authority", run_id=RUN)
    for name in ("a", "b"):
        authority.mint(tmp_path / name, role="worker", stage=0)
    first = SwarmDHT.start(security=DHTSecurity.from_state_dir(tmp_path / "a"))
    second = SwarmDHT.start(initial_peers=first.visible_maddrs(), security=DHTSecurity.from_state_dir(tmp_path / "b"))
    try:
        record = WorkerRecord(peer_id=second.peer_id, run_id=RUN, endpoint="127.0.0.1:50051", stage=0, n_stages=2,
                              throughput=10.0, queue_depth=0, step=1, phase="member", version="0.1.0",
                              updated_at=time.time(), fingerprint=FINGERPRINT)
        assert second.announce_worker(record, ttl=60)
        eventually(lambda: first.live_workers(RUN, 0) == [record], timeout=15, what="the announce")
        key = worker_key(RUN, 0)
        holder = first if held_by(first, key) else second
        reader = second if holder is first else first
        found = find_changed(reader, holder, key, {})  # secured subkeys end with the writer's key
        assert [subkey.split("[owner:")[0] for subkey in found] == [second.peer_id]
        for _ in range(3):
            assert reader.live_workers(RUN, 0) == [record]
        refused = reader.hivemind_dht.run_coroutine(functools.partial(_unsigned, holder=holder.peer_id, key=key))
        assert refused.startswith("refused") and "credentials were refused" in refused, refused
    finally:
        second.shutdown()
        first.shutdown()


def _answer_bytes(reader: SwarmDHT) -> tuple[int, int]:
    """(changed finds of a stage's workers this reader sent, the bytes of their answers)."""
    calls, _, back = reader.traffic()["sent"].get("find_changed workers", (0, 0, 0))
    return calls, back


async def _forget_chains_once_named(_dht, node) -> None:
    """Run in the reader's DHT process: its next changed find names the chains it holds, and they are
    forgotten before the answer comes (its bounded memory let them go meanwhile)."""
    held = node.protocol.held_chains
    tags = held.tags

    def named_then_forgotten(key):
        named = tags(key)
        held._chains.clear()
        held.tags = tags
        return named
    held.tags = named_then_forgotten


def test_between_admitted_peers_an_answer_names_the_chains_the_reader_holds_and_the_reader_puts_them_back(tmp_path):
    with admitted_swarm(tmp_path, RUN) as peers:
        reader, writer, _ = peers

        def record(step: int) -> WorkerRecord:
            return WorkerRecord(peer_id=writer.peer_id, run_id=RUN, endpoint="127.0.0.1:50051", stage=0, n_stages=2,
                                throughput=10.0, queue_depth=0, step=step, phase="member", version="0.1.0",
                                updated_at=time.time(), fingerprint=FINGERPRINT)
        key = worker_key(RUN, 0)
        assert writer.announce_worker(record(1), ttl=60)
        holder = eventually(lambda: next((peer for peer in peers if peer is not reader and held_by(peer, key)), None),
                            timeout=15, what="a holder other than the reader")
        calls, back = _answer_bytes(reader)
        assert set(find_changed(reader, holder, key, {})) == {writer.subkey_of(writer.peer_id)}  # first read: whole
        calls_whole, back_whole = _answer_bytes(reader)
        whole = back_whole - back
        assert calls_whole == calls + 1 and whole > 2500, whole  # the chain rides along (~1.9 KB of it)
        # Held no longer (nothing named as held: as after the reader's copy expired), its chain still named.
        assert len(find_changed(reader, holder, key, {})) == 1
        calls_named, back_named = _answer_bytes(reader)
        assert calls_named == calls_whole + 1 and back_named - back_whole < whole - 1500, (back_named - back_whole, whole)

        assert writer.announce_worker(record(2), ttl=60)
        eventually(lambda: [w.step for w in reader.live_workers(RUN, 0)] == [2], timeout=15, what="the beat read")
        held = reader._memory.held(key)
        assert writer.announce_worker(record(3), ttl=60)
        eventually(lambda: find_changed(reader, holder, key, held) != {}, timeout=10, what="the beat at the holder")
        calls, back = _answer_bytes(reader)
        received = reader.traffic()["received"]["workers"]
        assert len(find_changed(reader, holder, key, held)) == 1  # the beat alone, its chain named
        calls_named, back_named = _answer_bytes(reader)
        assert calls_named == calls + 1 and back_named - back < whole - 1500, (back_named - back, whole)
        entries, size = (now - before for now, before in zip(reader.traffic()["received"]["workers"], received))
        assert entries == 1 and 0 < size < back_named - back, size  # counted as it crossed the wire
        steps = [[w.step for w in reader.live_workers(RUN, 0)] for _ in range(3)]  # quick and full reads
        assert steps == [[3]] * 3  # each entry put back whole and judged: signature, chain, record

        # A chain named and forgotten before the answer came: asked again naming none, answered whole.
        reader.hivemind_dht.run_coroutine(_forget_chains_once_named)
        calls, back = _answer_bytes(reader)
        assert len(find_changed(reader, holder, key, held)) == 1
        calls_again, back_again = _answer_bytes(reader)
        assert calls_again == calls + 2 and back_again - back > whole + (back_named - back) - 500
        assert [w.step for w in reader.live_workers(RUN, 0)] == [3]
