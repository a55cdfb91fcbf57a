"""Synchronous mode's order of accumulation: every stage adds a global batch's microbatch
gradients in index order, whatever order they finish in.

Float addition is not associative. Two microbatches in flight finish in either order, and with
four per batch the third can reach a stage before the second: the stage's gradient sum then
differs in its last bits from train-local's (which adds microbatches in index order) and from one
run of the same command to the next, and a synchronous run is meant to be exactly reproducible
(`demo --sync` equals `train-local`; a killed run resumes to the same tensors). So in synchronous
mode a call that accumulates (the tail's Forward, a head or body's Backward) waits until the
calls of every earlier microbatch of the batch have accumulated at that stage. Forwards that
only compute, and everything in asynchronous mode, never wait.

A microbatch rerun after a failed route goes when its predecessors are done: if an earlier attempt
had accumulated at a stage and was taken back (Abort), later microbatches may have gone ahead of
it there, so a rerouted synchronous run is close to, not bit for bit, the centralized one. A
microbatch that fails for good abandons the batch: every call still waiting gives up at once
(`BatchAbandoned`) instead of waiting for a turn that never comes.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

__all__ = ["AccumulationOrder", "BatchAbandoned"]


class BatchAbandoned(RuntimeError):
    """An earlier microbatch of this global batch failed for good: its turn never comes."""


class AccumulationOrder:
    """One global batch's turns, per stage. Use inside one event loop."""

    def __init__(self, n_stages: int):
        self._done: list[set[int]] = [set() for _ in range(n_stages)]
        self._changed = asyncio.Condition()
        self._abandoned = False

    def _may_go(self, stage: int, index: int) -> bool:
        return self._abandoned or all(earlier in self._done[stage] for earlier in range(index))

    @contextlib.asynccontextmanager
    async def turn(self, stage: int, index: int) -> AsyncIterator[None]:
        """Hold microbatch `index`'s accumulating call to `stage` until its predecessors' are done;
        it counts as done only if the call returns."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._may_go(stage, index))
        if self._abandoned:
            raise BatchAbandoned(f"stage {stage}: an earlier microbatch of this batch failed for good")
        yield
        async with self._changed:
            self._done[stage].add(index)
            self._changed.notify_all()

    async def abandon(self) -> None:
        async with self._changed:
            self._abandoned = True
            self._changed.notify_all()
