"""Real hivemind averaging on loopback: grouping by round, convergence, a replica killed mid-round.

Each replica is a `SwarmDHT` + `SliceAverager` (hivemind's DHT and averager processes with their
p2pd) and, where parameters matter, a stage on its compute thread (`LocalReplica`: a StageWorker
without the gRPC server, which would make later forks unreliable) with its `AveragingLoop`. Timeouts are scaled to seconds
(`TIMEOUTS`); parts are 16 KiB so a stage slice is split over every reducer of the group.
Everything started is shut down in `finally` blocks; the killed replica is a child in its own
session, SIGKILLed as a whole (tests/helpers/averaging_victim.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from dht_swarm import worker_entry

from agora.dht.averaging import SliceAverager
from agora.dht.round_board import ANNOUNCERS, RoundBoard, announcers
from agora.dht.swarm import SwarmDHT
from agora.node.averaging.loop import AveragingLoop
from agora.node.averaging.sparta import SlicePartition, averaged_vector_size, stage_parameter_numels
from agora.node.rpc.server import run
from agora.pipeline.config import PRESETS
from agora.node.replica.local_replica import LocalReplica

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

CONFIG = PRESETS["tiny"].with_stages(3)
STAGE = 1
TIMEOUTS = dict(matchmaking_s=2.0, request_s=0.5, sender_s=2.0, reducer_s=4.0, round_s=20.0)
SYNC = dataclasses.replace(CONFIG.sync, every_steps=4, fraction=0.25, **TIMEOUTS)  # 4 slices
NUMELS = stage_parameter_numels(CONFIG.model, STAGE)
PULL, LOCAL_STEP = 0.005, 3e-5  # init std is 0.02; a replica's local steps between rounds are smaller


def vector_size(sync=SYNC) -> int:
    return averaged_vector_size(sync, SlicePartition(NUMELS, sync.n_slices, CONFIG.seed).buffer_size)


@contextlib.contextmanager
def swarm_of(n: int, prefix: str, size: int, timeouts=TIMEOUTS):
    """n DHT peers joined into one swarm, each with an averager; all shut down on exit."""
    dhts, averagers = [], []
    try:
        for _ in range(n):
            dhts.append(SwarmDHT.start(initial_peers=dhts[0].visible_maddrs() if dhts else ()))
            averagers.append(SliceAverager.start(dhts[-1].hivemind_dht, prefix=prefix, size=size,
                                                 part_size_bytes=16 * 1024, **timeouts))
        yield dhts, averagers
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


class FixedBoard:
    """A round board that knows the group size; announcements are not needed when rounds are driven."""

    def __init__(self, replicas: int):
        self.replicas_now = replicas

    async def announce(self, round_number):
        pass

    async def close(self, round_number):
        pass

    refused: dict = {}
    strangers = 0

    async def announced_round(self, at_most=None):
        return None

    async def replicas(self):
        return self.replicas_now

    def announces(self, round_number):
        return True


async def replicas_on(averagers, sync=SYNC, boards=None):
    """A stage replica and an AveragingLoop per averager; parameters pulled apart per replica (by a
    quarter of their own scale: robust averaging refuses to move a part by more than its norm)."""
    workers, loops = [], []
    for i, averager in enumerate(averagers):
        worker = LocalReplica(CONFIG, STAGE)
        generator = torch.Generator().manual_seed(100 + i)
        await worker.on_compute(lambda c: [p.data.add_(PULL * torch.randn(p.shape, generator=generator))
                                           for p in c.optimizer.parameters])
        board = boards[i] if boards else FixedBoard(len(averagers))
        loop = AveragingLoop(worker, averager, sync, seed=CONFIG.seed, board=board, probe_s=0.05)
        await loop.start()
        workers.append(worker)
        loops.append(loop)
    return workers, loops


async def stop_all(workers, loops):
    for loop in loops:
        await loop.stop()
    for worker in workers:
        await worker.stop()


def params(compute):
    return [p.detach().clone() for p in compute.optimizer.parameters]


def local_step(seed: int, samples: int = 8):
    """A small synthetic optimizer-free update, counted as `samples` trained samples."""
    def step(compute):
        generator = torch.Generator().manual_seed(seed)
        for p in compute.optimizer.parameters:
            p.data.add_(LOCAL_STEP * torch.randn(p.shape, generator=generator))
        compute.samples_total += samples
    return step


def slice_distances(a, b, partition):
    """Per slice: the largest |a - b| over the slice's elements."""
    return [float((partition.gather(a, s) - partition.gather(b, s)).abs().max()) for s in range(partition.n_slices)]


def test_groups_form_only_within_one_round_and_average_by_weight():
    with swarm_of(2, "grouping", 1000) as (_, (a, b)):
        def both(round_a, round_b, weight_a=1.0, weight_b=3.0):
            out = {}
            thread = threading.Thread(target=lambda: out.setdefault("b", b.average(
                torch.full((1000,), 1.4), round_number=round_b, weight=weight_b, group_size=2)))
            thread.start()
            out["a"] = a.average(torch.ones(1000), round_number=round_a, weight=weight_a, group_size=2)
            thread.join()
            return out["a"], out["b"]

        apart = both(5, 6)  # a replica ahead and one behind never meet
        assert [r.outcome for r in apart] == ["alone", "alone"]
        assert [r.formation_s for r in apart] == [None, None]  # no group formed
        first, second = both(7, 7)
        assert first.outcome == second.outcome == "committed"
        assert torch.allclose(first.averaged, torch.full((1000,), 1.3)) and torch.equal(first.averaged,
                                                                                       second.averaged)
        assert first.group_size == 2 and sorted(first.weights) == [1.0, 3.0] and first.received_fraction == 1.0
        assert first.bytes_sent == 4000  # 2 * (g - 1) / g of 4000 bytes
        assert all(0.0 < r.formation_s < r.duration_s for r in (first, second))
        nobody = both(8, 8, 0.0, 0.0)  # everyone syncing: no weight, no average
        assert [r.outcome for r in nobody] == ["rejected", "rejected"] and nobody[0].averaged is None


def test_replicas_that_start_apart_converge_over_one_rotation():
    async def main(averagers):
        workers, loops = await replicas_on(averagers)
        try:
            before = [await w.on_compute(params) for w in workers]
            for round_number in range(1, SYNC.n_slices + 1):  # one full rotation, training in between
                for i, worker in enumerate(workers):
                    await worker.on_compute(local_step(round_number * 10 + i))
                results = await asyncio.gather(*(loop.run_round(round_number) for loop in loops))
                assert [r.outcome for r in results] == ["committed"] * 3, [r.error for r in results]
                assert all(r.group_size == 3 and r.received_fraction == 1.0 for r in results)
            after = [await w.on_compute(params) for w in workers]
        finally:
            await stop_all(workers, loops)
        partition = SlicePartition(NUMELS, SYNC.n_slices, CONFIG.seed)
        for i in range(3):
            for j in range(i + 1, 3):
                start = slice_distances(before[i], before[j], partition)
                end = slice_distances(after[i], after[j], partition)
                # Pulled apart by PULL noise; after the rotation only the local steps since
                # each slice's round (a few LOCAL_STEP updates) separate them.
                assert all(e < 0.05 * s for s, e in zip(start, end)), (start, end)
        assert all(loop.stats.snapshot()["rounds_by_outcome"]["committed"] == SYNC.n_slices for loop in loops)

    with swarm_of(3, "converge", vector_size()) as (_, averagers):
        run(main(averagers))


def test_diloco_rounds_make_the_fragment_agree():
    sync = dataclasses.replace(SYNC, method="diloco", fragments=2)

    async def main(averagers):
        workers, loops = await replicas_on(averagers, sync)
        try:
            for round_number in (1, 2):
                for i, worker in enumerate(workers):
                    await worker.on_compute(local_step(round_number * 10 + i))
                results = await asyncio.gather(*(loop.run_round(round_number) for loop in loops))
                assert [r.outcome for r in results] == ["committed"] * 2
            after = [await w.on_compute(params) for w in workers]
        finally:
            await stop_all(workers, loops)
        partition = SlicePartition(NUMELS, 2, CONFIG.seed)
        # Fragment 0 (round 2, the last): same averaged anchor and delta, same outer step, equal
        # values. Fragment 1 (round 1): apart by the local steps taken since, not by the N(0, 1) pull.
        assert torch.allclose(partition.gather(after[0], 0), partition.gather(after[1], 0), atol=1e-5)
        assert torch.allclose(partition.gather(after[0], 1), partition.gather(after[1], 1), atol=0.05)
        assert all(bool(torch.isfinite(p).all()) for p in after[0])

    with swarm_of(2, "diloco", vector_size(sync)) as (_, averagers):
        run(main(averagers))


def test_a_closed_round_is_no_longer_announced():
    dhts = []
    try:
        for _ in range(2):
            dhts.append(SwarmDHT.start(initial_peers=dhts[0].visible_maddrs() if dhts else ()))
        a, b = (RoundBoard(dht, run_id="avg-test", stage=STAGE, method="sparta", ttl=30.0) for dht in dhts)

        async def main():
            assert await b.announced_round() is None
            await a.announce(5)
            assert await b.announced_round() == 5 and await a.announced_round() is None  # others' rounds only
            await a.close(5)
            assert await b.announced_round() is None
            await a.announce(6)
            assert await b.announced_round() == 6

        run(main())
    finally:
        for dht in dhts:
            dht.shutdown()


def test_two_replicas_of_a_stage_announce_each_round_and_every_replica_names_the_same_two():
    dhts = []
    try:
        for _ in range(4):
            dhts.append(SwarmDHT.start(initial_peers=dhts[0].visible_maddrs() if dhts else ()))
        boards = [RoundBoard(dht, run_id="avg-test", stage=0, method="sparta", ttl=30.0) for dht in dhts]
        assert all(board.announces(1) for board in boards)  # before a first count: every one

        async def main():
            for dht in dhts:
                assert dht.announce_worker(worker_entry("avg-test", dht.peer_id), ttl=60.0)
            counts = [await board.replicas() for board in boards]
            for _ in range(20):
                if counts == [4] * 4:
                    break
                await asyncio.sleep(0.25)  # stores reach every holder within a few reads
                counts = [await board.replicas() for board in boards]
            return counts

        assert run(main()) == [4] * 4
        for round_number in range(1, 31):
            named = [dht.peer_id for dht, board in zip(dhts, boards) if board.announces(round_number)]
            assert len(named) == ANNOUNCERS and frozenset(named) == announcers(round_number, boards[0].peers)
        duty = Counter(peer for r in range(1, 201) for peer in announcers(r, boards[0].peers))
        assert len(duty) == 4 and min(duty.values()) > 50  # the duty moves round to round (400 shares, 100 each)
    finally:
        for dht in dhts:
            dht.shutdown()


def test_a_slower_replica_joins_the_rounds_a_faster_one_announces():
    class TwoReplicaBoard(RoundBoard):
        async def replicas(self):
            return 2

    async def main(dhts, averagers):
        boards = [TwoReplicaBoard(dht, run_id="avg-test", stage=STAGE, method="sparta",
                                  ttl=SYNC.matchmaking_s + SYNC.request_s) for dht in dhts]
        workers, loops = await replicas_on(averagers, boards=boards)
        stop = asyncio.Event()

        async def train(worker, steps_per_tick):
            while not stop.is_set():  # the fast replica steps three times as often as the slow one
                await worker.on_compute(lambda c: setattr(c.optimizer, "steps", c.optimizer.steps + steps_per_tick))
                # What the join daemon gives a replica every heartbeat: the count the stage's others
                # announce (node/replica/epoch.py). The slow one joins rounds that far ahead, no further.
                ahead = workers[0].compute.optimizer.steps
                await workers[1].on_compute(lambda c: setattr(c, "stage_step", ahead))
                await asyncio.sleep(0.05)  # paces the synthetic training; the test waits on its outcome

        # Woken by every round either loop records, instead of polling the counters.
        recorded = asyncio.Event()
        for loop in loops:
            def record(result, applied, lag_steps=0, original=loop.stats.record):
                original(result, applied, lag_steps)
                recorded.set()
            loop.stats.record = record
        trainers = [asyncio.create_task(train(w, n)) for w, n in zip(workers, (3, 1))]
        try:
            async def three_rounds_each():
                while not all(loop.stats.rounds["committed"] >= 3 for loop in loops):
                    await recorded.wait()
                    recorded.clear()
            try:
                await asyncio.wait_for(three_rounds_each(), 60)
            except asyncio.TimeoutError:
                raise AssertionError(f"not three committed rounds each in 60 s: "
                                     f"{[loop.stats.snapshot() for loop in loops]}") from None
        finally:
            stop.set()
            await asyncio.gather(*trainers)
            await stop_all(workers, loops)
        fast, slow = (loop.stats.snapshot() for loop in loops)
        assert fast["rounds_by_outcome"]["committed"] >= 3 and slow["rounds_by_outcome"]["committed"] >= 3
        # It ran rounds its own step count had not reached: the ones the fast replica announced
        # (whether it also skipped some depends on how far ahead the fast one got between probes).
        assert slow["last_round"] > slow["local_steps"] // SYNC.every_steps, slow

    with swarm_of(2, "announce", vector_size()) as (dhts, averagers):
        run(main(dhts, averagers))


KILLED_MATCHMAKING_S = 5.0


def test_a_replica_killed_mid_round_is_dropped_and_the_survivors_go_on():
    size = vector_size()
    round_number = 6

    async def wait_for(handshake, line: str) -> None:
        # The victim's handshake pipe: a line when it gets there, end of file if it died first.
        got = await asyncio.wait_for(asyncio.to_thread(handshake.readline), 60)
        assert got == line + "\n", f"expected the victim to say {line!r}, it said {got!r}"

    async def main(dhts, averagers):
        read_end, write_end = os.pipe()
        victim = subprocess.Popen(
            [sys.executable, str(Path(__file__).parents[1] / "helpers" / "averaging_victim.py"), str(write_end),
             "killed", str(size), str(round_number), "3", str(KILLED_MATCHMAKING_S),
             *dhts[0].visible_maddrs()],
            start_new_session=True, pass_fds=(write_end,), stdin=subprocess.PIPE, text=True)
        os.close(write_end)
        handshake = os.fdopen(read_end)
        workers, loops = await replicas_on(averagers, boards=[FixedBoard(3), FixedBoard(3)])
        try:
            await wait_for(handshake, "ready")
            before = [await w.on_compute(params) for w in workers]
            victim.stdin.write("go\n")  # all three start matchmaking together: one group of three
            victim.stdin.flush()
            rounds = asyncio.gather(*(loop.run_round(round_number) for loop in loops))
            await wait_for(handshake, "in all-reduce")
            os.killpg(victim.pid, signal.SIGKILL)  # the whole machine vanishes: averager, DHT, p2pd
            await asyncio.to_thread(victim.wait)
            results = await rounds
            middle = [await w.on_compute(params) for w in workers]
            for board in loops:
                board._board.replicas_now = 2
            following = await asyncio.gather(*(loop.run_round(round_number + 1) for loop in loops))
        finally:
            await stop_all(workers, loops)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
            victim.stdin.close()
            handshake.close()
        for result in results:  # the survivors completed without the dead peer's share
            assert result.outcome == "committed", result.error
            assert result.group_size == 3 and 0.0 < result.received_fraction < 1.0
        assert all(bool(torch.isfinite(p).all()) for replica in middle for p in replica)
        partition = SlicePartition(NUMELS, SYNC.n_slices, CONFIG.seed)
        s = round_number % SYNC.n_slices
        start = (partition.gather(before[0], s) - partition.gather(before[1], s)).abs()
        end = (partition.gather(middle[0], s) - partition.gather(middle[1], s)).abs()
        averaged = end < 1e-5 * (1 + start)  # the survivors' parts: now equal
        assert 0.3 < float(averaged.float().mean()) < 1.0  # the dead reducer's part kept local values
        assert not bool(averaged[start > 0].all())
        assert [r.outcome for r in following] == ["committed", "committed"]
        assert all(r.group_size == 2 and r.received_fraction == 1.0 for r in following)

    # A matchmaking window the victim shares (its argv), long enough for all three to find one
    # another on a loaded machine: a leader whose window ends with two starts with two.
    timeouts = dict(TIMEOUTS, matchmaking_s=KILLED_MATCHMAKING_S)
    with swarm_of(2, "killed", size, timeouts=timeouts) as (dhts, averagers):
        run(main(dhts, averagers))
