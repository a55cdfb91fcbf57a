"""bench/dht_scale.py's newcomer steps on a real DHT (loopback, three hivemind peers): the donor found
through `all_workers` and `plan_donors` as a joining worker finds it, and the monitor's watch that
says when another peer's read returns the newcomer's record."""

import asyncio
import json
import time

import pytest

from agora.bench.dht_newcomer import find_donor
from agora.bench.dht_peer import CONFIG, watch_for_newcomer
from agora.dht.records import WorkerRecord
from agora.dht.swarm import SwarmDHT
from agora.pipeline.fingerprint import run_fingerprint

pytestmark = pytest.mark.timeout(90)

RUN = "newcomer-test"


def member(peer_id: str, stage: int = 0, phase: str = "member") -> WorkerRecord:
    return WorkerRecord(peer_id=peer_id, run_id=RUN, endpoint=f"127.0.0.1:{5000 + stage}", stage=stage, n_stages=3,
                        throughput=100.0, queue_depth=1, step=10, phase=phase, version="1", updated_at=1.0,
                        fingerprint=run_fingerprint(CONFIG).text())


async def announce(swarm: SwarmDHT, record: WorkerRecord) -> None:
    assert await swarm.store_async(record.dht_key(), record, 60.0, subkey=swarm.subkey_of(record.peer_id))


def test_a_newcomer_finds_its_stages_member_and_the_watch_sees_its_record_once_stored(tmp_path):
    old = SwarmDHT.start()
    swarms = [old]
    try:
        newcomer = SwarmDHT.start(initial_peers=old.visible_maddrs())
        swarms.append(newcomer)
        watcher = SwarmDHT.start(initial_peers=old.visible_maddrs(), client_mode=True)
        swarms.append(watcher)

        async def main():
            assert await find_donor(newcomer, RUN, 3, 0, deadline_s=0.0) == (0, None)  # nobody to download from
            await announce(old, member(old.peer_id, stage=1))
            assert await find_donor(newcomer, RUN, 3, 0, deadline_s=0.0) == (0, None)  # another stage's member
            await announce(old, member(old.peer_id))
            before = time.time()
            donors, found = await find_donor(newcomer, RUN, 3, 0, deadline_s=20.0)
            assert donors == 1 and before <= found <= time.time()

            watch, stop = tmp_path / "watch", asyncio.Event()
            watch.write_text("0\n")
            watching = asyncio.create_task(watch_for_newcomer(watcher, RUN, watch, stop))
            while not (tmp_path / "watch.armed").exists():  # the stage's members as they were
                assert not watching.done(), watching
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)
            assert not (tmp_path / "watch.seen").exists()  # the old member is not news
            stored = time.time()
            await announce(newcomer, member(newcomer.peer_id, phase="weight_sync"))
            await asyncio.wait_for(watching, 20.0)
            seen = json.loads((tmp_path / "watch.seen").read_text())
            assert seen["peer_id"] == newcomer.peer_id and seen["seen"] >= stored

        asyncio.run(main())
    finally:
        for swarm in reversed(swarms):
            swarm.shutdown()
