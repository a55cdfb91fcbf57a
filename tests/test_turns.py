"""Synchronous mode's order of accumulation (node/trainer/turns.py), without sockets."""

from __future__ import annotations

import asyncio

import pytest

from agora.node.trainer.turns import AccumulationOrder, BatchAbandoned

pytestmark = pytest.mark.timeout(30)


def test_calls_accumulate_in_index_order_whatever_order_they_arrive_in():
    async def main():
        order, log = AccumulationOrder(2), []

        async def call(stage: int, index: int, delay: float):
            await asyncio.sleep(delay)  # microbatch 2 reaches the stage first, 0 last
            async with order.turn(stage, index):
                log.append((stage, index))

        await asyncio.gather(call(1, 0, 0.03), call(1, 2, 0.0), call(1, 1, 0.01), call(0, 1, 0.0), call(0, 0, 0.02))
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
        await asyncio.sleep(0.01)
        assert not waiting.done()  # 0 failed: 1 still waits for it
        async with order.turn(0, 0):  # the rerun of 0 goes, then 1
            pass
        await waiting
        stuck = asyncio.ensure_future(_enter(order, 3))  # 2 never comes
        await asyncio.sleep(0.01)
        await order.abandon()
        with pytest.raises(BatchAbandoned):
            await stuck

    asyncio.run(main())


async def _enter(order: AccumulationOrder, index: int) -> None:
    async with order.turn(0, index):
        pass
