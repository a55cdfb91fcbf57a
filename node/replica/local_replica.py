"""A stage replica without its gRPC server: the compute thread and what the averaging loop reads.

`AveragingLoop` needs from a worker only `on_compute`, `compute`, `phase` and `is_serving`.
Tests that also start hivemind processes use this instead of `StageWorker`: hivemind forks, and
a process that has run gRPC servers does not fork reliably (gRPC's fork handlers are skipped).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from agora.node.replica.compute import StageCompute
from agora.node.replica.stash import ForwardStash
from agora.pipeline.codec import WireCodec
from agora.pipeline.config import RunConfig

T = TypeVar("T")


class LocalReplica:
    """`on_reports`: the compute steps on completed-batch reports (`compute.step`), as a stage's
    replica behind trainers does; otherwise it steps on its own every local batch."""

    def __init__(self, config: RunConfig, stage: int, run_id: str = "test", *, on_reports: bool = False):
        self.phase = "member"
        self._stopped = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        # Built on the compute thread, like StageWorker does: the only thread that touches it.
        self._compute = self._executor.submit(
            StageCompute, config, stage, run_id=run_id, codec=WireCodec("fp32"), stash=ForwardStash(4, 60.0),
            synchronous=False, local_batch=None if on_reports else config.train.batch_size).result()

    @property
    def compute(self) -> StageCompute:
        return self._compute

    @property
    def is_serving(self) -> bool:
        return not self._stopped

    async def on_compute(self, fn: Callable[[StageCompute], T]) -> T:
        return await asyncio.wrap_future(self._executor.submit(fn, self._compute))

    async def stop(self) -> None:
        self._stopped = True
        await asyncio.to_thread(self._executor.shutdown, wait=True)
