"""The worker-side averaging loop against a scripted averager: what a round writes, and when.

No hivemind here: `ScriptedAverager` stands in for `SliceAverager` (same `average` signature,
runs in the loop's thread) so each test decides what the group "agreed on". The replica is a
stage on its compute thread (`LocalReplica`, tiny preset, stage 1 of 3; no gRPC server, so
later tests can still fork hivemind processes); the loop touches its parameters only through
`on_compute`, and so do the tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import pytest
import torch

from agora.dht.averaging import RoundResult
from agora.node.averaging.loop import AveragingLoop
from agora.node.averaging.sparta import SlicePartition, averaged_vector_size, outer_nesterov_step
from agora.node.rpc.server import run
from agora.pipeline.config import PRESETS
from agora.node.replica.local_replica import LocalReplica

pytestmark = pytest.mark.timeout(60)

CONFIG = PRESETS["tiny"].with_stages(3)
SYNC = dataclasses.replace(CONFIG.sync, every_steps=4, fraction=0.25)  # 4 slices


class ScriptedAverager:
    """`SliceAverager`'s interface; `reply(values, round)` says what the round returns."""

    def __init__(self, size: int, reply):
        self.size = size
        self.reply = reply
        self.calls: list[tuple[int, float, int | None]] = []
        self.cancelled = threading.Event()
        self._called = threading.Condition()

    def average(self, values, *, round_number, weight, group_size=None, metadata=None) -> RoundResult:
        with self._called:
            self.calls.append((round_number, weight, group_size))
            self._called.notify_all()
        return self.reply(values.clone(), round_number)

    async def called(self, times: int, what: str) -> None:
        """Wait (woken by each call, bounded) until the loop has started `times` rounds."""
        def wait() -> bool:
            with self._called:
                return self._called.wait_for(lambda: len(self.calls) >= times, timeout=10)
        assert await asyncio.to_thread(wait), f"timed out waiting for {what}"

    def cancel(self) -> None:
        self.cancelled.set()


class Board:
    def __init__(self, replicas: int = 2, announced: int | None = None, announcer: bool = True):
        self.replicas_now, self.announced_now, self.announced_by_us, self.closed_by_us = replicas, announced, [], []
        self.announcer = announcer

    def announces(self, round_number):
        return self.announcer

    async def announce(self, round_number):
        self.announced_by_us.append(round_number)

    async def close(self, round_number):
        self.closed_by_us.append(round_number)

    refused: dict = {}
    strangers = 0

    async def announced_round(self, at_most=None):
        return self.announced_now

    async def replicas(self):
        return self.replicas_now


class CountingBoard(Board):
    """A board that counts its reads; `read(kind, times)` waits (woken by each read, bounded) for them."""

    def __init__(self, replicas: int = 2):
        super().__init__(replicas=replicas)
        self.reads = {"announced": 0, "replicas": 0}
        self._read = asyncio.Event()

    async def announced_round(self, at_most=None):
        self._count("announced")
        return await super().announced_round(at_most)

    async def replicas(self):
        self._count("replicas")
        return await super().replicas()

    def _count(self, kind: str) -> None:
        self.reads[kind] += 1
        self._read.set()

    async def read(self, kind: str, times: int) -> None:
        deadline = time.monotonic() + 10
        while self.reads[kind] < times:
            self._read.clear()
            await asyncio.wait_for(self._read.wait(), max(0.0, deadline - time.monotonic()))


def committed(averaged, round_number, group=2):
    return RoundResult("committed", round_number, averaged, participants=tuple(f"p{i}" for i in range(group)),
                       weights=(1.0,) * group, received_fraction=1.0)


def vector_size(sync=SYNC) -> int:
    numels = [p.numel() for p in _params_of_stage()]
    return averaged_vector_size(sync, SlicePartition(numels, sync.n_slices, CONFIG.seed).buffer_size)


def _params_of_stage():
    from agora.pipeline.stages import build_stage

    return [p for p in build_stage(CONFIG.model, 1).parameters() if p.requires_grad]


def params(compute):
    return [p.detach().clone() for p in compute.optimizer.parameters]


async def started(sync, reply, board=None, size=None, **loop_options):
    worker = LocalReplica(CONFIG, 1)
    averager = ScriptedAverager(size or vector_size(sync), reply)
    loop = AveragingLoop(worker, averager, sync, seed=CONFIG.seed, board=board or Board(), probe_s=0.01,
                         **loop_options)
    await loop.start()
    return worker, averager, loop


def test_round_adds_average_minus_snapshot_and_keeps_steps_taken_meanwhile():
    entered, release = threading.Event(), threading.Event()

    def reply(values, round_number):
        entered.set()
        release.wait(10)
        return committed(values + 1.0, round_number)  # the group's average: snapshot + 1

    async def main():
        worker, averager, loop = await started(SYNC, reply)
        try:
            before = await worker.on_compute(params)
            task = asyncio.create_task(loop.run_round(1))
            await asyncio.to_thread(entered.wait, 10)
            # Training goes on during the round: a local update to every parameter.
            await worker.on_compute(lambda c: [p.data.add_(0.5) for p in c.optimizer.parameters])
            release.set()
            result = await task
            after = await worker.on_compute(params)
        finally:
            await loop.stop()
            await worker.stop()
        assert result.outcome == "committed" and loop.stats.applied == 1
        partition = SlicePartition([p.numel() for p in before], SYNC.n_slices, CONFIG.seed)
        for s in range(SYNC.n_slices):
            moved = partition.gather(after, s) - partition.gather(before, s)
            expected = 1.5 if s == 1 else 0.5  # average - snapshot, plus the local step
            assert torch.allclose(moved[:partition.slice_sizes[s]], torch.full((partition.slice_sizes[s],), expected))
        assert loop.stats.compute_blocked_s > 0

    run(main())


def test_a_round_is_snapshotted_by_the_step_that_makes_it_due_and_its_lag_is_counted():
    """The step hook takes the slice inside the step job at which the round falls due, so the
    snapshot is of exactly that step however busy the compute thread is; the milestone line and
    the stats give how many local steps later the result was applied."""
    seen: dict[int, torch.Tensor] = {}

    def reply(values, round_number):
        seen[round_number] = values
        return committed(values + 1.0, round_number)

    def six_steps(compute):
        """One compute job: the loop cannot look at the stage between these steps."""
        at = []
        for _ in range(6):
            for p in compute.optimizer.parameters:
                p.grad = torch.full_like(p, 0.1)
            compute._step(1)
            at.append(params(compute))
        return at[SYNC.every_steps - 1], at[-1]

    logged = MilestoneLog()

    async def main():
        worker = LocalReplica(CONFIG, 1)
        averager = ScriptedAverager(vector_size(), reply)
        loop = AveragingLoop(worker, averager, SYNC, seed=CONFIG.seed, board=Board(), probe_s=0.01,
                             logger=logged.logger)
        await loop.start()
        try:
            at_due, before_apply = await worker.on_compute(six_steps)
            fields = await asyncio.to_thread(logged.wait, 10)
            after = await worker.on_compute(params)
            partition = loop._partition
        finally:
            await loop.stop()
            await worker.stop()
        assert torch.equal(seen[1], partition.gather(at_due, 1))  # step 4's values, not step 6's
        assert torch.allclose(partition.gather(after, 1), partition.gather(before_apply, 1) + 1.0)
        assert fields["round"] == 1 and fields["applied"] and fields["lag_steps"] == 6 - SYNC.every_steps
        snap = loop.stats.snapshot()
        assert (snap["mean_lag_steps"], snap["max_lag_steps"]) == (2, 2)

    run(main())


def _steps(n):
    def job(compute):
        for _ in range(n):
            for p in compute.optimizer.parameters:
                p.grad = torch.full_like(p, 0.1)
            compute._step(1)
        return params(compute)
    return job


async def _round_one_blocks_while(steps_during: int, steps_after: int = 0):
    """Round 1 (due at step 2 of 2 per round, one slice) is held open while `steps_during` more
    steps run; then it returns the snapshot + 1 and `steps_after` more steps run. Returns what
    each round was handed, the parameters after the steps during round 1, and the loop."""
    sync = dataclasses.replace(SYNC, every_steps=2, fraction=1.0)
    entered, release = threading.Event(), threading.Event()
    seen: dict[int, torch.Tensor] = {}

    def reply(values, round_number):
        seen[round_number] = values
        if round_number == 1:
            entered.set()
            release.wait(10)
            return committed(values + 1.0, round_number)
        return committed(values, round_number)  # the group agrees with us: nothing to apply

    worker, averager, loop = await started(sync, reply, size=vector_size(sync))
    try:
        await worker.on_compute(_steps(2))
        await asyncio.to_thread(entered.wait, 10)
        during = await worker.on_compute(_steps(steps_during))
        release.set()
        await worker.on_compute(_steps(steps_after))
        await averager.called(2, "the round after round 1")
    finally:
        await loop.stop()
        await worker.stop()
    return seen, during, loop


def test_a_round_snapshotted_during_the_previous_one_gets_its_delta():
    """Round 2 came due (step 4) while round 1 ran and no step followed: it runs next, on a
    snapshot that carries round 1's delta, so round 2 does not undo round 1's correction."""
    async def main():
        seen, at_step_4, loop = await _round_one_blocks_while(2)
        assert sorted(seen) == [1, 2]
        assert torch.allclose(seen[2], loop._partition.gather(at_step_4, 0) + 1.0)
        assert loop.stats.skipped == 0

    run(main())


def test_a_round_that_came_due_while_another_ran_is_skipped_once_a_step_passed():
    """Round 2 came due at step 4 but step 5 followed before round 1 ended: the replicas skip it
    alike (starting it late is where they would pick different rounds) and meet at round 3."""
    async def main():
        seen, _, loop = await _round_one_blocks_while(3, steps_after=1)  # step 6: round 3
        assert sorted(seen) == [1, 3] and loop.stats.skipped == 1

    run(main())


class MilestoneLog(logging.Handler):
    """Collects the loop's `averaging_round` milestone lines; `wait` blocks for the next one."""

    def __init__(self):
        super().__init__()
        self.logger = logging.getLogger(f"test.averaging.{id(self)}")
        self.logger.addHandler(self)
        self.logger.setLevel(logging.INFO)
        self._lines: list[dict] = []
        self._arrived = threading.Condition()

    def emit(self, record):
        if getattr(record, "milestone", None) == "averaging_round":
            with self._arrived:
                self._lines.append(record.fields)
                self._arrived.notify_all()

    def wait(self, timeout):
        with self._arrived:
            assert self._arrived.wait_for(lambda: self._lines, timeout), "no averaging milestone line"
            return self._lines.pop(0)


def test_alone_failed_and_rejected_rounds_write_nothing():
    outcomes = iter(["failed", "rejected"])

    def reply(values, round_number):
        return RoundResult(next(outcomes), round_number, None)

    async def main():
        board = Board(replicas=1)
        worker, averager, loop = await started(SYNC, reply, board, replicas_s=0.05)
        try:
            before = await worker.on_compute(params)
            assert (await loop.run_round(1)).outcome == "alone"  # no other replica: no matchmaking
            assert averager.calls == []
            board.replicas_now = 3
            await asyncio.sleep(0.1)  # the count is read again once older than `replicas_s`
            assert (await loop.run_round(2)).outcome == "failed"
            assert (await loop.run_round(3)).outcome == "rejected"
            after = await worker.on_compute(params)
        finally:
            await loop.stop()
            await worker.stop()
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        assert [call[0] for call in averager.calls] == [2, 3] and averager.calls[0][2] == 3  # target group size
        assert board.announced_by_us == [1, 2, 3] and board.closed_by_us == [1, 2, 3]
        snap = loop.stats.snapshot()
        assert snap["rounds_by_outcome"]["alone"] == 1 and snap["rounds_by_outcome"]["failed"] == 1
        assert snap["rounds_by_outcome"]["rejected"] == 1 and snap["applied"] == 0 and snap["rounds"] == 3

    run(main())


def test_a_replica_that_is_not_the_rounds_announcer_runs_it_without_announcing_or_closing():
    async def main():
        board = Board(replicas=3, announcer=False)
        worker, averager, loop = await started(SYNC, lambda values, r: committed(values, r), board)
        try:
            assert (await loop.run_round(1)).outcome == "committed"
            assert (await loop.run_round(2)).outcome == "committed"
            board.announcer = True
            assert (await loop.run_round(3)).outcome == "committed"
        finally:
            await loop.stop()
            await worker.stop()
        assert [call[0] for call in averager.calls] == [1, 2, 3]
        assert board.announced_by_us == [3] and board.closed_by_us == [3]

    run(main())


def test_a_training_replica_reads_the_count_every_replicas_interval_not_at_every_probe():
    async def main():
        board = CountingBoard()
        worker, _, loop = await started(SYNC, lambda values, r: committed(values, r), board, replicas_s=10.0)
        try:
            for step in range(1, 4):  # its count moves: probes at the training pace (probe_s 0.01)
                await worker.on_compute(lambda c, step=step: setattr(c.optimizer, "steps", step))
                await board.read("announced", board.reads["announced"] + 2)
        finally:
            await loop.stop()
            await worker.stop()
        assert board.reads["announced"] >= 6 and board.reads["replicas"] == 1  # the first probe's

    run(main())


def test_a_round_short_of_the_count_or_a_strangers_announcement_has_the_count_read_again():
    groups = iter([3, 2, 3, 3])

    def reply(values, round_number):
        return committed(values, round_number, group=next(groups))

    async def main():
        board = CountingBoard(replicas=3)
        worker, _, loop = await started(SYNC, reply, board, quiet_probe_s=0.02, replicas_s=0.02, settled_s=60.0)
        try:
            await board.read("replicas", 1)  # the first probe's
            await asyncio.sleep(0.05)
            await loop.run_round(1)  # reads it again (a count stands once two reads agree); a group of 3, as counted
            await asyncio.sleep(0.05)
            await loop.run_round(2)  # a group of 2: one of the 3 is gone, or late
            after_a_settled_round = board.reads["replicas"]
            await asyncio.sleep(0.05)
            await loop.run_round(3)  # reads the count first
            after_a_short_round = board.reads["replicas"]
            board.strangers += 1  # an announcement by a replica the count did not include
            await board.read("announced", board.reads["announced"] + 2)
            await asyncio.sleep(0.05)
            await loop.run_round(4)
        finally:
            await loop.stop()
            await worker.stop()
        assert (after_a_settled_round, after_a_short_round, board.reads["replicas"]) == (2, 3, 4)

    run(main())


def test_a_quiet_replica_reads_only_the_announcements_until_its_count_moves():
    async def main():
        board = CountingBoard()
        worker, _, loop = await started(SYNC, lambda values, r: committed(values, r), board, quiet_probe_s=0.02,
                                        replicas_s=0.02, settled_s=0.02)
        try:
            await board.read("announced", 4)
            quiet_reads = dict(board.reads)
            await worker.on_compute(lambda c: setattr(c.optimizer, "steps", 1))  # no round due before step 4
            await board.read("replicas", 2)
        finally:
            await loop.stop()
            await worker.stop()
        assert quiet_reads["replicas"] == 1  # the first probe only: nothing told it the count was still
        assert sum(loop.stats.rounds.values()) == 0

    run(main())


@pytest.mark.parametrize("early_s", [0.0, 0.0009])
def test_between_probes_an_idle_loop_sleeps_until_the_next_one_is_due(early_s):
    """`early_s`: each of the loop's waits ends that much before the time it was given, as the event
    loop's millisecond timers may end one."""
    async def main():
        board = CountingBoard()
        worker, _, loop = await started(SYNC, lambda values, r: committed(values, r), board, quiet_probe_s=0.3)
        turns = 0
        due_round, idle_wait_s = loop._due_round, loop._idle_wait_s
        loop._idle_wait_s = lambda: max(0.0, idle_wait_s() - early_s)

        def counted(steps):
            nonlocal turns
            turns += 1
            return due_round(steps)

        loop._due_round = counted
        try:
            await board.read("announced", 2)  # past the first probes, at the quiet pace
            turns, probes = 0, board.reads["announced"]
            await board.read("announced", probes + 3)
        finally:
            await loop.stop()
            await worker.stop()
        # About one turn per probe (a loaded machine adds a few). A wait the event loop's millisecond
        # timers ended just short of the due time must not spin until it comes (30 to 112 turns seen).
        assert turns <= 2 * 3 + 1, turns

    run(main())


def test_optimizer_state_option_averages_the_moments_and_keeps_exp_avg_sq_non_negative():
    sync = dataclasses.replace(SYNC, average_optimizer_state=True)

    def reply(values, round_number):
        third = values.numel() // 3
        averaged = values.clone()
        averaged[:third] += 1.0  # parameters
        averaged[third:2 * third] += 2.0  # exp_avg
        averaged[2 * third:] = -5.0  # exp_avg_sq: a delta that would make it negative
        return committed(averaged, round_number)

    def train_one_step(compute):
        for p in compute.optimizer.parameters:
            p.grad = torch.randn_like(p)
        compute.optimizer.step(1)

    def moments(compute, name):
        state = compute.optimizer.optimizer.state
        return [state[p][name].clone() for p in compute.optimizer.parameters]

    async def main():
        worker, averager, loop = await started(sync, reply, size=vector_size(sync))
        try:
            await worker.on_compute(train_one_step)
            before = await worker.on_compute(lambda c: moments(c, "exp_avg"))
            await loop.run_round(2)
            after = await worker.on_compute(lambda c: moments(c, "exp_avg"))
            second = await worker.on_compute(lambda c: moments(c, "exp_avg_sq"))
        finally:
            await loop.stop()
            await worker.stop()
        partition = SlicePartition([m.numel() for m in before], sync.n_slices, CONFIG.seed)
        n = partition.slice_sizes[2]
        assert torch.allclose((partition.gather(after, 2) - partition.gather(before, 2))[:n], torch.full((n,), 2.0))
        assert torch.equal(partition.gather(after, 0), partition.gather(before, 0))
        assert all(bool((m >= 0).all()) for m in second)
        assert bool((partition.gather(second, 2)[:n] == 0).all())

    run(main())


def test_diloco_round_is_an_outer_nesterov_step_on_the_fragment():
    sync = dataclasses.replace(SYNC, method="diloco", fragments=2)

    async def main():
        worker, averager, loop = await started(sync, lambda v, r: None, Board(replicas=1), size=vector_size(sync))
        try:
            anchor = await worker.on_compute(params)
            # Inner steps: every parameter moves by 0.01.
            await worker.on_compute(lambda c: [p.data.add_(0.01) for p in c.optimizer.parameters])
            result = await loop.run_round(3)  # fragment 1, alone; a quorum of one applies it
            after = await worker.on_compute(params)
        finally:
            await loop.stop()
            await worker.stop()
        assert result.outcome == "alone" and loop.stats.applied == 1
        partition = SlicePartition([p.numel() for p in anchor], 2, CONFIG.seed)
        a = partition.gather(anchor, 1)
        expected = outer_nesterov_step(a, a + 0.01, torch.zeros_like(a), sync.outer_lr, sync.outer_momentum)
        n = partition.slice_sizes[1]
        assert torch.allclose(partition.gather(after, 1)[:n], expected[:n], atol=1e-6)  # a + 0.7 * 1.9 * 0.01
        assert torch.allclose(partition.gather(after, 0), partition.gather(anchor, 0) + 0.01)  # fragment 0 untouched

    run(main())


def test_loop_starts_due_and_announced_rounds_and_stop_cancels_the_round_in_flight():
    def reply(values, round_number):
        if round_number < 9:
            return committed(values, round_number)
        averager.cancelled.wait(10)  # a round that never ends on its own
        return RoundResult("cancelled", round_number, None)

    async def main():
        nonlocal averager
        board = Board(replicas=2, announced=3)  # a faster replica is waiting in round 3
        worker, averager, loop = await started(SYNC, reply, board)
        try:
            await averager.called(1, "the announced round")
            assert [c[0] for c in averager.calls] == [3]
            board.announced_now = None
            await worker.on_compute(lambda c: setattr(c.optimizer, "steps", 4 * 5))  # own step count: round 5
            await averager.called(2, "the round due at step 20")
            await worker.on_compute(lambda c: setattr(c.optimizer, "steps", 4 * 9 + 1))  # rounds 6-8 skipped
            await averager.called(3, "round 9")
        finally:
            await loop.stop()
            await worker.stop()
        assert [c[0] for c in averager.calls] == [3, 5, 9]
        snap = loop.stats.snapshot()
        assert snap["skipped"] == 2 + 1 + 3 and snap["rounds_by_outcome"]["cancelled"] == 1
        assert snap["last_round"] == 9

    averager = None
    run(main())


def test_diloco_anchor_momentum_and_round_survive_a_checkpoint(tmp_path):
    """A restarted replica resumes its outer optimizer: the same anchor, momentum and round, and
    samples since the last round counted across the restart (the worker's own count restarts)."""
    from agora.node.replica.checkpoints import StageCheckpointer, restore_stage

    sync = dataclasses.replace(SYNC, method="diloco", fragments=2)

    async def main():
        worker, _, loop = await started(sync, lambda v, r: None, Board(replicas=1), size=vector_size(sync))
        try:
            await worker.on_compute(lambda c: [p.data.add_(0.01) for p in c.optimizer.parameters])
            await loop.run_round(3)  # fragment 1: anchor and momentum move
            await worker.on_compute(lambda c: setattr(c, "samples_total", c.samples_total + 24))
            await StageCheckpointer(worker, tmp_path, CONFIG, every=0, averaging=loop).final(worker.compute,
                                                                                             phase="member")
            saved = loop.state_dict(worker.compute.samples_total)
        finally:
            await loop.stop()
            await worker.stop()

        fresh = LocalReplica(CONFIG, 1)
        resumed = AveragingLoop(fresh, ScriptedAverager(vector_size(sync), lambda v, r: None), sync,
                                seed=CONFIG.seed, board=Board(replicas=1), probe_s=0.01)
        try:
            _, state, _ = await fresh.on_compute(lambda c: restore_stage(c, tmp_path, CONFIG))
            resumed.load_state_dict(state)
            await resumed.start()
            got = resumed.state_dict(fresh.compute.samples_total)
        finally:
            await resumed.stop()
            await fresh.stop()
        return saved, got

    saved, got = run(main())
    assert got["last_round"] == saved["last_round"] == 3
    assert got["samples_since_round"]["1"] == saved["samples_since_round"]["1"] == 24
    assert any(m.abs().sum() > 0 for m in saved["momentum"])
    for key in ("anchor", "momentum"):
        assert all(torch.equal(a, b) for a, b in zip(got[key], saved[key]))


def test_averaging_state_of_another_method_or_shape_is_refused_or_ignored():
    loop = AveragingLoop(LocalReplica(CONFIG, 1), ScriptedAverager(vector_size(), lambda v, r: None), SYNC,
                         seed=CONFIG.seed)
    try:
        with pytest.raises(ValueError, match="malformed"):
            loop.load_state_dict({"method": "sparta"})
        with pytest.raises(ValueError, match="diloco with 4 slices, but this run uses sparta"):
            loop.load_state_dict({"method": "diloco", "n_slices": 4, "last_round": 0, "samples_since_round": {},
                                  "anchor": [], "momentum": []})
    finally:
        run(loop.worker.stop())
