"""Whose work a worker takes for a unit: the unit's holder in the lease queue, as the DHT says.

Work keys are global and predictable ("u12m3": node/replica/work_ledger.py), and a worker applies a
key's gradient once. Without more, a trainer that sends one-token microbatches under the keys of
units it does not hold turns every honest gradient for them into a dropped repeat, and a
completed-batch report of any unit moves the stage's count. So a worker with caller identities
(mutual TLS) takes a training Forward carrying work key ``u{unit}m{i}``, and a Step reporting
unit ``u`` done, only from the trainer that holds the unit: its live claim wins, or it committed
the unit (``resolve``, dht/leases.py), as this worker reads the unit's block from the DHT. The
caller is its credential's peer id (node/rpc/auth_check.py), which is also its DHT peer id (the
node key is both), so the two name the same trainer. A head or body applies a Forward's gradient
at its Backward, which only the Forward's caller may send (node/replica/compute.py), so checking
the Forward covers both. Under ``--insecure`` there are no identities and nothing is checked.

Design choices:

- ``work_permission`` is the pure decision (the work key's form, the microbatch index within the
  run's ``train.microbatches``, the holder); ``UnitHolders`` keeps the DHT reads behind it.
- Reads are cached per block (a block is 256 units, one read) and shared. A call the cached view
  does not show as the caller's unit waits for a read started after the call arrived, so it sees
  every claim its trainer confirmed before sending (the trainer reads its claim back before it
  runs the unit: dht/leases.py); only if the holder is someone else after that is it refused. A
  block is read by one read at a time, which serves every call that arrived before it started, so
  however many calls ask, reads of a block follow each other at most back to back. And a caller
  refused is refused from the cache for ``refusal_memory_s`` after, without a read: a trainer that
  sends work of units it does not hold costs the DHT one read per that time, not one per call.
  Honest callers are not refused, so they never wait for that.
- The first microbatch of a unit new to this worker would wait for that read, at every stage in
  turn (about 65 ms a read on the loaded demo machine, once per unit and stage). So a block that
  holders' work came from lately is read again every ``refresh_s`` (0.5 s) in the background, while
  work comes: a trainer claims a unit well before its work reaches a worker (it claims its next
  units while it runs the current one), so the claim is usually in the cache by then, and a call
  waits only when it is not. The cost is two DHT reads a second per worker while it trains.
- Where the worker asks, and how a head or body keeps its Forwards from waiting on the DHT:
  node/worker/work_gate.py.
- A read that fails (the DHT does not answer) refuses nothing and admits nothing: the call is
  UNAVAILABLE, and the trainer tries again or elsewhere (``LeaseUnavailable``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, Optional

from agora.dht.leases import UnitState, resolve
from agora.dht.record_fields import BLOCK_UNITS, MAX_UNIT_BLOCKS
from agora.dht.records import UnitBlockRecord

__all__ = ["LeaseUnavailable", "UnitHolders", "WorkRefused", "parse_work_key", "unit_of_forward", "work_permission"]

# The work key a trainer gives a unit's microbatch (node/trainer/trainer.py): u<unit>m<index>.
_WORK_KEY = re.compile(r"u(0|[1-9][0-9]{0,15})m(0|[1-9][0-9]{0,8})")
_UNITS = MAX_UNIT_BLOCKS * BLOCK_UNITS  # units the lease queue can hold (dht/record_fields.py)

logger = logging.getLogger("agora.node.worker")

ReadBlock = Callable[[int], Awaitable[Mapping[str, UnitBlockRecord]]]


class WorkRefused(Exception):
    """A unit's work or report refused; `malformed`: the request itself is wrong (INVALID_ARGUMENT),
    else its caller does not hold the unit (PERMISSION_DENIED)."""

    def __init__(self, message: str, *, malformed: bool = False):
        super().__init__(message)
        self.malformed = malformed


class LeaseUnavailable(Exception):
    """The unit's block could not be read from the DHT: nothing is decided (UNAVAILABLE)."""


def parse_work_key(work_key: str) -> Optional[tuple[int, int]]:
    """(unit, microbatch index) of a work key "u12m3", or None if it is not one."""
    match = _WORK_KEY.fullmatch(work_key)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def work_permission(unit: int, caller: str, state: Optional[UnitState]) -> Optional[str]:
    """Why `caller` may not send work or a report of `unit`, whose holder is `state` (None: not known
    yet), or None if it may."""
    if state is not None and state.holder == caller:
        return None
    if state is None or state.holder is None:
        return (f"unit {unit} is held by no trainer (no live claim and no commit in the lease queue); only the "
                "trainer that holds a unit may send its work or report it done")
    how = "committed it" if state.committed else "holds its live claim"
    return (f"unit {unit} is held by trainer {state.holder} (it {how}), not by {caller}; only the trainer that "
            "holds a unit may send its work or report it done")


def unit_of_forward(work_key: str, microbatches: int) -> int:
    """The unit a training Forward's work key names; `WorkRefused` (malformed) if it names none the
    run can have: a unit beyond the lease queue, or a microbatch index beyond `train.microbatches`."""
    parsed = parse_work_key(work_key)
    if parsed is None:
        raise WorkRefused(f"work_key: a training Forward names the unit and microbatch it trains on, "
                          f"u<unit>m<index>; got {work_key!r:.70}", malformed=True)
    unit, index = parsed
    if unit >= _UNITS or index >= microbatches:
        raise WorkRefused(f"work_key: {work_key} names unit {unit} (at most {_UNITS - 1}) and microbatch {index} "
                          f"(at most {microbatches - 1}: train.microbatches)", malformed=True)
    return unit


@dataclass(frozen=True)
class _BlockView:
    entries: Mapping[str, UnitBlockRecord]
    read_at: float  # when the read that returned them started (the clock of `UnitHolders`)


class UnitHolders:
    """The lease holders of units, read from the DHT through `read_block(block)` (see the module
    docstring). `clock`: DHT time (leases expire by it). Use on one event loop; `close()` ends the
    refresh of active blocks."""

    def __init__(self, read_block: ReadBlock, *, clock: Callable[[], float], refresh_s: Optional[float] = 0.5,
                 refusal_memory_s: float = 1.0, max_blocks: int = 64, max_callers: int = 4096):
        if (refresh_s is not None and refresh_s <= 0) or refusal_memory_s < 0 or max_blocks < 1 or max_callers < 1:
            raise ValueError(f"refresh_s must be positive or None, refusal_memory_s >= 0, max_blocks and "
                             f"max_callers >= 1, got {refresh_s}, {refusal_memory_s}, {max_blocks}, {max_callers}")
        self._read_block = read_block
        self._clock = clock
        self.refresh_s = refresh_s
        self.refusal_memory_s = refusal_memory_s
        self.max_blocks = max_blocks
        self.max_callers = max_callers
        self._views: OrderedDict[int, _BlockView] = OrderedDict()
        self._locks: dict[int, asyncio.Lock] = {}
        self._refused_at: OrderedDict[str, float] = OrderedDict()  # caller -> when it was last refused
        self._active: dict[int, float] = {}  # block -> when a holder's call was last taken from it
        self._refresher: Optional[asyncio.Task] = None
        self.reads = 0  # DHT reads made
        self.checks = 0  # calls checked
        self.waited_s = 0.0  # what the calls checked waited for reads, in all (the check's cost)

    async def check(self, unit: int, caller: str) -> None:
        """Return if `caller` holds `unit`; raise `WorkRefused` naming the holder, or `LeaseUnavailable`."""
        if not 0 <= unit < _UNITS:
            raise WorkRefused(f"unit {unit} is beyond the lease queue (units 0..{_UNITS - 1})", malformed=True)
        self.checks += 1
        asked = self._clock()
        block = unit // BLOCK_UNITS
        refusal = self._permission(block, unit, caller, asked)
        if refusal is not None and asked - self._refused_at.get(caller, -math.inf) < self.refusal_memory_s:
            self._refused(caller)  # refused a moment ago: this one is decided without a read
            raise WorkRefused(refusal)
        if refusal is not None:
            try:
                refusal = await self._read_since(block, asked, lambda: self._permission(block, unit, caller, asked))
            finally:
                self.waited_s += max(0.0, self._clock() - asked)
        if refusal is not None:
            self._refused(caller)
            raise WorkRefused(refusal)
        self._active[block] = asked
        self._keep_fresh()

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
            self._refresher = None

    def summary(self) -> str:
        return (f"{self.checks} calls checked, {self.reads} DHT reads, {1e3 * self.waited_s:.0f} ms waited for them "
                "in all")

    def _permission(self, block: int, unit: int, caller: str, now: float) -> Optional[str]:
        view = self._views.get(block)
        return work_permission(unit, caller, None if view is None else resolve(unit, view.entries, now))

    def _refused(self, caller: str) -> None:
        self._refused_at[caller] = self._clock()
        self._refused_at.move_to_end(caller)
        if len(self._refused_at) > self.max_callers:
            self._refused_at.popitem(last=False)

    async def _read_since(self, block: int, asked: float, refusal: Callable[[], Optional[str]]) -> Optional[str]:
        """`refusal()` on a view of `block` that allows the call or was read no earlier than `asked`:
        one read for another call meanwhile, or one read now (one read of a block at a time)."""
        async with self._locks.setdefault(block, asyncio.Lock()):
            view = self._views.get(block)
            if (view is not None and view.read_at >= asked) or refusal() is None:
                return refusal()  # read for another call that came after this one, or since allowed
            await self._read(block)
        return refusal()

    async def _read(self, block: int) -> None:
        """Read `block` now (its lock held) and keep it."""
        started = self._clock()
        try:
            entries = await self._read_block(block)
        except Exception as error:
            raise LeaseUnavailable(f"the lease of units {block * BLOCK_UNITS}..{(block + 1) * BLOCK_UNITS - 1} "
                                   f"could not be read from the DHT: {error}") from None
        self.reads += 1
        self._views[block] = _BlockView(entries, started)
        self._views.move_to_end(block)
        while len(self._views) > self.max_blocks:
            forgotten, _ = self._views.popitem(last=False)
            self._locks.pop(forgotten, None)
            self._active.pop(forgotten, None)

    def _keep_fresh(self) -> None:
        if self.refresh_s is not None and self._refresher is None:
            self._refresher = asyncio.ensure_future(self._refresh_active())

    async def _refresh_active(self) -> None:
        """Read again, every `refresh_s`, the blocks holders' work came from lately (see the module
        docstring); a block without work for four refreshes is left until a call asks again."""
        while True:
            await asyncio.sleep(self.refresh_s)
            now = self._clock()
            for block, last in list(self._active.items()):
                if now - last > 4 * self.refresh_s:
                    del self._active[block]
                    continue
                view = self._views.get(block)
                if view is not None and now - view.read_at < self.refresh_s:
                    continue  # read lately for a call
                try:
                    async with self._locks.setdefault(block, asyncio.Lock()):
                        await self._read(block)
                except LeaseUnavailable as error:  # the next call reads again, or the next refresh
                    logger.debug("%s", error)
