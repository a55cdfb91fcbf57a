"""Which global batches (work units) a trainer runs: a fixed list, or leases on the DHT.

`SwarmTrainer.run` asks its unit source for the next unit whenever its window of global batches
has room, tells it when a unit is committed (every stage took its completed-batch report) or has
failed here, and ends when the source says every unit of the run is committed.

- `FixedUnits`: a list decided up front (tests without a DHT; a lone trainer that must run
  exactly units start..N-1 in order, as the synchronous mode's exact restore does), such as the
  trainer's static stripe of the run (`assigned_units`).
- `LeasedUnits` (dht/leases.py underneath): a trainer claims the lowest free unit, preferring
  its own stripe (`unit % trainers == index`) among the next `16 x trainers` so that trainers
  rarely race for the same unit, renews its leases every third of their length while it runs them, and
  commits them when done. A unit whose lease ran out (its trainer died) is free again and is
  taken by whoever gets there: "reclaimed". Faster trainers take more units, a restarted trainer
  resumes from the queue, and the run ends when every unit is committed, not when a trainer has
  done its share. A claim is a store and two reads a round trip apart (dht/leases.py), so a trainer
  claiming one unit when it has room for it ran at most one unit per claim's time (2 a second at
  80 ms links), whatever its window: it claims a window's worth ahead instead (``next_unit``'s
  ``ahead``), together in one claim, topped up in the background as units are handed out, so the
  next unit is there when a global batch ends. Units claimed ahead are renewed like the rest and
  given back by ``close``. What a trainer saw happen to units (claimed, committed, reclaimed, duplicate,
  conflict, released, lost) is counted in its metrics. It holds at most `MAX_CLAIMS` units at once (what
  peers keep of one trainer's claims in a block; far more than its window of global batches).
- Two trainers can both read back their claim of a unit when one's store lands late (a loaded
  DHT), and both run it. The workers settle it: each takes a unit's work only from its holder as
  the lease queue says (node/worker/unit_holders.py), and refuses the other's naming the unit
  (`UnitNotHeld`). The trainer refused then reads the unit's block again (`holds`, through
  `UnitHold`): held by another, the unit is lost here and every microbatch of it stops; still its
  own, the worker had read the queue before its claim landed, and the call is made again.
- `next_candidates` is the pure decision: which units to try, in order, given what the trainer
  knows of each unit now.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Callable, Mapping, Optional, Protocol

from agora.dht.leases import LeaseBoard, UnitState
from agora.dht.record_fields import BLOCK_UNITS
from agora.dht.records import MAX_CLAIMS
from agora.node.trainer.stats import TrainerStats

__all__ = ["FRUITLESS_CLAIM_ROUNDS", "UnitSource", "FixedUnits", "LeasedUnits", "UnitHold", "UnitLost", "assigned_units",
           "next_candidates"]

logger = logging.getLogger("agora.node.trainer")

# Units beyond the lowest unfinished one a trainer considers, per trainer of the run: its own
# stripe first among them, so it takes another's units (work stealing, a dead trainer's stripe)
# only once its own are done this far ahead.
_HORIZON_PER_TRAINER = 16
# How stale a trainer's view of a block may be when it looks for work (a read is one DHT get).
_REFRESH_S = 1.0
# How long a unit read back as still held here counts as held for further refusals of its work.
_HOLD_CONFIRMED_S = 1.0
# Claim rounds in a row that won nothing before a trainer waits for the next call (others hold the units).
FRUITLESS_CLAIM_ROUNDS = 3


class UnitLost(RuntimeError):
    """Another trainer holds the unit this trainer was running, as a worker and the lease queue say."""


class UnitSource(Protocol):
    total: int

    async def next_unit(self, ahead: int = 0) -> Optional[int]:
        """A unit this trainer now holds, or None when none is free right now. ``ahead``: how many
        more the trainer may be running at once (a leased source claims them before they are asked for)."""

    def finished(self) -> bool:
        """Every unit of the run is committed (as far as this trainer has seen)."""

    async def committed(self, unit: int) -> None: ...

    async def failed(self, unit: int) -> None: ...

    async def holds(self, unit: int) -> bool:
        """Whether this trainer still holds `unit` (its live claim, or its commit), read now."""

    async def close(self) -> None: ...


def assigned_units(total_steps: int, trainer_index: int, trainers: int, start: int = 0) -> list[int]:
    """Static striping of the run's global batches over trainers, from `start` (without a DHT: tests,
    and the exact restore of a synchronous run)."""
    return [unit for unit in range(trainer_index, total_steps, trainers) if unit >= start]


class FixedUnits:
    """The units of a list, in its order; each handed out once."""

    def __init__(self, units: list[int], total: int):
        self.total = total
        self._todo = list(units)
        self._open: set[int] = set()

    async def next_unit(self, ahead: int = 0) -> Optional[int]:
        if not self._todo:
            return None
        unit = self._todo.pop(0)
        self._open.add(unit)
        return unit

    def finished(self) -> bool:
        return not self._todo and not self._open

    async def committed(self, unit: int) -> None:
        self._open.discard(unit)

    async def failed(self, unit: int) -> None:
        self._open.discard(unit)
        self._todo.insert(0, unit)  # it runs again here: nobody else would

    async def holds(self, unit: int) -> bool:
        return True  # a unit of the list is this trainer's alone

    async def close(self) -> None:
        pass


def next_candidates(states: Mapping[int, UnitState], *, low: int, total: int, now: float,
                    stripe: Optional[tuple[int, int]] = None, limit: int = 8) -> list[int]:
    """Units to try claiming, in order: free ones (unknown, no live claim, not committed) from `low`
    on; with `stripe` (index, trainers), this trainer's own among the next few first."""
    trainers = stripe[1] if stripe else 1
    horizon = max(limit, _HORIZON_PER_TRAINER * trainers)
    free = []
    unit = low
    while unit < total and len(free) < horizon:
        state = states.get(unit)
        if state is None or (not state.committed and (state.holder is None or state.expires_at <= now)):
            free.append(unit)
        unit += 1
    if stripe is not None:
        index, trainers = stripe
        free.sort(key=lambda u: (u % trainers != index, u))
    return free[:limit]


class LeasedUnits:
    """Units claimed through a `LeaseBoard` (see the module docstring)."""

    def __init__(self, board: LeaseBoard, *, total: int, start: int = 0, stripe: Optional[tuple[int, int]] = None,
                 stats: Optional[TrainerStats] = None, clock: Callable[[], float], refresh_s: Optional[float] = None):
        self.board = board
        self.total = total
        self.stripe = stripe if stripe is not None and stripe[1] > 1 else None
        self.stats = stats
        self._clock = clock
        self._refresh_s = refresh_s if refresh_s is not None else min(board.lease_s / 4, _REFRESH_S)
        self._states: dict[int, UnitState] = {}
        self._read_at: dict[int, float] = {}  # block -> when this trainer last read it
        self._low = start  # every unit below is committed (or before this run's start)
        self._held: set[int] = set()  # claimed here and not committed: running, or ready to run
        self._ready: list[int] = []  # held, not handed out yet (claimed ahead)
        self._claiming: Optional[asyncio.Task] = None  # the claim round in flight, if any
        self._renewing: Optional[asyncio.Task] = None

    def finished(self) -> bool:
        self._advance()
        return self._low >= self.total

    async def next_unit(self, ahead: int = 0) -> Optional[int]:
        if self._renewing is None:
            self._renewing = asyncio.create_task(self._renew_forever(), name="lease-renewal")
        if not self._ready:
            await self._claim_round(1 + ahead)
        if not self._ready:
            return None
        unit = self._ready.pop(0)
        if len(self._ready) < ahead and self._claiming is None:
            self._claiming = asyncio.create_task(self._claim_round(ahead), name="claim-ahead")
        return unit

    async def _claim_round(self, target: int) -> None:
        """Claim units until ``target`` are ready, in rounds of one claim each (``LeaseBoard.claim_many``);
        one round at a time: a caller finding a round in flight waits for it."""
        while self._claiming is not None and self._claiming is not asyncio.current_task():
            await asyncio.gather(asyncio.shield(self._claiming), return_exceptions=True)
            if self._ready:  # the round in flight claimed what the caller waits for
                return
        try:
            await self._claim_until(target)
        except Exception as error:  # a DHT hiccup ahead of need: the next call claims again
            if asyncio.current_task() is not self._claiming:
                raise
            logger.warning("could not claim units ahead: %s", error)
        finally:
            if asyncio.current_task() is self._claiming:
                self._claiming = None

    async def _claim_until(self, target: int) -> None:
        me = self.board.peer_id
        fruitless = 0
        await self._refresh()
        while len(self._ready) < target:
            room = min(target - len(self._ready), MAX_CLAIMS - len(self._held))  # more: peers refuse the entry
            candidates = next_candidates(self._states, low=self._low, total=self.total, now=self._clock(),
                                         stripe=self.stripe)[:room]
            if not candidates:
                return
            before = {unit: self._states.get(unit) for unit in candidates}
            held = await self.board.claim_many(candidates)
            for unit in held:
                self._held.add(unit)
                self._ready.append(unit)
                # Never free to this trainer while it holds it, however long it waits or runs: the
                # renewer keeps the lease, and an expiry read here would have it claimed and run again.
                self._states[unit] = UnitState(unit, me, False)
                self._count("claimed")
                if before[unit] is not None and before[unit].expired_claims:
                    self._count("reclaimed")
                    logger.info("lease reclaimed: unit %d (another trainer's lease ran out)", unit,
                                extra={"milestone": "lease_reclaimed", "fields": {"unit": unit}})
            lost = [unit for unit in candidates if unit not in held]
            for unit in lost:
                self._count("conflict")  # another trainer holds it: look again at its block
                self._read_at.pop(LeaseBoard.block_of(unit), None)
            if lost:
                await self._refresh()
            fruitless = 0 if held else fruitless + 1
            if fruitless >= FRUITLESS_CLAIM_ROUNDS:
                return

    async def committed(self, unit: int) -> None:
        state = await self.board.commit(unit)
        self._held.discard(unit)
        self._states[unit] = UnitState(unit, self.board.peer_id, True, committers=state.committers)
        self._count("committed")
        if state.committers > 1:
            self._count("duplicate")
            logger.warning("unit %d was committed by %d trainers (a duplicate)", unit, state.committers)
        self._advance()

    async def failed(self, unit: int) -> None:
        self._held.discard(unit)
        await self.board.release(unit)
        self._states.pop(unit, None)
        self._count("released")

    async def holds(self, unit: int) -> bool:
        block = LeaseBoard.block_of(unit)
        state = (await self.board.read(block)).get(unit)
        if state is not None and state.holder == self.board.peer_id:
            return True
        if unit in self._held:
            self._held.discard(unit)  # not renewed any more; `failed` withdraws the claim
            self._count("lost")
            logger.warning("unit %d is held by trainer %s, not this one: it stops here", unit,
                           None if state is None else state.holder,
                           extra={"milestone": "unit_lost", "fields": {"unit": unit}})
        self._read_at.pop(block, None)
        return False

    async def close(self) -> None:
        for task in (self._renewing, self._claiming):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._renewing = self._claiming = None
        self._ready.clear()
        for unit in sorted(self._held):  # not done here: free for another trainer at once
            try:
                await self.board.release(unit)
            except Exception as error:  # the DHT is going away too: the lease just runs out
                logger.debug("could not release unit %d: %s", unit, error)
        self._held.clear()

    async def _refresh(self) -> None:
        """Read the blocks between the lowest unfinished unit and the horizon if not read lately."""
        now = self._clock()
        trainers = self.stripe[1] if self.stripe else 1
        last = min(self.total, self._low + max(8, _HORIZON_PER_TRAINER * trainers)) - 1
        if last < self._low:
            return
        for block in range(LeaseBoard.block_of(self._low), LeaseBoard.block_of(last) + 1):
            if now - self._read_at.get(block, -math.inf) < self._refresh_s:
                continue
            fresh = await self.board.read(block)
            first = block * BLOCK_UNITS
            for unit in range(first, first + BLOCK_UNITS):
                if unit in self._held:
                    continue  # this trainer's own view of what it holds is the truth
                if unit in fresh:
                    self._states[unit] = fresh[unit]
                elif unit in self._states and not self._states[unit].committed:
                    del self._states[unit]  # a claim that was withdrawn
            self._read_at[block] = now
        self._advance()

    def _advance(self) -> None:
        while self._low < self.total and (state := self._states.get(self._low)) is not None and state.committed:
            self._low += 1

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.board.lease_s / 3)
            if self._held:
                try:
                    await self.board.renew(sorted(self._held))
                except Exception as error:  # a DHT hiccup: the next renewal is a third of a lease away
                    logger.warning("could not renew unit leases: %s", error)

    def _count(self, outcome: str) -> None:
        if self.stats is not None:
            self.stats.unit(outcome)


class UnitHold:
    """Whether this trainer still holds the unit it runs, asked when a worker refuses its work of it
    (module docstring): one read of the lease queue at a time, a unit read back as held counts as
    held for `_HOLD_CONFIRMED_S`, and once lost it is lost for every microbatch of the unit."""

    def __init__(self, unit: int, source: UnitSource, clock: Callable[[], float]):
        self.unit, self._source, self._clock = unit, source, clock
        self.lost = False
        self._confirmed_at = -math.inf
        self._lock = asyncio.Lock()

    async def confirm(self) -> bool:
        """True while the unit is this trainer's; False (and `lost`) once another trainer holds it."""
        async with self._lock:
            if not self.lost and self._clock() - self._confirmed_at >= _HOLD_CONFIRMED_S:
                if await self._source.holds(self.unit):
                    self._confirmed_at = self._clock()
                else:
                    self.lost = True
            return not self.lost
