"""What a DHT process carries (dht/entry_traffic.py), between admitted hivemind peers on loopback:
entries received by record family (a store where it lands, a read's answer where it arrives, whole:
the writer's credential and signature included; the writer's own storage not at all), and the
requests each sent by RPC and family, their authorization included."""

from __future__ import annotations

import pickle
import re
import time

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.proto import dht_pb2
from prometheus_client import CollectorRegistry, generate_latest
from hivemind.utils import MSGPackSerializer

from agora.dht import SwarmDHT, WorkerRecord, worker_key
from agora.dht.bans import NodeBans
from agora.dht.changed_finds import ChangedFindRequest
from agora.dht.entry_traffic import ReceivedEntries, SentRequests
from agora.dht.key_policy import KeyTable, key_hash
from agora.dht.keys import bans_key, units_key
from agora.dht.security import ROUND_METHODS
from agora.dht.swarm import DHTRequestError
from agora.monitor.dht_metrics import DHTMetrics
from agora.pipeline.fingerprint import RunFingerprint
from dht_swarm import admitted_swarm
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


def test_requests_are_counted_by_rpc_and_the_family_of_their_first_key():
    sent = SentRequests()
    find = dht_pb2.FindRequest(keys=[key_hash(worker_key(RUN, 0)), key_hash(units_key(RUN, 1))])
    answer = dht_pb2.FindResponse(results=[dht_pb2.FindResult(value=b"v" * 100)])
    sent.add("rpc_find", find, answer)
    sent.add("rpc_find", find, None)  # no response came back
    sent.add("rpc_ping", dht_pb2.PingRequest(), dht_pb2.PingResponse())
    sent.add("rpc_find_changed", ChangedFindRequest(key=key_hash(units_key(RUN, 2))), None)
    assert sent.counts() == {"find other": (2, 2 * find.ByteSize(), answer.ByteSize()), "ping -": (1, 0, 0),
                             "find_changed other": (1, ChangedFindRequest(key=key_hash(units_key(RUN, 2))).ByteSize(), 0)}
    sent.keys = KeyTable(RUN, methods=ROUND_METHODS)  # named by the run's families once it knows them
    sent.add("rpc_find", find, answer)
    assert sent.counts()["find workers"] == (1, find.ByteSize(), answer.ByteSize())


def test_admitted_peers_count_the_stores_they_hold_and_the_answers_they_read(tmp_path):
    with admitted_swarm(tmp_path, RUN) as peers:
        reader, writer, third = peers
        assert all(peer.traffic()["received"].get("workers") is None for peer in peers)
        record = WorkerRecord(peer_id=writer.peer_id, run_id=RUN, endpoint="127.0.0.1:50051", stage=0, n_stages=2,
                              throughput=10.0, queue_depth=0, step=1, phase="member", version="0.1.0",
                              updated_at=time.time(), fingerprint=FINGERPRINT)
        assert writer.announce_worker(record, ttl=60)
        eventually(lambda: reader.live_workers(RUN, 0) == [record], timeout=15, what="the announce read")
        stored = len(record.to_wire())
        for peer in (reader, third):  # each held the store, and the reader read it from a holder too
            entries, size = peer.traffic()["received"]["workers"]
            assert entries >= 1
            assert size / entries > stored + 1500, (size, entries, stored)  # the credential chain rides along
        assert writer.traffic()["received"].get("workers") is None  # its own storage is not received
        calls, out, back = writer.traffic()["sent"]["store workers"]  # to the two others
        # Signed answers (an unsigned one is tens of bytes); a store that timed out on a loaded host
        # counts its call with no answer, so the answers are judged by their sum, not per call.
        assert calls >= 2 and out / calls > stored + 1500 and back > 300
        sent = reader.traffic()["sent"]
        reads = [counts for name, counts in sent.items() if name.split()[1] == "workers" and "store" not in name]
        assert reads and all(calls >= 1 and back > 0 for calls, out, back in reads), sent
        assert "ping -" in sent  # joining: requests with no key
        registry = CollectorRegistry()  # what the node's metrics endpoint shows of it, read at scrape time
        DHTMetrics(registry, NodeBans(), None, reader.traffic)
        scraped = generate_latest(registry).decode()
        assert 'agora_dht_received_entries_total{kind="workers"}' in scraped
        assert re.search(r'agora_dht_response_bytes_total\{kind="workers",method="find_changed"\} [1-9]', scraped), scraped


def test_a_scrape_while_the_dht_process_does_not_answer_shows_the_rest():
    def gone() -> dict:
        raise DHTRequestError("the DHT process is not running")

    registry = CollectorRegistry()
    DHTMetrics(registry, NodeBans(), None, gone)
    scraped = generate_latest(registry).decode()
    assert "agora_dht_ban_list_serial" in scraped and "agora_dht_sent_requests" not in scraped


def test_an_insecure_peer_counts_nothing():
    peer = SwarmDHT.start()
    try:
        assert peer.traffic() == {"received": {}, "sent": {}}
    finally:
        peer.shutdown()
