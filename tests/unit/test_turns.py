"""Synchronous mode's order of accumulation (node/trainer/turns.py), without sockets."""

from __future__ import annotations

import asyncio

import pytest

from agora.node.trainer.turns import AccumulationOrder, BatchAbandoned

pytestmark = pytest.mark.timeout(30)


def test_calls_accumulate_in_index_order_whatever_order_they_arrive_in():
    async def main():
        order, log = AccumulationOrder(2), []

        async def call(stage: int, index: int):
            async with order.turn(stage, index):
                log.append((stage, index))

        # Started latest first: microbatch 2 reaches stage 1 before 1 and 0 do.
        calls = [asyncio.ensure_future(call(1, 2)), asyncio.ensure_future(call(1, 1)),
                 asyncio.ensure_future(call(0, 1))]
        await asyncio.sleep(0)  # let them all reach their turn's wait
        assert log == []  # nothing goes before microbatch 0
        await asyncio.gather(call(1, 0), call(0, 0), *calls)
        return log

    log = asyncio.run(main())
    assert [i for s, i in log if s == 1] == [0, 1, 2] and [i for s, i in log if s == 0] == [0, 1]


def test_a_failed_call_keeps_its_turn_and_a_batch_given_up_releases_every_waiter():
    async def main():
        order = AccumulationOrder(1)
        with pytest.raises(ConnectionError):
            async with order.turn(0, 0):
                raise ConnectionError("the route failed")
        waiting = asyncio.ensure_future(_enter(order, 1))
        await asyncio.sleep(0)
        assert not waiting.done()  # 0 failed: 1 still waits for it
        async with order.turn(0, 0):  # the rerun of 0 goes, then 1
            pass
        await waiting
        stuck = asyncio.ensure_future(_enter(order, 3))  # 2 never comes
        await asyncio.sleep(0)
        assert not stuck.done()
        await order.abandon()
        with pytest.raises(BatchAbandoned):
            await stuck

    asyncio.run(main())


async def _enter(order: AccumulationOrder, index: int) -> None:
    async with order.turn(0, index):
        pass
