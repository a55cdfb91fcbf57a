"""A hostile trainer's lease entries over a real, admitted DHT: a worker's DHT peer stores the run's
unit blocks, an honest trainer claims units through its `LeaseBoard`, and a squatter (a trainer
credential of the run) stores what `UnitBlockRecord.build` would never build, straight at the
worker's peer (tests/helpers/hostile_dht.py). The rules themselves: tests/unit/test_lease_bounds.py."""

from __future__ import annotations

import asyncio

import pytest

from agora.auth.authority import RunAuthority
from agora.dht.leases import LeaseBoard
from agora.dht.keys import units_key
from agora.dht.security import DHTSecurity, OwnedRecordValidator
from agora.dht.swarm import SwarmDHT
from agora.node.rpc.server import run
from hostile_dht import CLAIM, LEASE_ANSWERS, hostile_entry, lease_holds, store_at

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

RUN = "leasebounds"


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    """(the worker's DHT peer, which stores; the honest trainer's; the squatter's)."""
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
        yield started
    finally:
        for swarm in reversed(started):
            swarm.shutdown()


def store(squatter: SwarmDHT, worker: SwarmDHT, wire: dict, block: int = 0):
    """The worker's answer to the squatter's store (hostile_dht.store_at's answers)."""
    return store_at(squatter, worker.peer_id, units_key(RUN, block), wire)


async def _refusals(_dht, node) -> tuple[dict, dict]:
    """Run in the worker's DHT process: what its authorizer and record validator refused, by kind."""
    validator = next(v for v in node.protocol.record_validator._validators if isinstance(v, OwnedRecordValidator))
    return node.protocol.authorizer.refused.snapshot(), validator.refused.snapshot()


def test_back_dated_long_and_stale_claims_are_refused_by_peers_and_honest_claims_are_unaffected(peers):
    worker, honest, squatter = peers
    answers = {name: store(squatter, worker, wire) for name, wire in lease_holds(squatter, RUN, 3).items()}
    assert answers == LEASE_ANSWERS
    assert worker.hivemind_dht.run_coroutine(_refusals) == ({"units.updated_at": 2}, {"units.claims": 2})
    # The squatter's honest-looking claim of another unit is stored and read like any other.
    later = squatter.clock()
    assert store(squatter, worker, hostile_entry(squatter, RUN, claims=CLAIM.pack(4, later, later + 30),
                                                 updated_at=later)) == [True]

    async def main():
        board = LeaseBoard(honest, run_id=RUN, lease_s=30.0)
        assert 3 not in await board.read(0)  # none of the squatter's claims reached a reader
        assert await board.claim(3)  # nothing the squatter sent stands in its way
        return await board.read(0)

    states = run(main())
    assert states[3].holder == honest.peer_id and not states[3].committed
    assert states[4].holder == squatter.peer_id


def test_an_honest_trainer_s_renewals_and_commits_pass_every_bound(peers):
    _, honest, squatter = peers

    async def main():
        board = LeaseBoard(honest, run_id=RUN, lease_s=30.0)
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
