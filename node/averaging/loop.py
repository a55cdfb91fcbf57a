"""The worker's background averaging: AsyncSPARTA rounds (or streaming DiLoCo) while it trains.

One asyncio task per worker. When a round is due it has a snapshot of the round's slice taken
on the compute thread, runs the all-reduce off it (a thread blocked in `SliceAverager.average`),
and applies the result on the compute thread again. The compute thread is the only one that
touches the stage, so both touches are quick copies there; forward, backward and optimizer
steps go on meanwhile.

Design choices:
- The snapshot is taken by a step hook (`StageCompute.step_hooks`) inside the very step at which
  the round falls due, which also wakes the loop. Every replica of a stage steps on the same
  completed-batch reports (the shared epoch), so their snapshots are of the same step, and none
  waits behind queued forwards, a poll or a DHT call (on `tiny`, where a global batch takes a
  quarter of a second, those had rounds land 1-4 steps after they came due). The lag that is
  left, local steps from snapshot to apply, is in `AveragingStats`: it is what costs convergence.
- Which round next, in order: a round another replica announced and this one has not run (read
  again from the DHT just before joining); the round the hook snapshotted (one that came due
  during the previous round only if no step followed it before that round's result arrived: the
  replicas get the result together but apply it after their own queued compute); a round due by a count that moved
  without a step (a test, a restore), snapshotted through `worker.on_compute`. A round that came
  due while another ran is skipped, not started late: starting the newest round due by the end
  of the previous one had replicas pick different rounds whenever a step fell between their
  finishes, wait out the matchmaking window alone, finish apart again and keep missing each
  other (on `tiny` with a round every step, two of three stages spent most of a run so). The
  announcements (`RoundBoard`, dht/round_board.py) are read every `probe_s` and at once after a
  round without partners, so replicas that missed each other meet in the next round; they are
  also how a replica whose count lags (missed reports, a restart, `--local-batch`) joins the
  rounds of the others, well inside the matchmaking window they wait for it. Two replicas
  announce each round, not all (dht/round_board.py says why), and an announcement is closed when
  its round ends, so nobody joins a round the others have left. A replica whose
  count has not moved since its last probe reads only the announcements, every half window
  (node/averaging/probes.py): an idle swarm's DHT traffic was mostly these reads.
- Between rounds the loop sleeps until the step hook wakes it or the next probe is due, looking
  at its count at least every `_COUNT_CHECK_S` (a count moved without a step: a test, a restore).
- A snapshot the hook takes while a round of the same slice is still running gets that round's
  delta when it is applied (`_carry_into_hooked`); otherwise the next round would undo it.
- The board also gives the live replica count (read with a probe, and at a round, when the last
  read is older than a matchmaking window: node/averaging/probes.py says why): one (only this
  worker) is an `alone` outcome at once, with no matchmaking wait; more becomes the matchmaking
  target, so a complete group starts without waiting out the window. The round's announcers store their announcement while it runs.
- sparta: delta rule `w[slice] += average - snapshot` (node/averaging/sparta.py), optionally on the Adam
  moments of the slice too (exp_avg_sq is clamped at 0: a delta could push it negative).
  diloco: fragment round, outer Nesterov on the token-weighted mean delta; a round with fewer
  participants than `quorum` changes nothing (its progress is in the next delta of that fragment).
- Everything a round did ends in one milestone log line (`averaging round=...`) and in
  `AveragingStats` (node/averaging/stats.py), whose `snapshot()` is a plain dict (the join daemon
  writes it on exit).
- The time the compute thread spends on snapshots and applies is measured on that thread and
  reported as `compute_blocked_s` / `compute_blocked_fraction` of the loop's wall time.
- `state_dict()` is what a checkpoint needs to resume the loop where it was: the last round,
  the samples since each key's last round (relative, since the worker's sample count restarts)
  and, for diloco, the anchor and the outer momentum. Without them a restarted replica would
  take its current weights as the agreed anchor (dropping its pending progress from the next
  outer step) and restart its momentum from zero. `load_state_dict` before `start()`; a state
  of another method or stage shape is refused with a clear error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Mapping, Optional, Protocol

import torch

from agora.dht.averaging import RoundResult, SliceAverager
from agora.dht.records import Phase
from agora.node.averaging.sparta import (
    RoundDecision,
    SlicePartition,
    averaged_vector_size,
    next_round,
    outer_nesterov_step,
    peer_weight,
    round_slice,
    second_moment_offset,
)
from agora.node.averaging.hooked import Hooked, HookedSnapshots
from agora.node.averaging.probes import ProbeSchedule, probe_intervals
from agora.node.averaging.stats import AveragingStats
from agora.node.replica.compute import StageCompute
from agora.node.worker.worker import StageWorker
from agora.pipeline.config import SyncConfig

__all__ = ["AveragingStats", "AveragingLoop", "RoundDirectory"]


class RoundDirectory(Protocol):
    """What the loop needs to know about its stage's other replicas (`RoundBoard` over the DHT)."""

    async def announce(self, round_number: int) -> None: ...

    async def close(self, round_number: int) -> None: ...

    refused: Mapping[str, int]  # announcements refused so far, by reason

    async def announced_round(self, at_most: Optional[int] = None) -> Optional[int]: ...

    async def replicas(self) -> int: ...

    def announces(self, round_number: int) -> bool: ...  # whether this replica announces the round

    strangers: int  # open announcements read so far by replicas the last count did not include

# Rounds past the stage's schedule (this replica's count, or the stage's announced one when ahead)
# that an announcement may still name and be joined. Replicas step on the same completed-batch
# reports, so a real announcement is a round or two ahead at most; a later one is refused.
ROUND_LEAD = 4
# How often the loop looks at its own step count when no step hook woke it, how often stop()
# looks whether the round in flight ended, and how long it waits for that.
_COUNT_CHECK_S = 1.0
_POLL_S = 0.05
# The event loop's timers tick in milliseconds and may end a wait up to a tick early, and a wait
# for less than a tick returns at once: a probe due within a tick is due now, and the loop never
# waits less than two ticks (a probe may start 2 ms late), else it would spin until the time came.
_TIMER_RESOLUTION_S = 0.001
_MIN_WAIT_S = 2 * _TIMER_RESOLUTION_S
_STOP_GRACE_S = 10.0


class AveragingLoop:
    """Runs `sync.method` rounds for one started `StageWorker` until `stop()`.

    Of the worker it uses `on_compute`, `compute` (read-only, for the step count), `phase` and
    `is_serving`, so anything offering those (a test's bare compute thread) can host it.
    """

    def __init__(self, worker: StageWorker, averager: SliceAverager, sync: SyncConfig, *, seed: int,
                 board: Optional[RoundDirectory] = None, probe_s: Optional[float] = None,
                 quiet_probe_s: Optional[float] = None, replicas_s: Optional[float] = None,
                 settled_s: Optional[float] = None, logger: Optional[logging.Logger] = None,
                 stats: Optional[AveragingStats] = None):
        if sync.method not in ("sparta", "diloco"):
            raise ValueError(f"no averaging loop for sync.method {sync.method!r}")
        self.worker = worker
        self.averager = averager
        self.sync = sync
        self.seed = seed
        self.stats = stats if stats is not None else AveragingStats(sync.method)  # the process's registry, or its own
        self._board = board
        self.probe_s, quiet_probe_s = probe_intervals(sync.matchmaking_s, probe_s, quiet_probe_s)
        self._probes = ProbeSchedule(self.probe_s, quiet_probe_s, replicas_s, settled_s)
        self._announced: Optional[int] = None
        self._refused_counted: dict[str, int] = {}  # the board's refusals already in the stats
        self._logger = logger or logging.getLogger("agora.node.averaging")
        self._partition: Optional[SlicePartition] = None
        self._task: Optional[asyncio.Task] = None
        self._stopping = asyncio.Event()
        self._last_round = 0
        self._samples_at_round: dict[int, int] = {}  # per slice (diloco) or under key -1 (sparta)
        # diloco: the last agreed values (anchor) and the outer momentum, per parameter tensor;
        # touched only by this loop, so they need no lock.
        self._anchor: list[torch.Tensor] = []
        self._momentum: list[torch.Tensor] = []
        self._restored: Optional[dict] = None  # a checkpointed state, applied by start()
        self._hooked = HookedSnapshots()
        self._announcing: Optional[asyncio.Task] = None  # this round's announcement, then its close
        self._open_round: Optional[int] = None  # announced and not yet closed
        self._hook_round = 0  # the last round the hook snapshotted (compute thread only)
        self._wake = asyncio.Event()  # set by the hook and by stop()
        self._event_loop: Optional[asyncio.AbstractEventLoop] = None
        self._strangers_seen = 0  # the board's `strangers` when last looked at
        # Called on the event loop after every round with (result, slice, applied): a joining replica's
        # phases (node/membership/phases.py) count the slices it has received. An observer must not raise.
        self.round_observers: list[Callable[[RoundResult, int, bool], None]] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Size the partition and start the loop task."""
        numels, steps, samples = await self._on_compute(
            lambda c: ([p.numel() for p in c.optimizer.parameters], c.optimizer.steps, c.samples_total))
        partition = SlicePartition(numels, self.sync.n_slices, self.seed)
        size = averaged_vector_size(self.sync, partition.buffer_size)
        if size != self.averager.size:
            raise ValueError(f"the averager holds {self.averager.size} values but a round of this stage needs {size}")
        self._partition = partition  # (its slices' indices are generated per round: nothing to build)
        self.stats.vector_elements, self.stats.parameters = size, sum(numels)
        restored = self._restored
        if restored is not None and self.sync.method == "diloco" and not (
                _matches(restored["anchor"], numels) and _matches(restored["momentum"], numels)):
            self._logger.warning("the checkpoint's diloco anchor and momentum do not fit this stage; starting afresh")
            restored = None
        if self.sync.method == "diloco":
            if restored is not None:
                self._anchor = [t.detach().clone().float() for t in restored["anchor"]]
                self._momentum = [t.detach().clone().float() for t in restored["momentum"]]
            else:
                # In host memory: on a GPU worker the anchor and momentum would double the stage's weights there.
                self._anchor = await self._on_compute(
                    lambda c: [p.detach().to("cpu", torch.float32, copy=True) for p in c.optimizer.parameters])
                self._momentum = [torch.zeros_like(a) for a in self._anchor]
        self._last_round = steps // self.sync.every_steps  # rounds due before we started are not run
        self._samples_at_round = {key: samples for key in range(-1, self.sync.n_slices)}
        if restored is not None:
            self._last_round = max(self._last_round, restored["last_round"])
            for key, since in restored["samples_since_round"].items():
                if key in self._samples_at_round:
                    self._samples_at_round[key] = samples - since
        self._event_loop = asyncio.get_running_loop()
        last_round = self._last_round

        def install(compute: StageCompute) -> None:
            self._hook_round = last_round
            compute.step_hooks.append(self._on_step)

        await self.worker.on_compute(install)
        self.stats.started = time.monotonic()
        self._task = asyncio.create_task(self._run(), name="averaging-loop")

    def state_dict(self, samples_total: int) -> dict:
        """What a checkpoint keeps (see the module docstring); `samples_total` is the worker's now."""
        return {
            "method": self.sync.method, "n_slices": self.sync.n_slices, "last_round": self._last_round,
            "samples_since_round": {str(k): max(0, samples_total - v) for k, v in self._samples_at_round.items()},
            "anchor": [t.clone() for t in self._anchor], "momentum": [t.clone() for t in self._momentum],
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`'s output; call before `start()`."""
        if self._task is not None:
            raise RuntimeError("load the averaging state before start()")
        try:
            method, n_slices, last_round = state["method"], int(state["n_slices"]), int(state["last_round"])
            since = {int(k): int(v) for k, v in state["samples_since_round"].items()}
            anchor, momentum = list(state["anchor"]), list(state["momentum"])
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"averaging state in the checkpoint is malformed: {error!r}") from None
        if (method, n_slices) != (self.sync.method, self.sync.n_slices):
            raise ValueError(f"the checkpoint's averaging state is for {method} with {n_slices} slices, but this "
                             f"run uses {self.sync.method} with {self.sync.n_slices}")
        self._restored = {"last_round": last_round, "samples_since_round": since, "anchor": anchor,
                          "momentum": momentum}

    async def stop(self) -> None:
        """Abandon the round in flight (if any) and end the loop."""
        self._stopping.set()
        self._wake.set()
        if self._task is None:
            return
        try:
            await self.worker.on_compute(lambda c: c.step_hooks.remove(self._on_step))
        except (RuntimeError, ValueError):
            pass  # the worker's compute thread is already gone (or the hook was never installed)
        deadline = time.monotonic() + _STOP_GRACE_S
        while not self._task.done() and time.monotonic() < deadline:
            # Again each time: a round may have been starting just as the first cancel went out.
            self.averager.cancel()
            await asyncio.wait({self._task}, timeout=_POLL_S)
        if not self._task.done():
            self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while not self._stopping.is_set():
            self.stats.local_steps = self.worker.compute.optimizer.steps
            probe_in = self._probes.due_in(time.monotonic(), self.stats.local_steps)
            if self._board is not None and probe_in <= _TIMER_RESOLUTION_S:
                await self._probe(self.stats.local_steps)
            decision = RoundDecision(None, 0)
            if self._announced is not None and self._announced > self._last_round:
                decision = await self._join_announced()  # before a round of its own: see the docstring
            if decision.round is None:
                decision = self._due_round(self.stats.local_steps)
            if decision.round is None:
                try:
                    await asyncio.wait_for(self._wake.wait(), self._idle_wait_s())
                except asyncio.TimeoutError:
                    pass
                self._wake.clear()
                continue
            self.stats.count_skipped(decision.skipped)
            self._last_round = decision.round
            try:
                result = await self.run_round(decision.round)
                if result.outcome in ("alone", "failed") and (self._probes.count or 0) > 1:
                    self._probes.look_now()  # the others may be waiting in another round
            except RuntimeError as error:
                if not self.worker.is_serving:  # the worker is stopping: its compute thread is gone
                    return
                self._logger.exception("averaging round %d failed: %s", decision.round, error)
            except Exception:
                self._logger.exception("averaging round %d failed", decision.round)

    async def _probe(self, steps: int) -> None:
        """Read the round board: the announcements, and the live replicas when the count is due
        (not while this replica is quiet: node/averaging/probes.py)."""
        reads = [self._ask(self._read_announced, None)]
        if self._probes.reads_replicas(steps, time.monotonic()):
            reads.append(self._ask(self._board.replicas, None))
        announced, *replicas = await asyncio.gather(*reads)
        self._announced = announced
        if replicas and replicas[0] is not None:
            self._probes.replicas_read(time.monotonic(), replicas[0])
        self._probes.probed(time.monotonic(), steps)

    def _idle_wait_s(self) -> float:
        """How long the loop may sleep when no round is due: until the next probe, at most `_COUNT_CHECK_S`."""
        if self._board is None:
            return _COUNT_CHECK_S
        due_in = self._probes.due_in(time.monotonic(), self.worker.compute.optimizer.steps)
        return min(_COUNT_CHECK_S, max(_MIN_WAIT_S, due_in))

    def _due_round(self, steps: int) -> RoundDecision:
        """The round to start now on this replica's own count: the one the step hook snapshotted
        (see `HookedSnapshots.reserve` for one that came due during a round), else one due by a
        count the hook never saw."""
        hooked = self._hooked.next_after(self._last_round)
        if hooked is not None:
            return RoundDecision(hooked, hooked - self._last_round - 1)
        # Rounds the hook saw come due while another round ran are not started late: the stage's
        # replicas skip them alike and meet at the next one (see the module docstring).
        decision = next_round(steps, self.sync.every_steps, max(self._last_round, self._hook_round))
        if decision.round is None:
            return decision
        return RoundDecision(decision.round, decision.round - self._last_round - 1)

    def round_bound(self) -> int:
        """The latest round this replica would join on another's announcement: the stage's
        schedule (this replica's count, or the stage's announced count when that is ahead: a
        replica that lags joins the others' rounds) plus `ROUND_LEAD`."""
        stage_step = getattr(self.worker.compute, "stage_step", None) or 0
        return max(self.stats.local_steps, stage_step) // self.sync.every_steps + ROUND_LEAD

    async def _read_announced(self) -> Optional[int]:
        announced = await self._board.announced_round(self.round_bound())
        for reason, count in self._board.refused.items():  # the board counts; the stats follow it
            new = count - self._refused_counted.get(reason, 0)
            if new > 0:
                self.stats.count_refused(reason, new)
                self._refused_counted[reason] = count
        if self._board.strangers != self._strangers_seen:  # a replica the count left out announced
            self._strangers_seen = self._board.strangers
            self._probes.count_in_doubt()
        return announced

    async def _join_announced(self) -> RoundDecision:
        """Another replica waits in a round this one has not run (it is behind, or let the round
        pass while busy): join it if the announcement is still open when read again now."""
        self._announced = await self._ask(self._read_announced, None)
        if self._announced is None or self._announced <= self._last_round:
            return RoundDecision(None, 0)
        return RoundDecision(self._announced, self._announced - self._last_round - 1)

    # ------------------------------------------------------------------ one round

    async def run_round(self, round_number: int) -> RoundResult:
        """Run one round now (the loop calls this; tests may call it directly)."""
        if self._partition is None:
            raise RuntimeError("start() the loop first")
        index = round_slice(round_number, self.sync.n_slices)
        self._last_round = max(self._last_round, round_number)
        expected = None
        if self._board is not None:  # stored while the round runs, by its announcers; closed as soon as it ends
            if self._board.announces(round_number):
                self._announcing = asyncio.create_task(self._ask(lambda: self._board.announce(round_number), None))
                self._open_round = round_number
            expected = await self._replica_count()
        try:
            return await self._averaged(round_number, index, expected)
        finally:
            self._close_announcement()
            if self._announcing is not None:
                await self._announcing
                self._announcing = None

    def _close_announcement(self) -> None:
        """Once the round's result is in: store that this replica left it, after its announcement."""
        round_number, announcing = self._open_round, self._announcing
        if round_number is None or announcing is None:
            return
        self._open_round = None

        async def close() -> None:
            await announcing
            await self._ask(lambda: self._board.close(round_number), None)

        self._announcing = asyncio.create_task(close())

    async def _averaged(self, round_number: int, index: int, expected: Optional[int]) -> RoundResult:
        key = index if self.sync.method == "diloco" else -1
        taken = self._hooked.take(round_number)
        if taken is None:
            local, samples, step = await self._on_compute(
                lambda c: (self._local_part(c, index), c.samples_total, c.optimizer.steps))
        else:
            local, samples, step = taken.local, taken.samples, taken.step
        snapshot = torch.cat([self._partition.gather(self._anchor, index), local]) \
            if self.sync.method == "diloco" else local
        weight = peer_weight(samples - self._samples_at_round[key], self.worker.phase == Phase.MEMBER)
        self._samples_at_round[key] = samples
        if expected == 1:
            result = RoundResult("alone", round_number, None)
        else:
            # The metadata crosses to the other replicas as msgpack, which takes a plain str, not the enum.
            result = await asyncio.to_thread(
                self.averager.average, snapshot, round_number=round_number, weight=weight, group_size=expected,
                metadata={"slice": index, "method": self.sync.method, "phase": str(self.worker.phase)})
        # The stage's replicas get a round's result at the same moment, but apply it after their
        # own queued compute: which round comes next is settled now, not after the apply.
        self._hooked.reserve(round_number, self.worker.compute.optimizer.steps)
        self._close_announcement()
        if self.sync.method == "diloco":
            applied_at = await self._diloco_outer_step(result, index, snapshot)
        else:
            applied_at = await self._sparta_apply(result, index, snapshot)
        lag = 0 if applied_at is None else applied_at - step
        self._check_count(result, expected)
        self.stats.record(result, applied_at is not None, lag)
        self._log(result, index, weight, applied_at is not None, lag)
        for observer in self.round_observers:
            observer(result, index, applied_at is not None)
        return result

    def _on_step(self, compute: StageCompute) -> None:
        """Step hook (compute thread): snapshot the round due at exactly this step; wake the loop."""
        steps, every = compute.optimizer.steps, self.sync.every_steps
        if steps % every or steps // every <= self._hook_round or self._stopping.is_set():
            return
        round_number = self._hook_round = steps // every
        started = time.perf_counter()
        local = self._local_part(compute, round_slice(round_number, self.sync.n_slices))
        self.stats.add_compute_blocked(time.perf_counter() - started)
        self._hooked.put(Hooked(round_number, local, compute.samples_total, steps))
        self._event_loop.call_soon_threadsafe(self._wake.set)

    def _carry_into_hooked(self, index: int, delta: torch.Tensor) -> None:
        """(compute thread, in an apply) A snapshot of the same slice that the hook took before this
        apply gets the same delta. It is what the next round averages; without the delta the next
        round would undo this one's corrections, leaving each replica its own offset from the mean
        with the sign swapped (possible when rounds are at most `n_slices` rounds apart)."""
        moments_from = second_moment_offset(self.sync, self._partition.buffer_size)
        self._hooked.carry(lambda r: round_slice(r, self.sync.n_slices) == index, delta, moments_from)

    async def _replica_count(self) -> Optional[int]:
        """The live replicas of the stage as last read, read again when the probes' schedule says it
        is due (node/averaging/probes.py says when, and why not at every probe)."""
        if self._probes.replicas_due(time.monotonic()):
            fresh = await self._ask(self._board.replicas, None)
            if fresh is not None:
                self._probes.replicas_read(time.monotonic(), fresh)
        return self._probes.count

    def _check_count(self, result: RoundResult, expected: Optional[int]) -> None:
        """Put the replica count in doubt when a round says it moved (node/averaging/probes.py): its
        group was of another size than the count, or it failed."""
        if expected is not None and expected > 1 and (
                result.outcome == "failed" or (result.participants and result.group_size != expected)):
            self._probes.count_in_doubt()

    def _local_part(self, compute: StageCompute, index: int) -> torch.Tensor:
        """The replica's own values of slice `index` (and, if averaged, its Adam moments there)."""
        partition = self._partition
        parts = [partition.gather(compute.optimizer.parameters, index)]
        if self.sync.method == "sparta" and self.sync.average_optimizer_state:
            for name in ("exp_avg", "exp_avg_sq"):
                moments = _moments(compute, name)
                parts.append(partition.gather(moments, index) if moments is not None
                             else torch.zeros(partition.buffer_size))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _quorate(self, result: RoundResult) -> bool:
        return result.outcome == "committed" and result.group_size >= self.sync.quorum

    async def _sparta_apply(self, result: RoundResult, index: int, snapshot: torch.Tensor) -> Optional[int]:
        """Write the round's delta; the local step count it was written at, or None if nothing was."""
        if not self._quorate(result):
            return None
        delta = result.averaged - snapshot
        if not bool(delta.any()):
            return None  # identical replicas, or every reducer failed: nothing to write
        size = self._partition.buffer_size
        with_moments = self.sync.average_optimizer_state

        def apply(compute: StageCompute) -> int:
            partition = self._partition
            compute.weights_changing()
            partition.scatter_add(compute.optimizer.parameters, index, delta[:size])
            if with_moments:
                exp_avg, exp_avg_sq = _moments(compute, "exp_avg"), _moments(compute, "exp_avg_sq")
                if exp_avg is not None and exp_avg_sq is not None:
                    partition.scatter_add(exp_avg, index, delta[size:2 * size])
                    second = partition.gather(exp_avg_sq, index).add_(delta[2 * size:]).clamp_min_(0.0)
                    partition.scatter(exp_avg_sq, index, second)
            self._carry_into_hooked(index, delta)
            return compute.optimizer.steps

        return await self._on_compute(apply)

    async def _diloco_outer_step(self, result: RoundResult, index: int, snapshot: torch.Tensor) -> Optional[int]:
        size = self._partition.buffer_size
        if self._quorate(result):
            averaged = result.averaged
        elif result.outcome == "alone" and self.sync.quorum <= 1:
            averaged = snapshot  # a quorum of one: the outer step on this replica's own delta
        else:
            return None
        partition = self._partition

        def outer_step() -> torch.Tensor:  # off the event loop: a fragment can be large
            momentum = partition.gather(self._momentum, index)
            new_anchor = outer_nesterov_step(averaged[:size], averaged[size:], momentum, self.sync.outer_lr,
                                             self.sync.outer_momentum)
            partition.scatter(self._momentum, index, momentum)
            partition.scatter(self._anchor, index, new_anchor)
            return new_anchor - snapshot[size:]  # delta rule: keep the local steps taken during the round

        delta = await asyncio.to_thread(outer_step)

        def apply(compute: StageCompute) -> int:
            compute.weights_changing()
            partition.scatter_add(compute.optimizer.parameters, index, delta)
            self._carry_into_hooked(index, delta)
            return compute.optimizer.steps

        return await self._on_compute(apply)

    # ------------------------------------------------------------------ helpers

    async def _on_compute(self, fn: Callable[[StageCompute], object]):
        def timed(compute: StageCompute):
            started = time.perf_counter()
            try:
                return fn(compute)
            finally:
                self.stats.add_compute_blocked(time.perf_counter() - started)

        return await self.worker.on_compute(timed)

    async def _ask(self, request: Callable, default):
        """A board request; a DHT hiccup costs at most this round's shortcut, never the loop."""
        try:
            return await request()
        except Exception as error:
            self._logger.debug("round board request failed: %s", error)
            return default

    def _log(self, result: RoundResult, index: int, weight: float, applied: bool, lag_steps: int) -> None:
        fields = {
            "round": result.round, "slice": index, "method": self.sync.method, "outcome": result.outcome,
            "applied": applied, "lag_steps": lag_steps, "participants": result.group_size,
            "weights": ",".join(f"{w:g}" for w in result.weights) or f"{weight:g}",
            "received": f"{result.received_fraction:.3f}", "bytes": result.bytes_sent + result.bytes_received,
            "duration_s": f"{result.duration_s:.3f}",
        }
        if result.rejections:  # by reason (dht/robust.py): what this replica's reducer and guard stopped
            fields["rejected"] = ",".join(f"{reason}:{n}" for reason, n in sorted(result.rejections.items()))
        if result.clipped_coordinates:
            fields["clipped_coordinates"] = result.clipped_coordinates
        if result.error:
            fields["error"] = repr(result.error)
        level = logging.WARNING if result.outcome in ("failed", "rejected") or result.rejected else logging.INFO
        self._logger.log(level, "averaging %s", " ".join(f"{k}={v}" for k, v in fields.items()),
                         extra={"milestone": "averaging_round", "fields": fields})


def _matches(tensors: list, numels: list[int]) -> bool:
    return all(isinstance(t, torch.Tensor) for t in tensors) and [t.numel() for t in tensors] == numels


def _moments(compute: StageCompute, name: str) -> Optional[list[torch.Tensor]]:
    """Adam's `name` state for every parameter, or None before the first step created it."""
    state = compute.optimizer.optimizer.state
    tensors = [state.get(p, {}).get(name) for p in compute.optimizer.parameters]
    return None if any(t is None for t in tensors) else tensors
