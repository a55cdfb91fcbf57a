"""Leased work units (dht/leases.py, node/trainer/units.py): the rules, pure, then over a real DHT."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer

from agora.auth.authority import RunAuthority
from agora.auth.keys import hivemind_private_key, openssh_public_key
from agora.auth.node_state import CREDENTIAL_FILE, NodeCredentials
from agora.dht.entry_value import credential_attachment
from agora.dht.security import OwnedRecordValidator, OwnerSignatureValidator
from agora.dht.leases import LeaseBoard, UnitState, resolve
from agora.dht.keys import owned_subkey, units_key
from agora.dht.record_fields import BLOCK_UNITS, RecordError
from agora.dht.records import UnitBlockRecord
from agora.dht.entry_reader import Stored
from agora.node.rpc.server import run
from agora.node.trainer.units import FixedUnits, LeasedUnits, UnitHold, next_candidates

pytestmark = pytest.mark.timeout(120)


def block_record(peer: str, block: int = 0, committed=(), claims=None) -> UnitBlockRecord:
    return UnitBlockRecord.build(peer, "run", block, set(committed), claims or {}, 10.0)


# ---------------------------------------------------------------- records and rules (pure)


def test_a_block_record_round_trips_and_refuses_malformed_packing():
    record = block_record("A", 1, committed={256, 300, 511}, claims={257: (5.0, 35.0), 400: (6.0, 36.0)})
    again = UnitBlockRecord.from_wire(record.to_wire())
    assert again == record and again.dht_key() == "run.units.b1"
    assert again.committed_units() == {256, 300, 511} and again.claimed_units() == {257: (5.0, 35.0),
                                                                                     400: (6.0, 36.0)}
    wire = record.to_wire()
    with pytest.raises(RecordError, match="units.committed: data should have at least 32 bytes"):
        UnitBlockRecord.from_wire({**wire, "committed": b"\x00"})
    with pytest.raises(RecordError, match="whole number of claims"):
        UnitBlockRecord.from_wire({**wire, "claims": b"\x00" * 5})
    with pytest.raises(RecordError, match="units.block"):
        units_key("run", 4096)


def test_a_commit_beats_any_claim_and_the_earliest_live_claim_wins():
    now = 100.0
    entries = {"A": block_record("A", claims={3: (50.0, 130.0)}), "B": block_record("B", claims={3: (40.0, 90.0)}),
               "C": block_record("C", claims={3: (60.0, 140.0)})}
    state = resolve(3, entries, now)
    assert (state.holder, state.committed, state.expires_at, state.expired_claims) == ("A", False, 130.0, 1)
    entries["D"] = block_record("D", committed={3})
    entries["E"] = block_record("E", committed={3})
    state = resolve(3, entries, now)
    assert (state.holder, state.committed, state.committers) == ("D", True, 2)  # E's commit: a duplicate
    assert resolve(4, entries, now) == UnitState(4, None, False)



class _SlowStoreBoard:
    """An in-memory stand-in for the DHT under one block key, where a peer's stores can land late
    (the race the confirming read is for); the clock is set by the test."""

    def __init__(self):
        self.entries: dict[str, Stored] = {}
        self.now = 0.0
        self.full_reads: list[bool] = []  # per read: whether it asked for the whole beam (never a quick read)
        self.stores: list[str] = []  # per store: the peer that sent it

    def peer(self, peer_id: str, store_delay_s: float = 0.0):
        board = self

        class Peer:
            def __init__(self):
                self.peer_id = peer_id

            def clock(self):
                return board.now

            def subkey_of(self, peer):
                return peer

            async def store_async(self, key, record, ttl, *, subkey=None):
                board.stores.append(peer_id)
                await asyncio.sleep(store_delay_s)
                board.entries[subkey] = Stored(record, board.now + ttl)
                return True

            async def owned_entries_async(self, key, record_type, *, full=False):
                board.full_reads.append(full)
                return dict(board.entries)

        return Peer()


def test_a_later_claim_read_before_the_earlier_one_landed_does_not_win_too():
    """Trainer A claims first but its store lands late; B claims a moment later and its first read
    sees only itself. The confirming read a round trip later sees A's earlier claim: B withdraws,
    so exactly one trainer runs the unit."""
    dht = _SlowStoreBoard()

    async def main():
        a = LeaseBoard(dht.peer("A", store_delay_s=0.02), run_id="run", lease_s=30.0)
        b = LeaseBoard(dht.peer("B"), run_id="run", lease_s=30.0)
        a_claims = asyncio.create_task(a.claim(3))
        await asyncio.sleep(0)  # A has stamped its claim and is storing it
        dht.now = 1.0
        b_won = await b.claim(3)
        return await a_claims, b_won

    a_won, b_won = run(main())
    assert (a_won, b_won) == (True, False)
    assert resolve(3, {peer: item.record for peer, item in dht.entries.items()}, dht.now).holder == "A"
    assert not dht.entries["B"].record.claimed_units()  # B's claim was withdrawn

def test_a_claims_reads_and_a_commits_read_back_visit_the_whole_beam_a_scan_may_be_quick():
    """A quick read stops at one holder, which may lack a rival's claim (dht/reads.py)."""
    dht = _SlowStoreBoard()

    async def main():
        board = LeaseBoard(dht.peer("A"), run_id="run", lease_s=30.0)
        await board.read(0)
        scan = list(dht.full_reads)
        dht.full_reads.clear()
        assert await board.claim(3)
        await board.commit(3)
        return scan, dht.full_reads

    scan, decisions = run(main())
    assert scan == [False]
    assert decisions == [True, True, True, True]  # its own commits taken back, the claim's two reads, the commit's


def test_two_winners_of_a_late_store_are_settled_by_holds_and_the_later_one_loses_the_unit():
    """A's store lands after B's whole claim (store, read, settle, read): both read back their claim
    and both run the unit. Refused by a worker, B asks the queue: the earlier claim is A's, so B
    loses the unit (stops renewing it, counts it lost) and A still holds it; a `UnitHold` asked again
    answers from what it learnt, without another read."""
    dht = _SlowStoreBoard()

    async def main():
        a = LeasedUnits(LeaseBoard(dht.peer("A", store_delay_s=0.3), run_id="run", lease_s=30.0), total=8,
                        clock=lambda: dht.now)
        b = LeasedUnits(LeaseBoard(dht.peer("B"), run_id="run", lease_s=30.0), total=8, clock=lambda: dht.now)
        a_claims = asyncio.create_task(a.board.claim(0))
        await asyncio.sleep(0)  # A has stamped its claim at time 0 and is storing it
        dht.now = 1.0
        b_won = await b.next_unit()
        a_won = await a_claims
        hold = UnitHold(0, b, clock=lambda: dht.now)
        reads = []
        original = b.board.read

        async def counted(block):
            reads.append(block)
            return await original(block)
        b.board.read = counted
        held = [await hold.confirm(), await hold.confirm()]
        return a_won, b_won, await a.holds(0), held, hold.lost, reads, 0 in b._held

    a_won, b_won, a_holds, b_held, lost, reads, still_renewed = run(main())
    assert (a_won, b_won) == (True, 0)  # both read their claim back twice
    assert a_holds and b_held == [False, False] and lost and reads == [0] and not still_renewed


def test_a_trainer_holds_no_more_units_than_peers_keep_claims_of(monkeypatch):
    monkeypatch.setattr("agora.node.trainer.units.MAX_CLAIMS", 2)
    dht = _SlowStoreBoard()

    async def main():
        board = LeaseBoard(dht.peer("A"), run_id="run", lease_s=30.0)
        units = LeasedUnits(board, total=10, clock=lambda: dht.now)
        try:
            held = [await units.next_unit() for _ in range(3)]
            await units.committed(held[0])
            return held, await units.next_unit()
        finally:
            await units.close()

    assert run(main()) == ([0, 1, None], 2)


def test_a_windows_worth_is_claimed_ahead_in_one_claim_handed_out_without_one_and_given_back_on_close():
    dht = _SlowStoreBoard()

    def claimed(peer: str) -> set[int]:
        return set(dht.entries[peer].record.claimed_units())

    async def main():
        units = LeasedUnits(LeaseBoard(dht.peer("A"), run_id="run", lease_s=30.0), total=10, clock=lambda: dht.now)
        first = await units.next_unit(ahead=2)  # nothing ready: one claim of three units
        after_first = (len(dht.stores), dht.full_reads.count(True), claimed("A"))
        second = await units.next_unit(ahead=2)  # ready: no claim waited for; one unit topped up behind
        assert units._claiming is not None
        await units._claiming
        after_second = (len(dht.stores), claimed("A"), list(units._ready))
        await units.close()
        return first, second, after_first, after_second, claimed("A")

    first, second, after_first, after_second, at_close = run(main())
    assert (first, second) == (0, 1)
    assert after_first == (1, 3, {0, 1, 2})  # one store, its two reads (and a fresh board's own entry taken back)
    assert after_second == (2, {0, 1, 2, 3}, [2, 3])
    assert at_close == set()  # running or ready, every claim is given back


def test_a_unit_held_past_its_first_lease_is_never_claimed_again_by_its_holder():
    """Units claimed ahead wait, and a unit runs, longer than a lease on slow links (the renewer keeps
    the lease): the holder must not see its own claim as run out and claim and run the unit twice."""
    dht = _SlowStoreBoard()

    async def main():
        units = LeasedUnits(LeaseBoard(dht.peer("A"), run_id="run", lease_s=30.0), total=10, clock=lambda: dht.now)
        handed = [await units.next_unit(ahead=2)]  # 0 runs; 1 and 2 wait, claimed ahead
        dht.now = 45.0  # past the first lease of all three (renewed meanwhile, in the product)
        handed.append(await units.next_unit(ahead=2))
        await units._claiming  # the top-up behind it
        ready = list(units._ready)
        await units.close()
        return handed, ready

    handed, ready = run(main())
    assert handed == [0, 1]
    assert ready == [2, 3]  # the next free unit, not 0, 1 or 2 again


def test_a_claim_ahead_that_meets_a_rivals_units_takes_the_next_free_ones_and_leaves_the_rivals_alone():
    dht = _SlowStoreBoard()

    async def main():
        rival = LeaseBoard(dht.peer("B"), run_id="run", lease_s=30.0)
        assert await rival.claim_many([1, 2]) == [1, 2]
        dht.now = 1.0  # B's claims are the earlier ones
        units = LeasedUnits(LeaseBoard(dht.peer("A"), run_id="run", lease_s=30.0), total=10, clock=lambda: dht.now)
        units._refresh_s = math.inf  # its view of the block is the one before B's claims: the claim meets them
        units._read_at[0] = -1.0
        first = await units.next_unit(ahead=2)
        return first, list(units._ready)

    first, ready = run(main())
    assert (first, ready) == (0, [3, 4])
    states = {peer: item.record for peer, item in dht.entries.items()}
    assert {u: resolve(u, states, dht.now).holder for u in range(5)} == {0: "A", 1: "B", 2: "B", 3: "A", 4: "A"}


def test_candidates_are_free_units_from_the_lowest_unfinished_own_stripe_first():
    now = 10.0
    states = {0: UnitState(0, "X", True), 1: UnitState(1, "X", False, expires_at=20.0),
              2: UnitState(2, "X", False, expires_at=5.0)}  # unit 2's lease ran out
    assert next_candidates(states, low=0, total=10, now=now, limit=4) == [2, 3, 4, 5]
    assert next_candidates(states, low=0, total=10, now=now, stripe=(1, 2), limit=4) == [3, 5, 7, 9]
    assert next_candidates(states, low=0, total=4, now=now, stripe=(1, 2)) == [3, 2]  # then others' units
    assert next_candidates(states, low=10, total=10, now=now) == []


def test_fixed_units_hand_out_a_list_and_take_back_a_failed_one():
    async def main():
        units = FixedUnits([4, 6], total=8)
        first = await units.next_unit()
        await units.failed(first)
        order = [await units.next_unit(), await units.next_unit(), await units.next_unit()]
        finished_early = units.finished()
        for unit in order[:2]:
            await units.committed(unit)
        return order, finished_early, units.finished()

    assert run(main()) == ([4, 6, None], False, True)


def test_peers_keep_only_unit_entries_written_under_a_trainer_credential_of_that_peer_judged_as_issued(tmp_path):
    # The run's CA was made two hours ago, when a trainer got a one-hour credential: expired now.
    past = RunAuthority(tmp_path / "auth", run_id="lease-run", clock=lambda: time.time() - 7200)
    old = past.mint(tmp_path / "old", role="trainer", lifetime_s=3600)
    authority = RunAuthority(tmp_path / "auth")
    trainer = authority.mint(tmp_path / "trainer", role="trainer", lifetime_s=60)
    worker = authority.mint(tmp_path / "worker", role="worker", stage=0, lifetime_s=60)
    other = RunAuthority(tmp_path / "other", run_id="lease-run").mint(tmp_path / "x", role="trainer")
    # What every admitted peer's DHT process runs on each store and each found value.
    peer = CompositeValidator([OwnerSignatureValidator(), OwnedRecordValidator("lease-run", authority.root_pem)])

    def entry(writer: NodeCredentials, carrying: NodeCredentials) -> DHTRecord:
        """``writer``'s entry for block 0, signed by its key, carrying ``carrying``'s chain."""
        record = UnitBlockRecord.build(writer.peer_id, "lease-run", 0, {3}, {}, time.time())
        unsigned = DHTRecord(DHTID.generate(source=units_key("lease-run", 0)).to_bytes(),
                             MSGPackSerializer.dumps(owned_subkey(writer.peer_id, openssh_public_key(writer.key).decode())),
                             MSGPackSerializer.dumps(record.to_wire()) + credential_attachment(
                                 (carrying.directory / CREDENTIAL_FILE).read_bytes()), time.time() + 60)
        return dataclasses.replace(unsigned, value=OwnerSignatureValidator(hivemind_private_key(writer.key))
                                   .sign_value(unsigned))

    assert peer.validate(entry(trainer, trainer))
    assert old.identity().not_after < time.time()
    assert peer.validate(entry(old, old))  # its commits still count
    assert not peer.validate(entry(worker, worker))  # a worker cannot commit units
    assert not peer.validate(entry(worker, trainer))  # nor under a trainer's chain
    assert not peer.validate(entry(other, other))  # a trainer of another root


# ---------------------------------------------------------------- over a real DHT


B_LEASE_S = 4.0


def test_two_trainers_claim_apart_a_dead_ones_lease_runs_out_and_is_reclaimed(dht_pair):
    run_id = f"lease-{uuid.uuid4().hex[:8]}"

    async def main():
        a = LeaseBoard(dht_pair[0], run_id=run_id, lease_s=1.5)
        # B's lease must outlast the four DHT operations between its claim of 6 and A's try at it (at a
        # load of 18 they took longer than 1.5 s, and A got the unit B held).
        b = LeaseBoard(dht_pair[1], run_id=run_id, lease_s=B_LEASE_S)
        assert await a.claim(5)
        assert not await b.claim(5)  # A holds it
        assert await b.claim(6)
        state = await a.commit(5)
        assert state.committed and state.committers == 1
        seen = await b.read(0)
        assert seen[5].committed and seen[6].holder == dht_pair[1].peer_id
        # B dies holding 6 (no renewal, no release): A takes it once the lease has run out.
        assert not await a.claim(6)
        deadline = time.monotonic() + B_LEASE_S + 10
        while (await a.read(0))[6].expired_claims != 1:  # B's lease runs out B_LEASE_S after its claim
            assert time.monotonic() < deadline, "B's lease never ran out"
            await asyncio.sleep(0.1)
        assert (await a.read(0))[6].expired_claims == 1
        assert await a.claim(6)
        await a.commit(6)
        # A restarted with the same identity knows its commits (it rewrites its entry with them).
        again = LeaseBoard(dht_pair[0], run_id=run_id, lease_s=1.5)
        assert await again.claim(7)
        await again.commit(7)
        return await b.read(0)

    final = run(main())
    assert {u for u, s in final.items() if s.committed} == {5, 6, 7}
    assert all(s.holder == dht_pair[0].peer_id for s in final.values())


def test_every_unit_is_committed_once_and_none_is_lost_when_a_trainer_dies(dht_pair):
    """Two trainers drain 40 units; one dies (stops, leases unreleased) a third of the way in."""
    run_id = f"lease-{uuid.uuid4().hex[:8]}"
    total = 40

    async def drain(units: LeasedUnits, done: list[int], die_after: int | None = None) -> None:
        while not units.finished():
            unit = await units.next_unit()
            if unit is None:
                await asyncio.sleep(0.1)
                continue
            if die_after is not None and len(done) >= die_after:
                units._renewing.cancel()  # gone: holds `unit`, never renews nor releases it
                return
            await asyncio.sleep(0.02)  # the global batch itself
            await units.committed(unit)
            done.append(unit)

    async def main():
        boards = [LeaseBoard(s, run_id=run_id, lease_s=1.5) for s in dht_pair]
        units = [LeasedUnits(board, total=total, stripe=(i, 2), clock=board._swarm.clock)
                 for i, board in enumerate(boards)]
        done: list[list[int]] = [[], []]
        await asyncio.gather(drain(units[0], done[0]), drain(units[1], done[1], die_after=total // 6))
        await units[0].close()
        final = {}
        for block in range(math.ceil(total / BLOCK_UNITS)):
            final.update(await boards[0].read(block))
        return done, final

    done, final = run(main())
    everything = done[0] + done[1]
    assert sorted(everything) == list(range(total))  # every unit once, none lost
    assert all(final[u].committed and final[u].committers == 1 for u in range(total))
    assert len(done[1]) == total // 6 and len(done[0]) == total - total // 6  # the survivor took the rest
