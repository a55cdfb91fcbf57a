"""Who a trainer tells that a global batch is done (node/trainer/batch_reports.py), with a client
that records its calls: the reports' own logic, no worker behind them."""

import asyncio

from agora.node.trainer.batch_reports import REMEMBERED_S, CompletedBatchReports
from agora.node.trainer.routing import Roster, WorkerView
from agora.node.trainer.stats import TrainerStats


class Told:
    """The completed-batch reports each worker got, as (unit, replicas)."""

    def __init__(self):
        self.by_peer: dict[str, list[int]] = {}

    def client(self, view: WorkerView):
        told = self

        class Client:
            async def batch_done(self, batch, microbatches, replicas, *, timeout_s=None):
                told.by_peer.setdefault(view.peer_id, []).append(batch)

        return Client()


def _views(*placed):
    return [WorkerView(peer, f"127.0.0.1:{9000 + i}", stage) for i, (peer, stage) in enumerate(placed)]


def test_a_worker_a_refresh_missed_is_still_told_for_a_while_and_a_moved_or_excluded_one_is_not():
    now = [0.0]
    roster, told = Roster(microbatch_size=1), Told()
    reports = CompletedBatchReports(roster, told.client, TrainerStats(), microbatches=4, call_timeout_s=5.0,
                                    clock=lambda: now[0])

    async def send(unit, stage=0):
        reports.send(unit, stage)
        await reports.drain()

    async def main():
        roster.refresh(_views(("a", 0), ("b", 0), ("c", 0), ("t", 1)))
        await send(0)
        roster.refresh(_views(("a", 0), ("c", 0), ("t", 1)))  # b's record late on the DHT
        now[0] = 10.0
        await send(1)
        roster.refresh(_views(("a", 0), ("c", 1), ("t", 1)))  # c moved to stage 1; b still missing
        roster.exclude("a")  # a lied
        now[0] = REMEMBERED_S - 1  # b last in the roster at 0
        await send(2)
        now[0] = REMEMBERED_S + 1  # b missing for longer than that: not told again
        await send(3)
        await send(3, stage=1)

    asyncio.run(main())
    assert told.by_peer == {"a": [0, 1], "b": [0, 1, 2], "c": [0, 1, 3], "t": [3]}
