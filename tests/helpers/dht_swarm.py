"""A swarm of real hivemind DHT peers on loopback, each bootstrapped from the first, a stage-0 worker
entry to store in it, and whether a peer holds a key: what the tests of how peers read and store a
stage's entries share; and a swarm of peers admitted to a run."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from hivemind.dht.routing import DHTID

from agora.auth.authority import RunAuthority
from agora.dht import SwarmDHT, WorkerRecord
from agora.dht.security import DHTSecurity


PEERS = 6


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[SwarmDHT]]:
    """Six peers shared by a module's tests (each start spawns a p2pd and takes a second or two)."""
    with dht_swarm(PEERS) as peers:
        yield peers


@contextmanager
def dht_swarm(peers: int) -> Iterator[list[SwarmDHT]]:
    first = SwarmDHT.start()
    swarm = [first]
    try:
        for _ in range(peers - 1):
            swarm.append(SwarmDHT.start(initial_peers=first.visible_maddrs()))
        yield swarm
    finally:
        for peer in reversed(swarm):
            peer.shutdown()


@contextmanager
def admitted_swarm(base: Path, run_id: str, names: tuple[str, ...] = ("a", "b", "c")) -> Iterator[list[SwarmDHT]]:
    """Peers admitted to ``run_id`` as stage-0 workers by one authority (in ``base``), each
    bootstrapped from the first, in the order of ``names`` (their state directories under ``base``)."""
    authority = RunAuthority(base / "authority", run_id=run_id)
    for name in names:
        authority.mint(base / name, role="worker", stage=0)
    swarm = [SwarmDHT.start(security=DHTSecurity.from_state_dir(base / names[0]))]
    try:
        for name in names[1:]:
            swarm.append(SwarmDHT.start(initial_peers=swarm[0].visible_maddrs(),
                                        security=DHTSecurity.from_state_dir(base / name)))
        yield swarm
    finally:
        for peer in reversed(swarm):
            peer.shutdown()


def worker_entry(run_id: str, peer_id: str, step: int = 10) -> WorkerRecord:
    return WorkerRecord(peer_id=peer_id, run_id=run_id, endpoint="127.0.0.1:50051", stage=0, n_stages=2,
                        throughput=1.0, queue_depth=0, step=step, phase="member", version="1", updated_at=1.0,
                        fingerprint="seed=0;stages=2;basis=b;data=d;config=c")


class _Holds:
    """Whether a peer's own storage holds a key. Runs in that peer's DHT process."""

    def __init__(self, key: str) -> None:
        self.key = key

    async def __call__(self, _dht, node) -> bool:
        return node.protocol.storage.get(DHTID.generate(source=self.key)) is not None


class Remembered:
    """The holders this peer's reads and stores of ``key`` go to without a search, nearest first, as
    {node id: peer id} (empty: none remembered). Runs in that peer's DHT process."""

    def __init__(self, key: str) -> None:
        self.key = key

    async def __call__(self, _dht, node) -> dict[int, str]:
        from agora.dht import holders  # this process's memory, not a copy pickled with the call
        found = holders.HOLDERS._found.get(DHTID.generate(source=self.key))
        return {} if found is None else {int(node_id): str(peer_id) for node_id, peer_id in found.holders.items()}


def held_by(peer: SwarmDHT, key: str) -> bool:
    return peer.hivemind_dht.run_coroutine(_Holds(key))
