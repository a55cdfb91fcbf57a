"""Leased work units on the DHT: which trainer runs which global batch, so that none is lost.

The run's schedule is units 0..N-1 (a unit is one global batch: pipeline/data.py). A trainer
claims a unit with a lease, renews it while the unit runs, and commits it once every stage has
taken the unit's completed-batch report; a lease that expires (its trainer died, hung, or lost
its link) makes the unit free again for any trainer. This is seed 000's shared work queue, held
in the DHT instead of a bucket.

Design choices:

- Units are grouped in blocks of ``BLOCK_UNITS``; each trainer owns one entry per block it has
  touched, under its own subkey of ``{run}.units.b{block}`` (owned and signed like every per-peer
  entry: dht/security.py). The entry holds the block's units it committed (a bitmap) and its
  live claims (unit, claimed at, expires at; packed). One read of a block gives every trainer's
  view of 256 units, so scanning for work costs one DHT get per 256 units, and a trainer's whole
  history in a block is one value it rewrites.
- Who holds a unit is a pure function of those entries (``resolve``): a commit beats any claim
  (the earliest commit if there are several: the others are duplicates); among live claims the
  earliest ``claimed_at`` wins, ties by peer id. Every reader resolves alike.
- Claiming is store, read, wait, read again: a trainer stores its claim and reads the block back;
  it holds the unit only if it resolves as the holder both then and once more after waiting as
  long again as that store and read took (at least ``CLAIM_SETTLE_S``), else it withdraws the
  claim. The second read is there for the race of two claims within one round trip: the earlier
  claim wins, but its store may land after the later claimant's first read, which then believes
  it won. Waiting a round trip lets that store land. What is left (a store slower than the
  other side's whole claim) shows as a duplicate commit, which is counted; trainers also prefer
  different units (``next_candidates``), so claims rarely race at all. A trainer claims the units
  it will run next together (``claim_many``): one block's claims share that store, wait and reads.
  A claim's reads (and a commit's read back) visit the whole search beam every time (``full``): a
  quick read stops at one holder, which may lack the rival claim the others hold (dht/reads.py); so
  does the read that takes back a restarted trainer's own commits. A worker counts a unit's
  completed-batch report once (node/replica/epoch.py), so a duplicate never steps a replica twice,
  but both trainers' gradients reach it: duplicates are worth the extra read.
- Commits outlive their trainer: an entry lives ``COMMIT_TTL_S`` (rewritten with a later
  expiry on every change), so a trainer restarted with the same identity, or another one, sees
  which units are done and resumes from the queue.
- Only trainers' entries count. Any admitted peer may store under its own subkey, so a worker
  could write commits and end the run untrained; each entry therefore carries its writer's
  credential chain, as every typed entry does (dht/security.py), and every admitted peer's DHT
  validator keeps only entries whose chain this run's CA issued to a trainer (or the operator) of
  that peer id, on each store and on each value a find returns, so a reader sees no other. The
  chain is judged as issued, not as valid now: the DHT refused the store unless the writer's
  credential was live then, and a trainer's commits must outlive its one-hour credentials. Under
  ``--insecure`` every entry counts.
- Clocks: ``claimed_at`` and expiries are DHT time (hivemind's ``get_dht_time``, injected as the
  swarm's clock), so leases compare across peers as far as their clocks agree; the lease is
  seconds long, far beyond NTP's skew.
- Every time a trainer states is bounded, because the earliest ``claimed_at`` wins: a claim dated
  far back would win every contest, and one expiring far ahead would hold its unit for good. So
  peers keep an entry only if its claims lie near its ``updated_at`` (claimed by then, expiring
  within the longest lease ``MAX_LEASE_S`` after it, at most ``MAX_CLAIMS`` of them: records.py's
  ``claim_problem``), and store it only if ``updated_at`` is now (dht/store_checks.py; a read
  refuses one ahead of now). A bound on the lease alone (expiry minus claim) would not do: a
  back-dated claim with a short lease still wins. A claim is also held by renewals for at most
  ``MAX_CLAIM_AGE_S`` (an hour: 120 renewals of the default 30 s lease, far longer than a global
  batch of the presets takes), so renewing forever is no hold forever: a trainer whose unit runs
  longer makes its claim anew (``renew``), claimed now, and in a contest it then ranks as a new
  claim. What the bounds leave: a trainer can still date a new claim up to ``MAX_CLAIM_AGE_S``
  back and take a unit another holds, within its ``MAX_CLAIMS``; workers then take that unit's
  work from it alone (node/worker/unit_holders.py), and its credential is not free.
"""

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Mapping, Optional

from agora.dht.keys import units_key
from agora.dht.record_fields import BLOCK_UNITS
from agora.dht.records import MAX_CLAIM_AGE_S, MAX_LEASE_S, UnitBlockRecord
from agora.dht.swarm import SwarmDHT

__all__ = ["COMMIT_TTL_S", "CLAIM_SETTLE_S", "UnitState", "resolve", "read_block", "renewed_claim", "LeaseBoard"]

# The least a winning claimant waits before its confirming read (see "Claiming" above).
CLAIM_SETTLE_S = 0.05
# How long a trainer's block entry (its commits) lives after its last change.
COMMIT_TTL_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class UnitState:
    unit: int
    holder: Optional[str]  # the committer, or the live claim's owner; None: free
    committed: bool
    expires_at: float = math.inf  # the live claim's expiry (inf when committed or free)
    committers: int = 0  # how many trainers committed it (more than one: duplicates)
    expired_claims: int = 0  # claims whose lease ran out (a trainer that went away)


def resolve(unit: int, entries: Mapping[str, UnitBlockRecord], now: float) -> UnitState:
    """Who holds `unit` according to every trainer's entry for its block (see the module docstring)."""
    committers = sorted(peer for peer, entry in entries.items() if unit in entry.committed_units())
    if committers:
        return UnitState(unit, committers[0], True, committers=len(committers))
    live, expired = [], 0
    for peer, entry in entries.items():
        claim = entry.claimed_units().get(unit)
        if claim is None:
            continue
        claimed_at, expires_at = claim
        if expires_at > now:
            live.append((claimed_at, peer, expires_at))
        else:
            expired += 1
    if not live:
        return UnitState(unit, None, False, expired_claims=expired)
    claimed_at, peer, expires_at = min(live)
    return UnitState(unit, peer, False, expires_at, expired_claims=expired)


def renewed_claim(claimed_at: float, now: float, lease_s: float) -> tuple[float, float]:
    """A claim renewed at ``now``: its expiry a lease on, unless that would hold it longer than
    ``MAX_CLAIM_AGE_S`` (then it is made anew, claimed now; see the module docstring)."""
    if now + lease_s - claimed_at > MAX_CLAIM_AGE_S:
        return now, now + lease_s
    return claimed_at, now + lease_s


async def read_block(swarm: SwarmDHT, run_id: str, block: int, *, full: bool = False) -> dict[str, UnitBlockRecord]:
    """Every trainer's entry for `block` (the DHT's validator let only trainers' through: the module
    docstring): what ``resolve`` decides on, for trainers and workers alike. ``full``: never a quick
    read (dht/reads.py: it may miss, for one read, an entry new to this peer that one holder lacks),
    for a claim's checks, which must see a rival's claim wherever it landed."""
    stored = await swarm.owned_entries_async(units_key(run_id, block), UnitBlockRecord, full=full)
    return {peer: item.record for peer, item in stored.items()
            if item.record.run_id == run_id and item.record.block == block}


class LeaseBoard:
    """This trainer's side of the unit queue over a `SwarmDHT` (async). It keeps its own entries
    (commits and claims per block) and rewrites the one a change touches."""

    def __init__(self, swarm: SwarmDHT, *, run_id: str, lease_s: float):
        if not 0 < lease_s <= MAX_LEASE_S:
            raise ValueError(f"lease_s must be in (0, {MAX_LEASE_S:g}] (peers refuse longer leases), got {lease_s}")
        self._swarm = swarm
        self.run_id = run_id
        self.lease_s = lease_s
        self.peer_id = swarm.peer_id
        self._committed: dict[int, set[int]] = {}  # block -> units this trainer committed
        self._claims: dict[int, dict[int, tuple[float, float]]] = {}  # block -> unit -> (claimed_at, expires)
        self._loaded: set[int] = set()  # blocks whose own entry was read back from the DHT

    @staticmethod
    def block_of(unit: int) -> int:
        return unit // BLOCK_UNITS

    async def read(self, block: int) -> dict[int, UnitState]:
        """Every unit of `block` that some trainer claimed or committed, resolved now."""
        entries = await self._entries(block)
        now = self._swarm.clock()
        units: set[int] = set()
        for entry in entries.values():
            units |= entry.committed_units() | set(entry.claimed_units())
        return {unit: resolve(unit, entries, now) for unit in units}

    async def claim(self, unit: int) -> bool:
        """Claim `unit`; True if this trainer now holds it (see the module docstring)."""
        return await self.claim_many([unit]) == [unit]

    async def claim_many(self, units: list[int]) -> list[int]:
        """Claim `units` together: those this trainer now holds, in their order. The units of one
        block share the claim's store, its two reads and its wait, so claiming k costs what one does."""
        held: set[int] = set()
        for block in sorted({self.block_of(unit) for unit in units}):
            held |= await self._claim_in(block, [unit for unit in units if self.block_of(unit) == block])
        return [unit for unit in units if unit in held]

    async def _claim_in(self, block: int, units: list[int]) -> set[int]:
        await self._load_own(block)
        now = self._swarm.clock()
        claims = self._claims.setdefault(block, {})
        for unit in units:
            claims[unit] = (now, now + self.lease_s)
        started = time.monotonic()
        await self._store(block)
        held = await self._holding(units, block)
        if held:
            await asyncio.sleep(max(CLAIM_SETTLE_S, time.monotonic() - started))
            held &= await self._holding(sorted(held), block)
        lost = [unit for unit in units if unit not in held]
        for unit in lost:
            claims.pop(unit, None)
        if lost:
            await self._store(block)
        return held

    async def _holding(self, units: list[int], block: int) -> set[int]:
        """Which of `units` this trainer holds as the block reads now (a full read)."""
        entries = await self._entries(block, full=True)
        now = self._swarm.clock()
        states = [resolve(unit, entries, now) for unit in units]
        return {state.unit for state in states if state.holder == self.peer_id and not state.committed}

    async def renew(self, units: list[int]) -> None:
        """Push the leases of units this trainer is still running `lease_s` into the future."""
        now = self._swarm.clock()
        touched = set()
        for unit in units:
            block = self.block_of(unit)
            claims = self._claims.get(block, {})
            if unit in claims:
                claims[unit] = renewed_claim(claims[unit][0], now, self.lease_s)
                touched.add(block)
        for block in touched:
            await self._store(block)

    async def commit(self, unit: int) -> UnitState:
        """Record `unit` done by this trainer; returns its state as read back (committers > 1: a duplicate)."""
        block = self.block_of(unit)
        await self._load_own(block)
        self._claims.get(block, {}).pop(unit, None)
        self._committed.setdefault(block, set()).add(unit)
        await self._store(block)
        return resolve(unit, await self._entries(block, full=True), self._swarm.clock())

    async def release(self, unit: int) -> None:
        """Give up a claim (the unit failed here): another trainer may take it at once."""
        block = self.block_of(unit)
        if self._claims.get(block, {}).pop(unit, None) is not None:
            await self._store(block)

    async def _entries(self, block: int, *, full: bool = False) -> dict[str, UnitBlockRecord]:
        return await read_block(self._swarm, self.run_id, block, full=full)

    async def _load_own(self, block: int) -> None:
        """Take back this trainer's earlier commits in `block` (a restart with the same identity)."""
        if block in self._loaded:
            return
        own = (await self._entries(block, full=True)).get(self.peer_id)  # rewritten without it, they'd be lost
        if own is not None:
            self._committed.setdefault(block, set()).update(own.committed_units())
        self._loaded.add(block)

    async def _store(self, block: int) -> None:
        now = self._swarm.clock()
        record = UnitBlockRecord.build(self.peer_id, self.run_id, block, self._committed.get(block, set()),
                                       self._claims.get(block, {}), now)
        await self._swarm.store_async(units_key(self.run_id, block), record, COMMIT_TTL_S,
                                      subkey=self._swarm.subkey_of(self.peer_id))
