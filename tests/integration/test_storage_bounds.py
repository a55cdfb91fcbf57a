"""A peer's DHT storage under a flood, over real hivemind DHT peers: one owner's stores past its
bound are refused and counted, another owner's still go in, and nothing held is evicted."""

from __future__ import annotations

import pytest

from agora.auth.authority import RunAuthority
from agora.dht.keys import units_key
from agora.dht.records import UnitBlockRecord, WorkerRecord
from agora.dht.security import DHTSecurity
from agora.dht.storage_bounds import StorageLimits
from agora.dht.swarm import SwarmDHT

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

RUN = "bound-run"


def worker_record(peer: SwarmDHT) -> WorkerRecord:
    return WorkerRecord(peer_id=peer.peer_id, run_id=RUN, endpoint="127.0.0.1:50051", stage=0, n_stages=2,
                        throughput=10.0, queue_depth=0, step=1, phase="member", version="0.1.0",
                        updated_at=peer.clock(), fingerprint="seed=0")


def test_a_flood_from_one_owner_is_refused_over_its_bound_while_honest_stores_succeed(tmp_path):
    """A peer that alone serves the stores of two client-mode peers, with a bound of 8 entries per
    owner: the flooding trainer's 9th block is refused, a worker's record still goes in."""
    authority = RunAuthority(tmp_path / "ca", run_id=RUN)
    dirs = {name: authority.mint(tmp_path / name, role=role, stage=stage).directory
            for name, role, stage in (("small", "operator", None), ("flooder", "trainer", None),
                                      ("honest", "worker", 0))}
    small = SwarmDHT.start(security=DHTSecurity.from_state_dir(dirs["small"],
                                                               limits=StorageLimits(max_entries_per_owner=8)))
    clients: list[SwarmDHT] = []
    try:
        for name in ("flooder", "honest"):
            clients.append(SwarmDHT.start(initial_peers=small.visible_maddrs(), client_mode=True,
                                          security=DHTSecurity.from_state_dir(dirs[name])))
        flooder, honest = clients

        def block(index: int) -> UnitBlockRecord:
            return UnitBlockRecord.build(flooder.peer_id, RUN, index, {index * 256}, {}, flooder.clock())

        stored = [flooder.store(units_key(RUN, i), block(i), 600, subkey=flooder.subkey_of(flooder.peer_id))
                  for i in range(12)]
        assert stored == [True] * 8 + [False] * 4
        assert flooder.store(units_key(RUN, 0), block(0), 600, subkey=flooder.subkey_of(flooder.peer_id))
        assert honest.announce_worker(worker_record(honest), ttl=60)  # another owner: room as before
        small.refresh_bans(max_age_s=0)  # the node's read of its DHT process, counts included
        assert small.bans.refused().get("storage") == 4
    finally:
        for peer in (*clients, small):
            peer.shutdown()
