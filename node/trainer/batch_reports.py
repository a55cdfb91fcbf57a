"""`CompletedBatchReports`: asynchronous mode tells each stage's workers that a global batch is done.

Without a Step barrier, a replica steps when it is told a global batch is done (`Step` with
`completed_batch`, node/replica/epoch.py): this trainer tells every worker of a stage it knows the
moment the batch's last microbatch has passed that stage (the tail first, the head last), not when
the whole pipeline is done, so the next batch's first microbatches do not run on weights a step old.

Design choices:

- In the background, best effort, a short timeout each: the training loop never waits on a slow
  worker's report. A report that did not reach its replica's count (the worker busy, unreachable,
  its lease read unanswered, or past the call's deadline) is sent again, up to ``REPORT_TRIES``
  times in all, while that worker is still in the roster: a report counts once, so a second send
  of one that did land replays its reply. A replica that misses a report for good lags its stage
  by a step, for the rest of the run if no later report is far enough ahead to catch up on. A refusal because the
  report is outside the worker's window or names a unit it does not see this trainer hold is
  counted and the next reports are sent; a worker that refuses them for good (it steps on its own
  count, or is synchronous) is not told again.
- Told are the stage's workers in the roster, and for ``REMEMBERED_S`` also a worker whose record a
  refresh missed (its heartbeat late on a loaded DHT: the roster holds what the last read returned).
  Without that, a live replica missing from one refresh would miss that batch's report with nothing
  counted against it, and lag its stage by a step. A worker the roster shows on another
  stage (it moved) is told there only; one truly gone fails its report once.
- A call to a replica first waits for the report sent to it last (`reported`): the only wait, in
  the race where a microbatch of the next batch overtakes the report, and only on that replica.
- A unit is committed once every stage has taken its report (`taken`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc

from agora.node.trainer.routing import Roster, WorkerView
from agora.node.trainer.stage_client import (OutsideWindow, RequestRefused, StageCallError, StageClient, WorkerBusy,
                                             WorkerUnreachable)
from agora.node.trainer.stats import TrainerStats

__all__ = ["REMEMBERED_S", "REPORT_TRIES", "CompletedBatchReports"]

logger = logging.getLogger("agora.node.trainer")

# How long a worker missing from the roster's refreshes is still told of completed batches.
REMEMBERED_S = 60.0
# Sends of one report to one replica, the first included (see the module docstring).
REPORT_TRIES = 3
# Pause before the second send when the worker named none (doubled before each later one).
_RETRY_PAUSE_S = 0.25


class CompletedBatchReports:
    """Reports finished global batches to `roster`'s workers through `client` (module docstring)."""

    def __init__(self, roster: Roster, client: Callable[[WorkerView], StageClient], stats: TrainerStats, *,
                 microbatches: int, call_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.roster, self._client, self.stats = roster, client, stats
        self.microbatches, self.call_timeout_s = microbatches, call_timeout_s
        self._in_flight: set[asyncio.Task] = set()  # reports still in flight
        self.unreported: set[str] = set()  # peers that refused a report (they step on their own)
        # Per stage and replica, the report sent last; a call waits for its replica's.
        self._last_sent: dict[int, dict[str, asyncio.Task]] = {}
        self._clock = clock
        self._seen: dict[int, dict[str, tuple[WorkerView, float]]] = {}  # per stage: its workers, last in the roster at
        self._of_unit: dict[int, list[asyncio.Task]] = {}  # a unit commits once its reports are in

    async def reported(self, stage: int, peer_id: str) -> None:
        """Wait until the replica about to be called has taken the completed-batch report sent to it last.

        A stage is told a global batch is done the moment its last microbatch has passed it, but a
        microbatch of the next batch can be on its way there already; without this wait it could
        reach a replica before the report and run on weights a step old (1 in 10 tail forwards on
        tiny). The wait is at most one report's round trip, and only in that race; only for the
        replica called, so a hung replica costs its own traffic and never its stage's.
        """
        pending = self._last_sent.get(stage, {}).get(peer_id)
        if pending is not None and not pending.done():
            await pending  # failures are counted inside, never raised

    def send(self, unit_id: int, stage: int) -> None:
        """Tell every known worker of `stage`, in the background, that global batch `unit_id` is done there.

        The reports are tasks with a short timeout each (`drain` waits for the last ones); a worker that
        misses one lags its stage by a step.
        """
        timeout = min(5.0, self.call_timeout_s)

        views = [v for v in self.recipients(stage) if v.peer_id not in self.unreported]
        n_micro, replicas = self.microbatches, self.roster.replicas(stage)

        async def one(view: WorkerView) -> None:
            try:
                await self._send(view, unit_id, n_micro, replicas, timeout, stage)
            except OutsideWindow as error:
                # It lags or runs ahead of its stage: keep telling it, it re-anchors to the stage's count.
                self.stats.report_refused()
                logger.debug("completed-batch report %d refused by %s: %s", unit_id, view.endpoint, error)
            except RequestRefused as error:
                if error.code == grpc.StatusCode.PERMISSION_DENIED:
                    # This trainer does not hold the unit as that worker reads the lease queue (it lost
                    # it, or the worker's read lags): this report is refused, the next ones are sent.
                    self.stats.report_refused()
                    logger.debug("completed-batch report %d refused by %s: %s", unit_id, view.endpoint, error)
                    return
                # It steps on its own count (join --local-batch) or is synchronous: stop telling it.
                self.unreported.add(view.peer_id)
                logger.warning("worker %s refuses completed-batch reports; not sending it more: %s",
                               view.endpoint, error)
            except StageCallError as error:
                # That worker lags one step behind its stage (or is gone); training goes on.
                self.stats.report_failed()
                logger.debug("completed-batch report %d to %s failed: %s", unit_id, view.endpoint, error)

        tasks = {view.peer_id: asyncio.create_task(one(view)) for view in views}
        self._last_sent[stage] = tasks
        self._of_unit.setdefault(unit_id, []).extend(tasks.values())
        for task in tasks.values():
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    def recipients(self, stage: int) -> list[WorkerView]:
        """The workers of `stage` to tell: the roster's, and those a refresh missed lately (module docstring)."""
        now = self._clock()
        seen = self._seen.setdefault(stage, {})
        for view in self.roster.of_stage(stage):
            seen[view.peer_id] = (view, now)
        for peer, (_, at) in list(seen.items()):
            current = self.roster.workers.get(peer)
            moved = current is not None and current.stage != stage
            if moved or peer in self.roster.excluded or (current is None and now - at > REMEMBERED_S):
                del seen[peer]
        return [view for view, _ in seen.values()]

    async def _send(self, view: WorkerView, unit_id: int, microbatches: int, replicas: int, timeout_s: float,
                    stage: int) -> None:
        """One report to one replica, sent again while it did not land (module docstring); the last
        failure is raised."""
        for attempt in range(REPORT_TRIES):
            try:
                await self._client(view).batch_done(unit_id, microbatches, replicas, timeout_s=timeout_s)
                return
            except (WorkerBusy, WorkerUnreachable) as error:
                gone = all(v.peer_id != view.peer_id for v in self.roster.of_stage(stage))
                if attempt + 1 == REPORT_TRIES or gone:
                    raise
                pause = getattr(error, "pushback_s", None)
                await asyncio.sleep(pause if pause is not None else _RETRY_PAUSE_S * 2 ** attempt)
                self.stats.report_retried()
                logger.debug("completed-batch report %d to %s sent again (try %d): %s", unit_id, view.endpoint,
                             attempt + 2, error)

    async def taken(self, unit_id: int) -> None:
        """Until every stage has taken (or failed to take) its report of global batch `unit_id`."""
        await asyncio.gather(*self._of_unit.pop(unit_id, []))

    async def drain(self) -> None:
        """Until every report in flight has landed or failed (short timeouts each)."""
        await asyncio.gather(*self._in_flight, return_exceptions=True)
