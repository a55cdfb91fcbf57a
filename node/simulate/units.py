"""Leased units in simulated time: each trainer's entry per block, read through dht/leases.py's `resolve`.

A trainer claims as node/trainer/units.py and dht/leases.py do: `next_candidates` picks the units to
try, the claim of several together is a store, a read, a wait as long as both took (at least
`CLAIM_SETTLE_S`) and a read again (a store more withdraws those lost), and it holds a unit only if
`resolve` names it holder both times; a commit is a store and a read of the block back. A store is visible to others once its DHT operation has taken its time (and its CPU where
the scenario gives one: the swarm's `dht_op`). Entries carry the two views `resolve` reads
(committed units, live claims) and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generator, Optional

import simpy

from agora.dht.leases import CLAIM_SETTLE_S, resolve
from agora.node.trainer.units import FRUITLESS_CLAIM_ROUNDS, next_candidates

__all__ = ["SimUnitEntry", "SimLeaseBoard"]


@dataclass
class SimUnitEntry:
    """One trainer's entry: what `resolve` reads of a `UnitBlockRecord`."""

    committed: set = field(default_factory=set)
    claims: dict = field(default_factory=dict)  # unit -> (claimed_at, expires_at)

    def committed_units(self) -> set[int]:
        return self.committed

    def claimed_units(self) -> dict[int, tuple[float, float]]:
        return self.claims


class SimLeaseBoard:
    """Every trainer's entry (one block is enough for a simulation's units)."""

    def __init__(self, env: simpy.Environment, *, total: int, lease_s: float, dht_op: Callable[[str], Generator]):
        self.env, self.total, self.lease_s, self.dht_op = env, total, lease_s, dht_op
        self.entries: dict[str, SimUnitEntry] = {}
        self.low = 0
        self.duplicates = 0
        self.committed: set[int] = set()  # every trainer's commits (which units `_states` resolves)

    def _state(self, unit: int):
        return resolve(unit, self.entries, self.env.now)

    def _states(self) -> dict:
        touched = {unit for entry in self.entries.values() for unit in entry.claims} | self.committed
        return {unit: self._state(unit) for unit in touched if unit >= self.low}

    def claim(self, peer: str, stripe: Optional[tuple[int, int]], count: int = 1):
        """A simpy process whose value is the units `peer` now holds (up to `count`, claimed together in
        rounds as node/trainer/units.py's `LeasedUnits` does), or an empty list."""
        entry = self.entries.setdefault(peer, SimUnitEntry())
        held: list[int] = []
        fruitless = 0
        while len(held) < count and fruitless < FRUITLESS_CLAIM_ROUNDS:
            while self.low in self.committed:
                self.low += 1
            candidates = next_candidates(self._states(), low=self.low, total=self.total, now=self.env.now,
                                         stripe=stripe)[:count - len(held)]
            if not candidates:
                break
            began = self.env.now
            yield from self.dht_op("store")
            for unit in candidates:
                entry.claims[unit] = (began, self.env.now + self.lease_s)
            yield from self.dht_op("get")  # read back
            won = [unit for unit in candidates if self._state(unit).holder == peer]
            if won:
                yield self.env.timeout(max(CLAIM_SETTLE_S, self.env.now - began))
                yield from self.dht_op("get")  # and again
                won = [unit for unit in won if self._state(unit).holder == peer]
            lost = [unit for unit in candidates if unit not in won]
            for unit in lost:
                entry.claims.pop(unit, None)
            if lost:
                yield from self.dht_op("store")  # the withdrawal
            held += won
            fruitless = 0 if won else fruitless + 1
        return held

    def renew(self, peer: str, unit: int) -> None:
        entry = self.entries[peer]
        if unit in entry.claims:
            entry.claims[unit] = (entry.claims[unit][0], self.env.now + self.lease_s)

    def commit(self, peer: str, unit: int):
        """A simpy process: the commit's store, then the block read back whole (dht/leases.py's `commit`
        reads whether another trainer committed the unit too); the trainer's batch waits for both."""
        yield from self.dht_op("store")
        entry = self.entries[peer]
        entry.claims.pop(unit, None)
        self.duplicates += unit in self.committed
        entry.committed.add(unit)
        self.committed.add(unit)
        yield from self.dht_op("get")
