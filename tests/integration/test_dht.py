"""agora.dht: record schemas (pure), then real hivemind DHT peers on loopback.

The DHT tests share one module-scoped pair of peers (`dht_pair`, tests/conftest.py: each start spawns a p2pd and takes
~0.5 s) and isolate themselves with a fresh run id each. Waiting for state is done by
polling with a deadline, never by a fixed sleep.
"""

import asyncio
import logging
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import ClassVar

import pytest
from pydantic import Field

from agora.dht import DHTRequestError, Heartbeat, Record, RecordError, SwarmDHT, WorkerRecord, worker_key
from agora.dht.bootstrap import host_maddrs, write_ready_file
from agora.dht.keys import check_run_id
from agora.dht.record_fields import parse_endpoint
from agora.dht.records import SCHEMA_VERSION


def make_record(**overrides) -> WorkerRecord:
    fields = dict(
        peer_id="peer-a",
        run_id="run",
        endpoint="127.0.0.1:50051",
        stage=1,
        n_stages=3,
        throughput=123.5,
        queue_depth=2,
        step=10,
        phase="member",
        version="0.1.0",
        updated_at=1000.0,
        fingerprint="seed=0;stages=3;basis=b;data=d;config=c",
    )
    fields.update(overrides)
    return WorkerRecord(**fields)


def eventually(predicate, *, timeout: float, what: str):
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


# ---- records (pure) -------------------------------------------------------------------


def test_record_round_trips_through_its_wire_form():
    record = make_record()
    wire = record.to_wire()
    assert wire["schema"] == SCHEMA_VERSION and wire["kind"] == "worker"
    assert all(isinstance(value, (str, int, float)) for value in wire.values())
    assert WorkerRecord.from_wire(wire) == record


def test_whole_floats_and_unknown_fields_are_accepted():
    wire = make_record().to_wire()
    wire["throughput"] = 7  # another implementation may encode 7.0 as an int
    wire["added_in_a_later_version"] = [1, 2]
    record = WorkerRecord.from_wire(wire)
    assert record.throughput == 7.0 and isinstance(record.throughput, float)


BAD_FIELDS = [
    ("stage", "1", "worker.stage: input should be a valid integer, got str '1'"),
    ("stage", True, "worker.stage: input should be a valid integer, got bool True"),
    ("throughput", "fast", "worker.throughput: input should be a valid number, got str 'fast'"),
    ("throughput", -1.0, "worker.throughput: input should be greater than or equal to 0, got float -1.0"),
    ("throughput", math.nan, "worker.throughput: input should be a finite number, got float nan"),
    ("throughput", math.inf, "worker.throughput: input should be a finite number, got float inf"),
    ("queue_depth", -3, "worker.queue_depth: input should be greater than or equal to 0, got int -3"),
    ("step", 1.5, "worker.step: input should be a valid integer, got float 1.5"),
    ("stage", 3, "worker.stage: 3 out of range [0, n_stages=3)"),
    ("stage", -1, "worker.stage: input should be greater than or equal to 0, got int -1"),
    ("n_stages", 0, "worker.n_stages: input should be greater than or equal to 1, got int 0"),
    ("phase", "sleeping", "worker.phase: input should be 'weight_sync', 'optimizer_sync', 'member'"),
    ("endpoint", "localhost", "worker.endpoint: expected 'host:port', got str 'localhost'"),
    ("endpoint", "127.0.0.1:70000", "worker.endpoint: port 70000 out of range [1, 65535]"),
    ("endpoint", "::1:80", "worker.endpoint: IPv6 hosts must be bracketed"),
    ("endpoint", "host:\u00b2", "worker.endpoint: expected 'host:port'"),  # a digit to isdigit(), not to int()
    ("throughput", 10**400, "worker.throughput: input should be a valid number, got int 1000"),
    ("endpoint", "h" * 10_000 + ":80", "worker.endpoint: string should have at most 256 characters, got str 'hhh"),
    ("peer_id", "", "worker.peer_id: string should have at least 1 character, got str ''"),
    ("run_id", "a.b", "worker.run_id: string should match pattern '^[A-Za-z0-9_-]{1,64}$', got str 'a.b'"),
    ("version", None, "worker.version: input should be a valid string, got NoneType None"),
    ("fingerprint", "", "worker.fingerprint: string should have at least 1 character"),
]


@pytest.mark.parametrize("field, value, reason", BAD_FIELDS, ids=[f"{f}={v!r:.20}" for f, v, _ in BAD_FIELDS])
def test_each_bad_field_is_rejected_with_a_reason_naming_it(field, value, reason):
    wire = make_record().to_wire()
    wire[field] = value
    with pytest.raises(RecordError) as caught:
        WorkerRecord.from_wire(wire)
    assert reason in str(caught.value)
    with pytest.raises(RecordError):  # nor can such a record be built locally
        make_record(**{field: value})


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda wire: wire.pop("step"), "worker.step: missing"),
        (lambda wire: wire.update(schema=99), f"worker.schema: expected {SCHEMA_VERSION}, got 99"),
        (lambda wire: wire.pop("schema"), f"worker.schema: expected {SCHEMA_VERSION}, got None"),
        (lambda wire: wire.update(kind="lease"), "worker.kind: expected 'worker'"),
    ],
    ids=["missing field", "future schema", "no schema", "other kind"],
)
def test_wrong_shape_is_rejected(mutate, reason):
    wire = make_record().to_wire()
    mutate(wire)
    with pytest.raises(RecordError) as caught:
        WorkerRecord.from_wire(wire)
    assert reason in str(caught.value)


@pytest.mark.parametrize("value", [None, b"\x00\xff", [1, 2], 42, "worker"])
def test_non_dict_values_are_rejected(value):
    with pytest.raises(RecordError, match="expected a dict"):
        WorkerRecord.from_wire(value)


def test_keys_and_endpoints():
    assert worker_key("run-1", 2) == "run-1.stage2.workers"
    assert parse_endpoint("[::1]:8080") == ("::1", 8080)
    assert parse_endpoint("node.example:443") == ("node.example", 443)
    assert check_run_id("A_b-9") == "A_b-9"
    with pytest.raises(RecordError):
        worker_key("run", -1)
    assert host_maddrs("127.0.0.1", 0) == ["/ip4/127.0.0.1/tcp/0"]
    assert host_maddrs("::1", 5) == ["/ip6/::1/tcp/5"]
    with pytest.raises(ValueError, match="host: expected an IPv4 or IPv6 address"):
        host_maddrs("localhost", 0)
    with pytest.raises(ValueError, match="port:"):
        host_maddrs("127.0.0.1", 70000)


# ---- real DHT peers on loopback ----------------------------------------------------------


@pytest.fixture
def run_id():
    return f"test-{uuid.uuid4().hex[:12]}"


def test_a_worker_announced_on_one_peer_is_seen_on_the_other(dht_pair, run_id):
    first, second = dht_pair
    record = make_record(peer_id=first.peer_id, run_id=run_id, updated_at=first.clock())
    assert first.announce_worker(record, ttl=30)
    assert eventually(lambda: second.live_workers(run_id, 1), timeout=10, what="the announce") == [record]
    everything = second.all_workers(run_id, 3)
    assert everything == {0: [], 1: [record], 2: []}


def test_two_workers_of_one_stage_are_both_listed_in_peer_id_order(dht_pair, run_id):
    first, second = dht_pair
    records = [make_record(peer_id=peer.peer_id, run_id=run_id, endpoint=f"127.0.0.1:{port}")
               for peer, port in ((first, 7001), (second, 7002))]
    for peer, record in zip(dht_pair, records):
        assert peer.announce_worker(record, ttl=30)
    expected = sorted(records, key=lambda record: record.peer_id)
    for reader in dht_pair:
        assert eventually(lambda: reader.live_workers(run_id, 1) == expected, timeout=10, what="both workers")


def test_garbage_under_a_workers_key_is_skipped_and_counted(dht_pair, run_id):
    first, second = dht_pair
    good = make_record(peer_id="peer-good", run_id=run_id)
    assert first.announce_worker(good, ttl=30)
    key = worker_key(run_id, 1)
    raw = first.hivemind_dht  # bypass the typed layer, as a buggy or hostile peer would
    expiration = first.clock() + 30
    bad_wire = dict(make_record(peer_id="peer-nan", run_id=run_id).to_wire(), throughput=math.nan)
    assert raw.store(key, b"\x00\xffjunk", expiration, subkey="peer-bytes")
    assert raw.store(key, bad_wire, expiration, subkey="peer-nan")
    impostor = make_record(peer_id="someone-else", run_id=run_id)  # subkey is not its peer id
    assert raw.store(key, impostor.to_wire(), expiration, subkey="peer-x")
    misfiled = make_record(peer_id="peer-s", run_id=run_id, stage=2)  # a stage 2 record under stage 1
    assert raw.store(key, misfiled.to_wire(), expiration, subkey="peer-s")
    # (a distinct expiration: on a tie hivemind's storage heap compares subkeys, int < str fails)
    assert raw.store(key, good.to_wire(), expiration + 1, subkey=17)
    before = second.rejections().get(key, 0)
    assert second.live_workers(run_id, 1) == [good]
    assert second.rejections()[key] - before == 5
    # A plain (non-subkey) value that outlives the dictionary replaces it: still no crash.
    plain_key = worker_key(run_id, 2)
    assert raw.store(plain_key, {"not": "a record"}, expiration)
    assert second.live_workers(run_id, 2) == []
    assert second.rejections()[plain_key] == 1


def test_withdraw_removes_a_worker_and_it_can_announce_again(dht_pair, run_id):
    first, second = dht_pair
    record = make_record(peer_id=first.peer_id, run_id=run_id)
    assert first.announce_worker(record, ttl=60)
    eventually(lambda: second.live_workers(run_id, 1), timeout=10, what="the announce")
    assert first.withdraw(run_id, 1, first.peer_id)
    assert second.live_workers(run_id, 1) == []
    assert first.live_workers(run_id, 1) == []
    assert first.announce_worker(record, ttl=60)  # a later expiration beats the tombstone
    assert second.live_workers(run_id, 1) == [record]
    # A peer that never wrote the entry can withdraw it too: it reads the expiration to beat.
    assert second.withdraw(run_id, 1, first.peer_id)
    assert first.live_workers(run_id, 1) == []


def test_heartbeat_keeps_a_record_alive_and_it_expires_when_beats_stop(dht_pair, run_id):
    first, second = dht_pair
    state = {"step": 0}

    def current():
        state["step"] += 1
        return make_record(peer_id=first.peer_id, run_id=run_id, step=state["step"])

    async def scenario():
        heartbeat = Heartbeat(first, current, interval=0.5)
        assert heartbeat.ttl == 1.5
        assert await heartbeat.start()
        try:
            # Outlive one ttl while beating: the record must still be there, and fresh.
            await asyncio.wait_for(heartbeat.wait_beats(5), 10)
            seen = await second.live_workers_async(run_id, 1)
            assert len(seen) == 1 and seen[0].step >= 4
        finally:
            await heartbeat.stop(withdraw=False)  # as if the worker died: no goodbye
        assert not heartbeat.running and heartbeat.failures == 0

    asyncio.run(scenario())
    # ttl is 1.5 s after the last beat; the deadline leaves room for a slow machine.
    eventually(lambda: second.live_workers(run_id, 1) == [], timeout=5, what="the record to expire")


def test_heartbeat_stop_withdraws_right_away(dht_pair, run_id):
    first, second = dht_pair

    async def scenario():
        heartbeat = Heartbeat(first, lambda: make_record(peer_id=first.peer_id, run_id=run_id), interval=5)
        async with heartbeat:
            assert [w.peer_id for w in await second.live_workers_async(run_id, 1)] == [first.peer_id]
            assert heartbeat.last_announced.updated_at > 1000.0  # stamped by the heartbeat
        assert await second.live_workers_async(run_id, 1) == []

    asyncio.run(scenario())


def test_heartbeat_survives_a_broken_record_source(dht_pair, run_id):
    first, _ = dht_pair
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("model not loaded yet")
        return make_record(peer_id=first.peer_id, run_id=run_id)

    async def scenario():
        heartbeat = Heartbeat(first, flaky, interval=0.2)
        assert not await heartbeat.start()  # first beat failed, loop keeps going
        try:
            await asyncio.wait_for(heartbeat.wait_beats(1), 10)
        finally:
            await heartbeat.stop()
        assert heartbeat.failures == 1

    asyncio.run(scenario())


def test_entries_expire_by_the_injected_clock(dht_pair, run_id):
    first, _ = dht_pair
    assert first.announce_worker(make_record(peer_id="peer-now", run_id=run_id), ttl=30)
    # A reader whose clock runs 60 s ahead sees that 30 s entry as expired already.
    with SwarmDHT.start(initial_peers=first.visible_maddrs(), clock=lambda: first.clock() + 60) as ahead:
        assert first.live_workers(run_id, 1) != []
        assert ahead.live_workers(run_id, 1) == []
        # ... while its own writes expire by its clock: 60 s ahead + 30 s ttl.
        assert ahead.announce_worker(make_record(peer_id="peer-ahead", run_id=run_id), ttl=30)
        assert [w.peer_id for w in ahead.live_workers(run_id, 1)] == ["peer-ahead"]


class LeaseRecord(Record):
    """A record type declared outside dht/records.py, the way a test or an experiment may."""

    KIND: ClassVar[str] = "test-lease"
    holder: str
    unit: int = Field(ge=0)
    note: str = ""


def test_generic_records_under_plain_keys_and_subkeys(dht_pair, run_id):
    first, second = dht_pair
    key = f"{run_id}.lease.7"
    lease = LeaseRecord(holder=first.peer_id, unit=7)
    assert first.store(key, lease, ttl=30)
    stored = second.get_record(key, LeaseRecord)
    assert stored.record == lease and stored.expiration_time > second.clock()
    assert LeaseRecord.from_wire({"schema": SCHEMA_VERSION, "kind": "test-lease", "holder": "h", "unit": 1}).note == ""
    assert second.get_record(key, WorkerRecord) is None  # wrong kind: skipped and counted
    assert second.rejections()[key] == 1
    assert second.delete(key)  # a peer that did not write it reads the expiration to outlive
    assert first.get_record(key, LeaseRecord) is None
    assert second.get_record(f"{run_id}.absent", LeaseRecord) is None

    rounds = f"{run_id}.rounds"
    assert first.store(rounds, LeaseRecord(holder="b", unit=2), ttl=30, subkey="b")
    assert second.store(rounds, LeaseRecord(holder="a", unit=1), ttl=30, subkey="a")
    entries = first.get_entries(rounds, LeaseRecord)
    assert list(entries) == ["a", "b"] and entries["a"].record.unit == 1


def test_concurrent_async_requests_share_the_pipe_safely(dht_pair, run_id):
    first, second = dht_pair
    records = [make_record(peer_id=f"peer-{index:02d}", run_id=run_id, step=index) for index in range(12)]

    async def scenario():
        accepted = await asyncio.gather(*(first.announce_worker_async(record, ttl=30) for record in records))
        assert all(accepted)
        views = await asyncio.gather(*(second.live_workers_async(run_id, 1) for _ in range(12)))
        assert all(view == records for view in views)
        assert (await second.all_workers_async(run_id, 2))[1] == records

    asyncio.run(scenario())


def test_heartbeat_of_a_worker_that_moves_stage_withdraws_the_old_entry(dht_pair, run_id):
    first, second = dht_pair
    state = {"stage": 0}

    async def scenario():
        heartbeat = Heartbeat(
            first, lambda: make_record(peer_id=first.peer_id, run_id=run_id, stage=state["stage"]), interval=30
        )
        async with heartbeat:
            assert [w.stage for w in await second.live_workers_async(run_id, 0)] == [0]
            state["stage"] = 2
            assert await heartbeat.beat()
            assert await second.live_workers_async(run_id, 0) == []
            assert [w.stage for w in await second.live_workers_async(run_id, 2)] == [2]
        assert await second.live_workers_async(run_id, 2) == []

    asyncio.run(scenario())


def test_requests_after_shutdown_raise_a_clear_error():
    peer = SwarmDHT.start()
    peer.shutdown()
    peer.shutdown()  # idempotent
    assert not peer.alive
    with pytest.raises(DHTRequestError, match="shut down"):
        peer.live_workers("run", 0)


def test_joining_through_an_unreachable_peer_fails_cleanly():
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWFQVM3cAtUAh1juLseAF3MQfFVUMEh4PUGqkCB5yW43tM"
    with pytest.raises(DHTRequestError, match="failed to start"):
        SwarmDHT.start(initial_peers=[dead], startup_timeout=20, join_attempts=1)


# ---- bootstrap ----------------------------------------------------------------------------


def session_processes(session_id: int) -> list[int]:
    """Pids still alive in a session (the bootstrap, its DHT process, their p2pd)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    fields = file.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session_id and fields[0] != "Z":  # field 6 of stat: session
                pids.append(int(entry))
    return pids


@pytest.fixture
def spawn():
    """Start Python children in their own sessions; kill whatever is left of them afterwards."""
    children = []

    def start(*args: str) -> subprocess.Popen:
        child = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # so its DHT process and p2pd can be found by session id
        )
        children.append(child)
        return child

    yield start
    for child in children:
        if child.poll() is None or session_processes(child.pid):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        for stream in (child.stdin, child.stdout, child.stderr):
            stream.close()


@pytest.mark.timeout(60)
def test_bootstrap_serves_writes_its_addresses_and_exits_cleanly(tmp_path, spawn):
    ready = tmp_path / "peers.txt"
    process = spawn("-m", "agora.dht.bootstrap", "--insecure", "--ready-file", str(ready))
    eventually(lambda: ready.exists() or process.poll() is not None, timeout=30, what="the ready file")
    assert process.poll() is None, process.stderr.read()
    maddrs = ready.read_text().split()
    assert maddrs and all(m.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in m for m in maddrs)
    with SwarmDHT.start(initial_peers=maddrs) as joiner:
        run_id = f"boot-{uuid.uuid4().hex[:8]}"
        record = make_record(peer_id=joiner.peer_id, run_id=run_id)
        assert joiner.announce_worker(record, ttl=30)
        assert joiner.live_workers(run_id, 1) == [record]
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=20)
    assert process.returncode == 0, stderr
    assert stdout.split() == maddrs  # stdout carries the multiaddrs and nothing else
    assert not ready.exists()
    eventually(lambda: not session_processes(process.pid), timeout=10, what="its children to exit")


@pytest.mark.timeout(60)
def test_a_killed_owner_leaves_no_dht_process_behind(spawn):
    owner = spawn("-c", "import sys; from agora.dht import SwarmDHT; "
                  "s = SwarmDHT.start(); print(s.peer_id, flush=True); sys.stdin.read()")
    assert owner.stdout.readline().strip()  # serving
    assert len(session_processes(owner.pid)) == 3  # the owner, hivemind's DHT process, p2pd
    owner.kill()
    owner.wait(timeout=10)
    eventually(lambda: not session_processes(owner.pid), timeout=20, what="the orphaned DHT process to exit")


def test_ready_file_is_replaced_whole(tmp_path):
    path = tmp_path / "ready"
    path.write_text("stale\n")
    write_ready_file(str(path), ["/ip4/1.2.3.4/tcp/5/p2p/x", "/ip6/::1/tcp/5/p2p/x"])
    assert path.read_text() == "/ip4/1.2.3.4/tcp/5/p2p/x\n/ip6/::1/tcp/5/p2p/x\n"
    assert sorted(os.listdir(tmp_path)) == ["ready"]  # no temp file left behind


def test_a_join_nobody_answers_is_tried_again_saying_so(caplog):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWFQVM3cAtUAh1juLseAF3MQfFVUMEh4PUGqkCB5yW43tM"
    with caplog.at_level(logging.WARNING, logger="agora.dht.swarm"):
        with pytest.raises(DHTRequestError, match="failed to start"):
            SwarmDHT.start(initial_peers=[dead], startup_timeout=20, join_attempts=2)
    assert [r.getMessage() for r in caplog.records if "initial peers answered" in r.getMessage()] == [
        "none of the 1 initial peers answered (attempt 1 of 2); trying again in 2 s"]


def test_every_request_is_timed_by_operation_and_key_family(dht_pair, run_id):
    a, b = dht_pair
    before = a.timings.snapshot()
    a.announce_worker(make_record(peer_id="timed", run_id=run_id, stage=0), ttl=30)
    a.live_workers(run_id, 0)
    a.get_record(f"{run_id}.nothing-here", WorkerRecord)
    roster = a.timings.snapshot()[("get", "workers")].count
    a.all_workers(run_id, 3)  # the roster's read: one get per stage, each timed as it answers
    deadline = time.monotonic() + 5  # (each timed by its future's callback, which may run just after)
    while a.timings.snapshot()[("get", "workers")].count < roster + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    after = a.timings.snapshot()

    def added(operation, family):
        then = before.get((operation, family))
        now = after[(operation, family)]
        return now.count - (then.count if then else 0), now.cumulative()[-1] == now.count

    assert added("store", "workers") == (1, True)
    assert added("get", "workers")[0] >= 1 + 3
    assert added("get", "other")[0] == 1  # a key of no family is named by none
    assert all(stats.total_s > 0 for stats in after.values())


def test_in_a_swarm_wider_than_the_read_beam_every_reader_sees_every_workers_entry():
    """A latest read keeps READ_BEAM peers in its search, not hivemind's 20 (dht/swarm.py): with more
    peers than that, the 5 nearest a key hold every writer's entry, and every reader finds them all,
    by a full read and by the quick one after it (dht/reads.py)."""
    from agora.dht.dht_process import READ_BEAM

    run_id = f"beam-{uuid.uuid4().hex[:8]}"
    peers = [SwarmDHT.start()]
    try:
        while len(peers) < READ_BEAM + 4:
            peers.append(SwarmDHT.start(initial_peers=peers[0].visible_maddrs()))
        records = [make_record(peer_id=peer.peer_id, run_id=run_id, endpoint=f"127.0.0.1:{7000 + index}", stage=0)
                   for index, peer in enumerate(peers)]
        for peer, record in zip(peers, records):
            assert peer.announce_worker(record, ttl=60)
        expected = sorted(records, key=lambda record: record.peer_id)
        for reader in peers:
            assert eventually(lambda: reader.live_workers(run_id, 0) == expected, timeout=20,
                              what=f"all {len(peers)} workers from {reader.peer_id[:12]}")
            assert reader.live_workers(run_id, 0) == expected  # the other kind of read than the last
    finally:
        for peer in peers:
            peer.shutdown()


def test_a_peer_slower_to_start_than_its_timeout_is_tried_again_saying_so(caplog):
    # No DHT process and p2pd come up in 10 ms: every attempt times out.
    with caplog.at_level(logging.WARNING, logger="agora.dht.swarm"):
        with pytest.raises(DHTRequestError, match=r"did not come up within 0.01 s \(startup_timeout\)"):
            SwarmDHT.start(startup_timeout=0.01, join_attempts=2)
    assert [r.getMessage() for r in caplog.records if "did not come up" in r.getMessage()] == [
        "the DHT peer did not come up within 0.01 s (attempt 1 of 2); trying again in 2 s"]
