"""A worker's checkpoints: every `every` optimizer steps and when it leaves; and the resume.

Design choices:
- The snapshot is taken in a step hook on the compute thread (`StageCompute.step_hooks`), the one
  thread that touches the stage: parameters, optimizer state and RNG exactly at a step boundary,
  cloned, so training goes on while the write (fsync, rename: pipeline/checkpoint.py) runs in
  another thread. In synchronous mode that boundary is the barrier's, which is what makes a
  resumed run equal the uninterrupted one tensor for tensor.
- One write at a time, and at most one snapshot waiting: one that comes due while the previous
  write runs replaces the waiting one, so a slow disk never piles copies of the stage in memory.
  A snapshot costs one copy of the stage's parameters and Adam moments in host memory while it
  is written.
- The averaging loop's state and the worker's phase go with it (`extra`), read on the event loop
  when the snapshot is handed over.
- The work keys the saved weights hold go with them (node/replica/work_ledger.py), so a resumed
  worker does not add a reclaimed unit's gradient a second time.
- Resume refuses a checkpoint of another model or stage, puts the RNG and the work keys back,
  and returns what the join daemon needs to go on: the step, the averaging state, and `extra`.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Optional

from agora.node.averaging.loop import AveragingLoop
from agora.node.replica.compute import StageCompute
from agora.node.membership.state_transfer import snapshot_stage
from agora.node.replica.work_ledger import WorkLedger
from agora.node.worker.worker import StageWorker
from agora.pipeline.checkpoint import CheckpointError, StageState, load_checkpoint, restore_rng, save_checkpoint
from agora.pipeline.config import ConfigError, RunConfig

__all__ = ["StageCheckpointer", "checkpoint_snapshot", "restore_stage"]

logger = logging.getLogger("agora.node.join")


def checkpoint_snapshot(compute: StageCompute) -> StageState:
    """(compute thread) `snapshot_stage` plus the work keys the parameters hold (work_ledger.py),
    which a checkpoint keeps and a weight sync does not send."""
    state = snapshot_stage(compute)
    state.work = compute.work_in_weights()
    return state


class StageCheckpointer:
    """Periodic checkpoints of one started worker's stage into `directory`; `every` 0: only `final()`."""

    def __init__(self, worker: StageWorker, directory: str | Path, config: RunConfig, every: int,
                 averaging: Optional[AveragingLoop] = None):
        if every < 0:
            raise ValueError(f"checkpoint interval must be >= 0 steps, got {every}")
        self.worker, self.directory, self.config, self.every = worker, Path(directory), config, every
        self.averaging = averaging
        self.written: list[Path] = []
        self._waiting: Optional[tuple[int, StageState]] = None
        self._wake = asyncio.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None
        self._stopping = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.every:
            await self.worker.on_compute(lambda compute: compute.step_hooks.append(self._on_step))
        self._task = asyncio.create_task(self._write_loop(), name="checkpoints")

    async def stop(self) -> None:
        """Stop snapshotting; the write under way and one waiting still land before this returns."""
        if self.every:
            try:
                await self.worker.on_compute(lambda compute: compute.step_hooks.remove(self._on_step))
            except (RuntimeError, ValueError):
                pass  # the compute thread is gone already
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None

    async def final(self, compute: StageCompute, *, phase: str) -> Path:
        """The checkpoint written when the worker leaves (its compute thread is shut down by then,
        so nothing else touches the stage); `phase`: the one it had before it began to leave."""
        return await self._write(compute.optimizer.steps, checkpoint_snapshot(compute), phase=phase)

    def _on_step(self, compute: StageCompute) -> None:  # compute thread, right after a step
        if compute.optimizer.steps % self.every:
            return
        snapshot = (compute.optimizer.steps, checkpoint_snapshot(compute))
        self._loop.call_soon_threadsafe(self._hand_over, snapshot)

    def _hand_over(self, snapshot: tuple[int, StageState]) -> None:
        self._waiting = snapshot  # replaces one still waiting: the newest wins
        self._wake.set()

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting is not None:
                step, state = self._waiting
                self._waiting = None
                try:
                    await self._write(step, state)
                except OSError as error:  # a full or failing disk: say so, keep training, try at the next one
                    logger.error("checkpoint of step %d not written: %s", step, error)
            if self._stopping:
                return

    async def _write(self, step: int, state: StageState, phase: Optional[str] = None) -> Path:
        if self.averaging is not None:
            state.averaging = self.averaging.state_dict(self._samples(state))
        extra = {"phase": phase or self.worker.phase, "samples_total": self._samples(state)}
        path = await asyncio.to_thread(save_checkpoint, self.directory, step, self.config, [state], extra)
        self.written.append(path)
        logger.info("checkpoint written: %s", path, extra={"milestone": "checkpoint_written",
                                                          "fields": {"stage": state.index, "step": step, "path": str(path)}})
        return path

    @staticmethod
    def _samples(state: StageState) -> int:
        return int(state.optimizer.get("samples_total", 0)) if state.optimizer else 0


def restore_stage(compute: StageCompute, directory: str | Path, config: RunConfig, *, step: Optional[int] = None
                  ) -> tuple[int, Optional[dict], dict[str, Any]]:
    """(compute thread) Load the stage, its optimizer and RNG from `directory` (its checkpoint of
    `step`, else the newest complete one); (step, averaging state or None, extra)."""
    try:
        saved_step, saved_config, states, extra = load_checkpoint(directory, step=step)
    except CheckpointError as error:
        raise ConfigError(f"--checkpoint-dir: {error}") from None
    if saved_config.model != config.model or [s.index for s in states] != [compute.index]:
        raise ConfigError(f"--checkpoint-dir: {directory} holds another model or stage than stage {compute.index}")
    state = states[0]
    work = WorkLedger(compute.work.capacity)
    try:
        work.restore(state.work if state.work is not None else [])  # a checkpoint from before the ledger: none
    except ValueError as error:
        raise ConfigError(f"--checkpoint-dir: {directory}: {error}") from None
    compute.stage.load_state_dict(state.model)
    optimizer = dict(state.optimizer)
    samples = int(optimizer.pop("samples_total", 0))
    compute.optimizer.load_state_dict(optimizer)
    compute.samples_total = samples
    compute.work = work
    restore_rng(state.rng)
    return saved_step, state.averaging, extra
