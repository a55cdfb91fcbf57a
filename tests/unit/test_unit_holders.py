"""Whose work of a unit a worker takes (node/worker/unit_holders.py): the decision, pure, and the
cache of DHT reads behind it, over an in-memory lease board instead of the DHT. Over real gRPC and
a real DHT: tests/integration/test_unit_binding.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from agora.dht.leases import UnitState
from agora.dht.records import UnitBlockRecord
from agora.node.rpc.server import run
from agora.node.worker.unit_holders import (LeaseUnavailable, UnitHolders, WorkRefused, parse_work_key,
                                            unit_of_forward, work_permission)

pytestmark = pytest.mark.timeout(60)


def test_a_work_key_names_a_unit_and_a_microbatch_of_the_run():
    assert parse_work_key("u12m3") == (12, 3) and parse_work_key("u0m0") == (0, 0)
    for bad in ("", "u12", "m3", "u-1m0", "u012m3", "u1m03", "u1m2x", "x12m3", "u" + "9" * 17 + "m0", "eval0.1"):
        assert parse_work_key(bad) is None, bad
    assert unit_of_forward("u12m3", microbatches=4) == 12
    for key, needle in (("u12m4", "microbatch 4 (at most 3: train.microbatches)"),
                        ("u1048576m0", "unit 1048576 (at most 1048575)"), ("", "u<unit>m<index>; got ''")):
        with pytest.raises(WorkRefused, match=needle.replace("(", r"\(").replace(")", r"\)")) as refused:
            unit_of_forward(key, microbatches=4)
        assert refused.value.malformed


def test_only_the_holder_of_a_unit_may_send_its_work():
    assert work_permission(5, "A", UnitState(5, "A", False, 100.0)) is None
    assert work_permission(5, "A", UnitState(5, "A", True)) is None  # it committed it: late calls still count
    assert "unit 5 is held by trainer B (it holds its live claim), not by A" in work_permission(
        5, "A", UnitState(5, "B", False, 100.0))
    assert "held by trainer B (it committed it)" in work_permission(5, "A", UnitState(5, "B", True))
    assert "unit 5 is held by no trainer" in work_permission(5, "A", UnitState(5, None, False))
    assert "held by no trainer" in work_permission(5, "A", None)


class Board:
    """The lease queue as the worker reads it: every trainer's entry per block, and what reads cost."""

    def __init__(self):
        self.entries: dict[int, dict[str, UnitBlockRecord]] = {}
        self.reads = 0
        self.fail = False
        self.gate = asyncio.Event()
        self.gate.set()

    def claim(self, trainer: str, unit: int, *, commit: bool = False) -> None:
        now = time.monotonic()
        block = unit // 256
        self.entries.setdefault(block, {})[trainer] = UnitBlockRecord.build(
            trainer, "run", block, {unit} if commit else set(), {} if commit else {unit: (now, now + 30)}, now)

    async def read(self, block: int):
        self.reads += 1
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("no answer within 10 s")
        return dict(self.entries.get(block, {}))


def holders(board: Board, memory_s: float = 0.0) -> UnitHolders:
    return UnitHolders(board.read, clock=time.monotonic, refusal_memory_s=memory_s, refresh_s=None)


def test_the_holder_s_calls_are_served_from_one_read_and_a_claim_made_since_is_read_once():
    board = Board()
    board.claim("A", 3)

    async def main():
        units = holders(board)
        for _ in range(5):
            await units.check(3, "A")
        first = board.reads
        board.claim("A", 4)  # A's next unit, claimed after the worker's read
        await units.check(4, "A")
        return first, board.reads

    assert run(main()) == (1, 2)


def test_a_non_holder_is_refused_naming_the_holder_after_one_fresh_read():
    board = Board()
    board.claim("A", 3)
    board.claim("B", 300, commit=True)

    async def main():
        units = holders(board)
        await units.check(3, "A")
        refusals = []
        for unit, caller in ((3, "M"), (4, "M"), (300, "M")):
            with pytest.raises(WorkRefused) as refused:
                await units.check(unit, caller)
            refusals.append(str(refused.value))
        return refusals, board.reads

    refusals, reads = run(main())
    assert "unit 3 is held by trainer A (it holds its live claim), not by M" in refusals[0]
    assert "unit 4 is held by no trainer" in refusals[1]
    assert "unit 300 is held by trainer B (it committed it)" in refusals[2]
    assert reads == 1 + 2 + 1  # A's read, then one fresh read per refusal of block 0, one of block 1


def test_a_flood_of_calls_for_units_not_held_costs_the_dht_a_read_per_refusal_memory_not_per_call():
    board = Board()
    board.claim("A", 3)

    async def main():
        units = holders(board, memory_s=60.0)  # nothing is forgotten within the test
        await units.check(3, "A")
        board.gate.clear()  # the next read hangs until every call has asked
        calls = [asyncio.ensure_future(units.check(3 + i % 2, f"M{i % 5}")) for i in range(50)]
        await asyncio.sleep(0.01)
        board.gate.set()
        flood = await asyncio.gather(*calls, return_exceptions=True)
        after_flood = board.reads
        for unit in range(100):  # the same callers again, one call at a time, over several blocks
            with pytest.raises(WorkRefused):
                await units.check(unit * 100, f"M{unit % 5}")
        await units.check(3, "A")  # the holder is served from the cache all along
        return flood, after_flood, board.reads

    flood, after_flood, reads = run(main())
    assert all(isinstance(outcome, WorkRefused) and not outcome.malformed for outcome in flood)
    # A's read; one for the flood's first call; one for every call that came while that one was read.
    assert after_flood == 3
    assert reads == after_flood  # each caller was refused a moment ago: no read more


def test_a_read_that_fails_decides_nothing_and_the_next_call_reads_again():
    board = Board()
    board.claim("A", 3)

    async def main():
        units = holders(board)
        board.fail = True
        with pytest.raises(LeaseUnavailable, match="units 0..255 could not be read from the DHT: no answer"):
            await units.check(3, "A")
        board.fail = False
        await units.check(3, "A")
        with pytest.raises(WorkRefused, match="beyond the lease queue") as beyond:
            await units.check(2**20, "A")
        return beyond.value.malformed, board.reads

    assert run(main()) == (True, 2)


def test_a_block_holders_work_comes_from_is_read_again_in_the_background_so_the_next_unit_waits_for_none():
    board = Board()
    board.claim("A", 3)

    async def main():
        units = UnitHolders(board.read, clock=time.monotonic, refresh_s=0.01)
        try:
            await units.check(3, "A")
            board.claim("A", 4)  # A's next unit, claimed after the worker's read
            while board.reads < 2:  # the refresh reads the block again (a poll, no timing asserted)
                await asyncio.sleep(0.01)
            waited, reads = units.waited_s, board.reads
            await units.check(4, "A")  # in the cache already: no read, no wait
            return units.waited_s == waited, board.reads == reads
        finally:
            await units.close()

    assert run(main()) == (True, True)
