"""Entries received, counted by record family (dht/entry_traffic.py), between admitted hivemind peers on
loopback: a store is counted where it lands, a read's answer where it arrives, whole (the writer's
credential and signature included), and the writer's own storage not at all."""

from __future__ import annotations

import pickle
import time

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from agora.auth.authority import RunAuthority
from agora.dht import SwarmDHT, WorkerRecord, worker_key
from agora.dht.entry_traffic import ReceivedEntries
from agora.dht.key_policy import key_hash
from agora.dht.keys import bans_key, units_key
from agora.dht.security import ROUND_METHODS, DHTSecurity
from agora.pipeline.fingerprint import RunFingerprint
from polling import eventually

pytestmark = pytest.mark.timeout(120)

RUN = "trafficrun"
FINGERPRINT = RunFingerprint(seed=0, stages=2, basis="b0", data="d0", config="c0").text()


def test_entries_are_counted_by_family_whole_and_the_counts_start_in_the_receiving_process():
    counter = ReceivedEntries(RUN, methods=ROUND_METHODS, owner_public_key="ssh-rsa MINE")
    subkey = MSGPackSerializer.dumps("peer[owner:ssh-rsa THEIRS]")
    assert counter.validate(DHTRecord(key_hash(worker_key(RUN, 1)), MSGPackSerializer.dumps("me[owner:ssh-rsa MINE]"),
                                      b"mine", time.time() + 60))  # its own: not received
    for key, value in ((worker_key(RUN, 1), b"w" * 100), (units_key(RUN, 3), b"u" * 50), (bans_key(RUN), b"b" * 10),
                       ("someone.else", b"x")):
        assert counter.validate(DHTRecord(key_hash(key), subkey, value, time.time() + 60))
    hashed = len(key_hash(worker_key(RUN, 1)))
    assert counter.counts() == {"bans": (1, hashed + len(subkey) + 10), "other": (1, hashed + len(subkey) + 1),
                                "units": (1, hashed + len(subkey) + 50), "workers": (1, hashed + len(subkey) + 100)}
    copy = pickle.loads(pickle.dumps(counter))  # as hivemind sends it to its DHT process
    assert copy.counts() == {}
    assert copy.validate(DHTRecord(key_hash(worker_key(RUN, 0)), subkey, b"", time.time())) and copy.counts()["workers"][0] == 1


def test_admitted_peers_count_the_stores_they_hold_and_the_answers_they_read(tmp_path):
    authority = RunAuthority(tmp_path / "authority", run_id=RUN)
    for name in ("a", "b", "c"):
        authority.mint(tmp_path / name, role="worker", stage=0)
    first = SwarmDHT.start(security=DHTSecurity.from_state_dir(tmp_path / "a"))
    peers = [first] + [SwarmDHT.start(initial_peers=first.visible_maddrs(),
                                      security=DHTSecurity.from_state_dir(tmp_path / name)) for name in ("b", "c")]
    reader, writer, third = peers
    try:
        assert all(peer.received_entries().get("workers") is None for peer in peers)
        record = WorkerRecord(peer_id=writer.peer_id, run_id=RUN, endpoint="127.0.0.1:50051", stage=0, n_stages=2,
                              throughput=10.0, queue_depth=0, step=1, phase="member", version="0.1.0",
                              updated_at=time.time(), fingerprint=FINGERPRINT)
        assert writer.announce_worker(record, ttl=60)
        eventually(lambda: reader.live_workers(RUN, 0) == [record], timeout=15, what="the announce read")
        stored = len(record.to_wire())
        for peer in (reader, third):  # each held the store, and the reader read it from a holder too
            entries, size = peer.received_entries()["workers"]
            assert entries >= 1
            assert size / entries > stored + 1500, (size, entries, stored)  # the credential chain rides along
        assert writer.received_entries().get("workers") is None  # its own storage is not received
    finally:
        for peer in reversed(peers):
            peer.shutdown()


def test_an_insecure_peer_counts_nothing():
    peer = SwarmDHT.start()
    try:
        assert peer.received_entries() == {}
    finally:
        peer.shutdown()
