"""A hostile trainer's lease entries over a real, admitted DHT: a worker's DHT peer stores the run's
unit blocks, an honest trainer claims units through its `LeaseBoard`, and a squatter (a trainer
credential of the run) stores what `UnitBlockRecord.build` would never build, straight through
hivemind. The rules themselves: tests/unit/test_lease_bounds.py."""

from __future__ import annotations

import asyncio
import functools
import struct

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer

from agora.auth.authority import RunAuthority
from agora.auth.node_state import CREDENTIAL_FILE
from agora.dht.leases import LeaseBoard, UnitWriters
from agora.dht.records import UnitBlockRecord, units_key
from agora.dht.security import DHTSecurity, OwnedRecordValidator
from agora.dht.swarm import SwarmDHT
from agora.node.rpc.server import run

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

RUN = "leasebounds"
_CLAIM = struct.Struct("<Hdd")


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    """(the worker's DHT peer, which stores; the honest trainer's; the squatter's), with their state dirs."""
    base = tmp_path_factory.mktemp("lease-bounds")
    authority = RunAuthority(base / "ca", run_id=RUN)
    dirs = [authority.mint(base / name, role=role, stage=stage).directory
            for name, role, stage in (("worker", "worker", 0), ("honest", "trainer", None),
                                      ("squatter", "trainer", None))]
    started: list[SwarmDHT] = []
    try:
        started.append(SwarmDHT.start(security=DHTSecurity.from_state_dir(dirs[0])))
        for state_dir in dirs[1:]:
            started.append(SwarmDHT.start(initial_peers=started[0].visible_maddrs(), client_mode=True,
                                          security=DHTSecurity.from_state_dir(state_dir)))
        yield started, dirs, authority.root_pem
    finally:
        for swarm in reversed(started):
            swarm.shutdown()


def hostile_entry(squatter: SwarmDHT, chain: bytes, *, claims: bytes, updated_at: float, block: int = 0) -> dict:
    """The squatter's entry in wire form with any claims and time (no `build`, no checks), carrying
    its trainer chain as every entry must for readers to count it (dht/leases.py's UnitWriters)."""
    honest = UnitBlockRecord.build(squatter.peer_id, RUN, block, set(), {}, updated_at, chain)
    return {**honest.to_wire(), "claims": claims}


async def _store_at(_dht, node, *, target: str, key: str, subkey: str, wire: dict, expiration: float):
    """Run in the squatter's DHT process: one store RPC at ``target``, its value signed and its
    credential attached by the squatter's own validators, as hivemind's store does."""
    key_id = DHTID.generate(source=key)
    record = DHTRecord(key_id.to_bytes(), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(wire), expiration)
    value = node.protocol.record_validator.sign_value(record)
    answer = await node.protocol.call_store(PeerID.from_base58(target), [key_id], [value], expiration,
                                            subkeys=[subkey])
    return None if answer is None else list(answer)


def store_at(squatter: SwarmDHT, worker: SwarmDHT, wire: dict, block: int = 0):
    """The worker's answer to the squatter's store: [True] stored, [False] refused by its record
    validator, None refused by its authorizer (no answer at all). Straight at the worker: hivemind's
    own store would answer with the squatter's own copy first."""
    store = functools.partial(_store_at, target=worker.peer_id, key=units_key(RUN, block),
                              subkey=squatter.subkey_of(squatter.peer_id), wire=wire,
                              expiration=squatter.clock() + 60)
    return squatter.hivemind_dht.run_coroutine(store, return_future=True).result(20)


async def _refusals(_dht, node) -> tuple[dict, dict]:
    """Run in the worker's DHT process: what its authorizer and record validator refused, by kind."""
    validator = next(v for v in node.protocol.record_validator._validators if isinstance(v, OwnedRecordValidator))
    return node.protocol.authorizer.refused.snapshot(), validator.refused.snapshot()


def test_back_dated_long_and_stale_claims_are_refused_by_peers_and_honest_claims_are_unaffected(peers):
    (worker, honest, squatter), dirs, root_pem = peers
    chain = (dirs[2] / CREDENTIAL_FILE).read_bytes()
    now = squatter.clock()
    refused = {
        # Claimed at the dawn of time, expiring at its end: the earliest claim, held for good.
        "eternal": hostile_entry(squatter, chain, claims=_CLAIM.pack(3, -1e300, 1e300), updated_at=now),
        # Dated two hours back with an ordinary lease: it would win every contest for unit 3.
        "back-dated": hostile_entry(squatter, chain, claims=_CLAIM.pack(3, now - 7200, now + 30), updated_at=now),
        # Consistent in itself, but written five minutes ago: its claim is dated back by the store's time.
        "stale": hostile_entry(squatter, chain, claims=_CLAIM.pack(3, now - 310, now + 200), updated_at=now - 300),
        # Written an hour ahead: a claim that expires then, made "later" than any honest one.
        "ahead": hostile_entry(squatter, chain, claims=_CLAIM.pack(3, now + 3590, now + 3620), updated_at=now + 3600),
    }
    answers = {name: store_at(squatter, worker, wire) for name, wire in refused.items()}
    assert answers == {"eternal": [False], "back-dated": [False], "stale": None, "ahead": None}
    assert worker.hivemind_dht.run_coroutine(_refusals) == ({"units.updated_at": 2}, {"units.claims": 2})
    # The squatter's honest-looking claim of another unit is stored and read like any other.
    later = squatter.clock()
    assert store_at(squatter, worker, hostile_entry(squatter, chain, claims=_CLAIM.pack(4, later, later + 30),
                                                    updated_at=later)) == [True]

    async def main():
        writers = UnitWriters(root_pem, RUN, dirs[1])
        board = LeaseBoard(honest, run_id=RUN, lease_s=30.0, writers=writers)
        assert 3 not in await board.read(0)  # none of the squatter's claims reached a reader
        assert await board.claim(3)  # nothing the squatter sent stands in its way
        return await board.read(0)

    states = run(main())
    assert states[3].holder == honest.peer_id and not states[3].committed
    assert states[4].holder == squatter.peer_id


def test_an_honest_trainer_s_renewals_and_commits_pass_every_bound(peers):
    (_, honest, squatter), dirs, root_pem = peers

    async def main():
        board = LeaseBoard(honest, run_id=RUN, lease_s=30.0, writers=UnitWriters(root_pem, RUN, dirs[1]))
        for unit in (300, 301):
            assert await board.claim(unit)
        await board.renew([300, 301])
        await asyncio.sleep(0.05)
        await board.renew([300])
        state = await board.commit(301)
        return state, await board.read(1)

    state, seen = run(main())
    assert state.committed and state.committers == 1
    assert seen[300].holder == honest.peer_id and seen[300].expires_at > honest.clock()
