"""What a hostile peer can state in the DHT, against the real board and the averaging loop.

Each test plays an admitted stranger who writes a well-formed record with a number no honest
replica would state, and checks that the honest side refuses it, counts it, and goes on with the
run's own schedule.
"""

from __future__ import annotations

import logging
import uuid

import pytest

from agora.dht.round_board import RoundBoard
from agora.dht.keys import rounds_key
from agora.dht.records import RoundRecord
from agora.node.averaging.loop import ROUND_LEAD, AveragingLoop
from agora.node.rpc.server import run
from agora.node.replica.local_replica import LocalReplica
from test_averaging_loop import CONFIG, SYNC, Board, ScriptedAverager, committed, vector_size

pytestmark = pytest.mark.timeout(120)


async def _announce(peer, run_id: str, round_number: int, stage: int = 0) -> None:
    record = RoundRecord(peer_id=peer.peer_id, run_id=run_id, stage=stage, round=round_number,
                         started_at=peer.clock())
    await peer.store_async(rounds_key(run_id, stage, SYNC.method), record, 60.0, subkey=peer.subkey_of(peer.peer_id))


def test_a_round_announced_past_the_stages_schedule_is_refused_once_and_named(dht_pair, caplog):
    honest, forger = dht_pair
    run_id = f"forged-{uuid.uuid4().hex[:8]}"

    async def main():
        board = RoundBoard(honest, run_id=run_id, stage=0, method=SYNC.method, ttl=10.0)
        await _announce(forger, run_id, 10**9)
        with caplog.at_level(logging.WARNING, logger="agora.dht.averaging"):
            first = await board.announced_round(at_most=7)
            again = await board.announced_round(at_most=7)
        unbounded = await board.announced_round()
        await _announce(forger, run_id, 6)  # the same writer, now a round the schedule allows
        plausible = await board.announced_round(at_most=7)
        return first, again, unbounded, plausible, dict(board.refused)

    first, again, unbounded, plausible, refused = run(main())
    assert (first, again) == (None, None)
    assert unbounded == 10**9  # without a bound the board is what it was: the loop always passes one
    assert plausible == 6
    assert refused == {"past_schedule": 1}  # one writer's one round, however often it is read
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and forger.peer_id in lines[0] and "round 1000000000" in lines[0]


def test_the_loop_keeps_its_schedule_past_a_forged_far_future_round(dht_pair):
    """One announcement of round 10**9 used to be joined (nobody else came) and then every round
    up to it was skipped: the stage's averaging was over, and a checkpoint kept it so. Now the loop
    runs the rounds its own count makes due, and the refusal is in its stats."""
    honest, forger = dht_pair
    run_id = f"forged-{uuid.uuid4().hex[:8]}"

    class Announcements(Board):  # the real board's announcements; two replicas, so rounds run
        def __init__(self, real: RoundBoard):
            super().__init__(replicas=2)
            self.real, self.refused = real, real.refused

        async def announced_round(self, at_most=None):
            return await self.real.announced_round(at_most)

    async def main():
        await _announce(forger, run_id, 10**9)
        board = Announcements(RoundBoard(honest, run_id=run_id, stage=0, method=SYNC.method, ttl=10.0))
        worker = LocalReplica(CONFIG, 1)
        averager = ScriptedAverager(vector_size(SYNC), committed)
        loop = AveragingLoop(worker, averager, SYNC, seed=CONFIG.seed, board=board, probe_s=0.01)
        await loop.start()
        try:
            assert loop.round_bound() == ROUND_LEAD
            await worker.on_compute(lambda c: setattr(c.optimizer, "steps", SYNC.every_steps * 5))
            await averager.called(1, "the round due at step 20")
            await worker.on_compute(lambda c: setattr(c.optimizer, "steps", SYNC.every_steps * 6))
            await averager.called(2, "the round due at step 24")
        finally:
            await loop.stop()
            await worker.stop()
        return [call[0] for call in averager.calls], loop.stats.snapshot()

    rounds, snapshot = run(main())
    assert rounds[:2] == [5, 6]
    assert 10**9 not in rounds and snapshot["last_round"] < 10
    assert snapshot["refused_announcements"] == {"past_schedule": 1}
