"""The worker's background averaging: AsyncSPARTA rounds (or streaming DiLoCo) while it trains.

One asyncio task per worker. It watches the local step count; when a round is due it takes a
snapshot of the round's slice on the compute thread, runs the all-reduce off it (a thread
blocked in `SliceAverager.average`), and applies the result on the compute thread again. The
compute thread is the only one that touches the stage, so both touches go through
`worker.on_compute` and are quick copies; forward, backward and optimizer steps go on meanwhile.

Design choices:
- The step count is polled (a plain int read, as `StageWorker.info` does) instead of hooking
  the worker's step path: rounds are tens of steps apart, so a 50 ms poll costs nothing.
- Replicas step on their own local batches, so their step counts drift apart over a run and
  rounds keyed on each one's own count alone would stop meeting. So a replica announces each
  round it starts (`RoundBoard`, dht/averaging.py) and, every `probe_s`, reads what the others
  announced: a round is due when its own step count reaches it *or* another replica announced
  it. The fastest replica thus sets the pace and the others join it within a probe, well
  inside the matchmaking window it waits for them. Rounds a replica jumps over are counted as
  skipped; announcements expire with the matchmaking window, so nobody joins a closed round.
- At the start of each round the board also gives the live replica count: one (only this
  worker) is an `alone` outcome at once, with no matchmaking wait; more becomes the
  matchmaking target, so a complete group starts without waiting out the window.
- sparta: delta rule `w[slice] += average - snapshot` (node/sparta.py), optionally on the Adam
  moments of the slice too (exp_avg_sq is clamped at 0: a delta could push it negative).
  diloco: fragment round, outer Nesterov on the token-weighted mean delta; a round with fewer
  participants than `quorum` changes nothing (its progress is in the next delta of that fragment).
- Everything a round did ends in one milestone log line (`averaging round=...`) and in
  `AveragingStats`, whose `snapshot()` is a plain dict (the join daemon writes it on exit).
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
from collections import Counter
from typing import Callable, Optional, Protocol

import torch

from agora.dht.averaging import OUTCOMES, RoundResult, SliceAverager
from agora.node.sparta import (
    SlicePartition,
    averaged_vector_size,
    next_round,
    outer_nesterov_step,
    peer_weight,
    round_slice,
)
from agora.node.worker import StageWorker
from agora.node.worker_compute import StageCompute
from agora.pipeline.config import SyncConfig

__all__ = ["AveragingStats", "AveragingLoop", "RoundDirectory"]


class RoundDirectory(Protocol):
    """What the loop needs to know about its stage's other replicas (`RoundBoard` over the DHT)."""

    async def announce(self, round_number: int) -> None: ...

    async def announced_round(self) -> Optional[int]: ...

    async def replicas(self) -> int: ...

# How often the loop looks at its own step count, and how long stop() waits for a round to end.
_POLL_S = 0.05
_STOP_GRACE_S = 10.0


class AveragingStats:
    """Counters of one worker's rounds; `snapshot()` is what metrics and the demo read."""

    def __init__(self, method: str, clock: Callable[[], float] = time.monotonic):
        self.method = method
        self._clock = clock
        self.started = clock()
        self.rounds: Counter[str] = Counter({outcome: 0 for outcome in OUTCOMES})
        self.applied = 0  # rounds whose result changed the parameters
        self.skipped = 0  # rounds that came due while another one ran
        self.group_sizes: Counter[int] = Counter()
        self.received_sum = 0.0
        self.duration_sum = 0.0
        self.duration_max = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.compute_blocked_s = 0.0
        self.last_round: Optional[int] = None
        self.local_steps = 0  # the worker's optimizer steps, as last seen by the loop
        self.vector_elements = 0
        self.parameters = 0

    def record(self, result: RoundResult, applied: bool) -> None:
        self.rounds[result.outcome] += 1
        self.applied += int(applied)
        self.group_sizes[max(1, result.group_size)] += 1
        if result.outcome == "committed":
            self.received_sum += result.received_fraction
        self.duration_sum += result.duration_s
        self.duration_max = max(self.duration_max, result.duration_s)
        self.bytes_sent += result.bytes_sent
        self.bytes_received += result.bytes_received
        self.last_round = result.round

    def snapshot(self) -> dict:
        total = sum(self.rounds.values())
        wall = max(1e-9, self._clock() - self.started)
        return {
            "method": self.method,
            "rounds": total,
            "rounds_by_outcome": dict(self.rounds),
            "applied": self.applied,
            "skipped": self.skipped,
            "group_sizes": {str(size): n for size, n in sorted(self.group_sizes.items())},
            "mean_received_fraction": (self.received_sum / self.rounds["committed"]
                                       if self.rounds["committed"] else None),
            "mean_duration_s": self.duration_sum / total if total else None,
            "max_duration_s": self.duration_max,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "local_steps": self.local_steps,
            "vector_elements": self.vector_elements,
            "parameters": self.parameters,
            "compute_blocked_s": round(self.compute_blocked_s, 6),
            "wall_s": round(wall, 3),
            "compute_blocked_fraction": self.compute_blocked_s / wall,
            "last_round": self.last_round,
        }


class AveragingLoop:
    """Runs `sync.method` rounds for one started `StageWorker` until `stop()`.

    Of the worker it uses `on_compute`, `compute` (read-only, for the step count), `phase` and
    `is_serving`, so anything offering those (a test's bare compute thread) can host it.
    """

    def __init__(self, worker: StageWorker, averager: SliceAverager, sync: SyncConfig, *, seed: int,
                 board: Optional[RoundDirectory] = None, probe_s: Optional[float] = None,
                 logger: Optional[logging.Logger] = None):
        if sync.method not in ("sparta", "diloco"):
            raise ValueError(f"no averaging loop for sync.method {sync.method!r}")
        self.worker = worker
        self.averager = averager
        self.sync = sync
        self.seed = seed
        self.stats = AveragingStats(sync.method)
        self._board = board
        # Well inside the matchmaking window, so a slower replica joins the fastest one's round.
        self.probe_s = probe_s if probe_s is not None else min(10.0, max(0.25, sync.matchmaking_s / 4))
        self._announced: Optional[int] = None
        self._next_probe = 0.0
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

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Build the partition (off the compute thread) and start the loop task."""
        numels, steps, samples = await self._on_compute(
            lambda c: ([p.numel() for p in c.optimizer.parameters], c.optimizer.steps, c.samples_total))
        partition = SlicePartition(numels, self.sync.n_slices, self.seed)
        size = averaged_vector_size(self.sync, partition.buffer_size)
        if size != self.averager.size:
            raise ValueError(f"the averager holds {self.averager.size} values but a round of this stage needs {size}")
        self._partition = await asyncio.to_thread(partition.prepare)
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
                self._anchor = await self._on_compute(lambda c: [p.detach().clone() for p in c.optimizer.parameters])
                self._momentum = [torch.zeros_like(a) for a in self._anchor]
        self._last_round = steps // self.sync.every_steps  # rounds due before we started are not run
        self._samples_at_round = {key: samples for key in range(-1, self.sync.n_slices)}
        if restored is not None:
            self._last_round = max(self._last_round, restored["last_round"])
            for key, since in restored["samples_since_round"].items():
                if key in self._samples_at_round:
                    self._samples_at_round[key] = samples - since
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
        if self._task is None:
            return
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
            if self._board is not None and time.monotonic() >= self._next_probe:
                self._announced = await self._ask(self._board.announced_round, None)
                self._next_probe = time.monotonic() + self.probe_s
            self.stats.local_steps = self.worker.compute.optimizer.steps
            decision = next_round(self.stats.local_steps, self.sync.every_steps, self._last_round,
                                  announced=self._announced)
            if decision.round is None:
                try:
                    await asyncio.wait_for(self._stopping.wait(), _POLL_S)
                except asyncio.TimeoutError:
                    pass
                continue
            self.stats.skipped += decision.skipped
            self._last_round = decision.round
            try:
                await self.run_round(decision.round)
            except RuntimeError as error:
                if not self.worker.is_serving:  # the worker is stopping: its compute thread is gone
                    return
                self._logger.exception("averaging round %d failed: %s", decision.round, error)
            except Exception:
                self._logger.exception("averaging round %d failed", decision.round)

    # ------------------------------------------------------------------ one round

    async def run_round(self, round_number: int) -> RoundResult:
        """Run one round now (the loop calls this; tests may call it directly)."""
        if self._partition is None:
            raise RuntimeError("start() the loop first")
        index = round_slice(round_number, self.sync.n_slices)
        self._last_round = max(self._last_round, round_number)
        expected = None
        if self._board is not None:
            _, expected = await asyncio.gather(self._ask(lambda: self._board.announce(round_number), None),
                                               self._ask(self._board.replicas, None))
        key = index if self.sync.method == "diloco" else -1
        snapshot, samples = await self._on_compute(lambda c: self._snapshot(c, index))
        weight = peer_weight(samples - self._samples_at_round[key], self.worker.phase == "member")
        self._samples_at_round[key] = samples
        if expected == 1:
            result = RoundResult("alone", round_number, None)
        else:
            result = await asyncio.to_thread(
                self.averager.average, snapshot, round_number=round_number, weight=weight, group_size=expected,
                metadata={"slice": index, "method": self.sync.method})
        if self.sync.method == "diloco":
            applied = await self._diloco_outer_step(result, index, snapshot)
        else:
            applied = await self._sparta_apply(result, index, snapshot)
        self.stats.record(result, applied)
        self._log(result, index, weight, applied)
        return result

    def _snapshot(self, compute: StageCompute, index: int) -> tuple[torch.Tensor, int]:
        partition = self._partition
        params = compute.optimizer.parameters
        if self.sync.method == "diloco":
            parts = [partition.gather(self._anchor, index), partition.gather(params, index)]
        else:
            parts = [partition.gather(params, index)]
            if self.sync.average_optimizer_state:
                for name in ("exp_avg", "exp_avg_sq"):
                    moments = _moments(compute, name)
                    parts.append(partition.gather(moments, index) if moments is not None
                                 else torch.zeros(partition.buffer_size))
        return torch.cat(parts) if len(parts) > 1 else parts[0], compute.samples_total

    def _quorate(self, result: RoundResult) -> bool:
        return result.outcome == "committed" and result.group_size >= self.sync.quorum

    async def _sparta_apply(self, result: RoundResult, index: int, snapshot: torch.Tensor) -> bool:
        if not self._quorate(result):
            return False
        delta = result.averaged - snapshot
        if not bool(delta.any()):
            return False  # identical replicas, or every reducer failed: nothing to write
        size = self._partition.buffer_size
        with_moments = self.sync.average_optimizer_state

        def apply(compute: StageCompute) -> None:
            partition = self._partition
            partition.scatter_add(compute.optimizer.parameters, index, delta[:size])
            if with_moments:
                exp_avg, exp_avg_sq = _moments(compute, "exp_avg"), _moments(compute, "exp_avg_sq")
                if exp_avg is not None and exp_avg_sq is not None:
                    partition.scatter_add(exp_avg, index, delta[size:2 * size])
                    second = partition.gather(exp_avg_sq, index).add_(delta[2 * size:]).clamp_min_(0.0)
                    partition.scatter(exp_avg_sq, index, second)

        await self._on_compute(apply)
        return True

    async def _diloco_outer_step(self, result: RoundResult, index: int, snapshot: torch.Tensor) -> bool:
        size = self._partition.buffer_size
        if self._quorate(result):
            averaged = result.averaged
        elif result.outcome == "alone" and self.sync.quorum <= 1:
            averaged = snapshot  # a quorum of one: the outer step on this replica's own delta
        else:
            return False
        partition = self._partition

        def outer_step() -> torch.Tensor:  # off the event loop: a fragment can be large
            momentum = partition.gather(self._momentum, index)
            new_anchor = outer_nesterov_step(averaged[:size], averaged[size:], momentum, self.sync.outer_lr,
                                             self.sync.outer_momentum)
            partition.scatter(self._momentum, index, momentum)
            partition.scatter(self._anchor, index, new_anchor)
            return new_anchor - snapshot[size:]  # delta rule: keep the local steps taken during the round

        delta = await asyncio.to_thread(outer_step)
        await self._on_compute(lambda c: partition.scatter_add(c.optimizer.parameters, index, delta))
        return True

    # ------------------------------------------------------------------ helpers

    async def _on_compute(self, fn: Callable[[StageCompute], object]):
        def timed(compute: StageCompute):
            started = time.perf_counter()
            try:
                return fn(compute)
            finally:
                self.stats.compute_blocked_s += time.perf_counter() - started

        return await self.worker.on_compute(timed)

    async def _ask(self, request: Callable, default):
        """A board request; a DHT hiccup costs at most this round's shortcut, never the loop."""
        try:
            return await request()
        except Exception as error:
            self._logger.debug("round board request failed: %s", error)
            return default

    def _log(self, result: RoundResult, index: int, weight: float, applied: bool) -> None:
        fields = {
            "round": result.round, "slice": index, "method": self.sync.method, "outcome": result.outcome,
            "applied": applied, "participants": result.group_size,
            "weights": ",".join(f"{w:g}" for w in result.weights) or f"{weight:g}",
            "received": f"{result.received_fraction:.3f}", "bytes": result.bytes_sent + result.bytes_received,
            "duration_s": f"{result.duration_s:.3f}",
        }
        if result.error:
            fields["error"] = repr(result.error)
        level = logging.WARNING if result.outcome in ("failed", "rejected") else logging.INFO
        self._logger.log(level, "averaging %s", " ".join(f"{k}={v}" for k, v in fields.items()),
                         extra={"milestone": "averaging_round", "fields": fields})


def _matches(tensors: list, numels: list[int]) -> bool:
    return all(isinstance(t, torch.Tensor) for t in tensors) and [t.numel() for t in tensors] == numels


def _moments(compute: StageCompute, name: str) -> Optional[list[torch.Tensor]]:
    """Adam's `name` state for every parameter, or None before the first step created it."""
    state = compute.optimizer.optimizer.state
    tensors = [state.get(p, {}).get(name) for p in compute.optimizer.parameters]
    return None if any(t is None for t in tensors) else tensors
