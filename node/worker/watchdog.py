"""The worker's watchdog: a task in the worker's own process that samples the node's health and,
on the first rule tripped (node/worker/watchdog_rules.py), makes it leave as a signal does.

What it samples, every `check_s`:
- the calls that failed on this replica's own non-finite loss or gradient (`StageWorker.compute_errors`);
- averaging rounds failed and committed (`AveragingStats`);
- the process's resident memory against the machine's RAM (/proc/self/statm; not measured where
  there is none), and the accelerator memory torch holds against the device's;
- how long a no-op job given to the compute thread has waited: one probe at a time, a new one once
  the last has run, so a compute job or a handler that blocks the thread shows as a probe that
  waits on (the thread is the stage's one; nothing else measures whether it still moves);
- the renewer's renewals in a row without an answer;
- whether this node's own peer id is in the ban list its DHT holds.

Turned off (`WatchdogOptions.enabled`, `join --no-watchdog`) it starts no task: nothing sampled.
On a trip it logs one line (milestone `watchdog_tripped`, the rule and its figures), counts
`agora_worker_watchdog_trips_total{reason=rule}`, calls `on_trip(trip)` once and ends: the daemon
(node/worker/join.py) then leaves cleanly and exits with the rule's code. Sampling never raises
into the daemon: a sample that fails is logged and the next check tries again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from concurrent.futures import Future
from typing import Callable, Optional

import torch

from agora.auth.admission import CredentialRenewer
from agora.dht.swarm import SwarmDHT
from agora.monitor.worker_metrics import WorkerMetrics
from agora.node.averaging.stats import AveragingStats
from agora.node.worker.watchdog_rules import Trip, WatchdogOptions, WatchdogSample, first_tripped
from agora.node.worker.worker import StageWorker
from agora.pipeline.runtime import device_memory

__all__ = ["NodeHealth", "Watchdog"]

logger = logging.getLogger("agora.node.watchdog")


def _resident_bytes() -> Optional[int]:
    """This process's resident memory, or None where /proc is not there."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class NodeHealth:
    """Takes a `WatchdogSample` of one worker: its compute thread, its averaging, its renewer, its ban."""

    def __init__(self, worker: StageWorker, *, rounds: Callable[[], dict[str, int]] = dict,
                 renewal_failures: Callable[[], int] = lambda: 0, banned: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.monotonic):
        self._worker, self._rounds, self._renewal_failures, self._banned = worker, rounds, renewal_failures, banned
        self._clock = clock
        self._host_total = device_memory(torch.device("cpu")).total_bytes
        device = worker.compute.runtime.device
        self._device = device if device.type == "cuda" else None
        self._device_total = device_memory(device).total_bytes if self._device is not None else None
        self._probe: Optional[Future] = None
        self._probe_at = 0.0

    @classmethod
    def of(cls, worker: StageWorker, swarm: SwarmDHT, stats: Optional[AveragingStats],
           renewer: Optional[CredentialRenewer]) -> "NodeHealth":
        """A daemon's: its worker, its averaging (if any), its renewer (if any), its own id in its DHT's ban list."""
        return cls(worker, rounds=(lambda: stats.rounds) if stats is not None else dict,
                   renewal_failures=(lambda: renewer.failures) if renewer is not None else (lambda: 0),
                   banned=lambda: swarm.bans.is_banned(swarm.peer_id))

    def _compute_wait_s(self, now: float) -> float:
        if self._probe is not None and not self._probe.done():
            return now - self._probe_at
        self._probe, self._probe_at = self._worker.submit_compute(lambda compute: None), now
        return 0.0

    def sample(self) -> WatchdogSample:
        now = self._clock()
        rounds = self._rounds()
        return WatchdogSample(
            at=now, non_finite=self._worker.compute_errors, failed_rounds=rounds.get("failed", 0),
            committed_rounds=rounds.get("committed", 0), host_bytes=_resident_bytes(),
            host_total_bytes=self._host_total,
            device_bytes=int(torch.cuda.memory_reserved(self._device)) if self._device is not None else None,
            device_total_bytes=self._device_total, compute_wait_s=self._compute_wait_s(now),
            renewal_failures=self._renewal_failures(), banned=self._banned())


class Watchdog:
    """Every `options.check_s`: a sample, the rules over the window's samples, and on a trip `on_trip`."""

    def __init__(self, options: WatchdogOptions, sample: Callable[[], WatchdogSample], on_trip: Callable[[Trip], None],
                 *, metrics: Optional[WorkerMetrics] = None):
        self.options, self._sample, self._on_trip, self._metrics = options, sample, on_trip, metrics
        self._samples: collections.deque[WatchdogSample] = collections.deque()
        self._task: Optional[asyncio.Task] = None
        self.tripped: Optional[Trip] = None

    def check(self) -> Optional[Trip]:
        """Take one sample and judge the window; the trip, or None."""
        sample = self._sample()
        self._samples.append(sample)
        while sample.at - self._samples[0].at > self.options.window_s:
            self._samples.popleft()
        return first_tripped(self.options, self._samples)

    async def run(self) -> None:
        while True:
            try:
                trip = self.check()
            except Exception as error:  # a sample that failed: the next check tries again
                logger.warning("watchdog: could not sample the node's health: %s", error)
                trip = None
            if trip is not None:
                return self._trip(trip)
            await asyncio.sleep(self.options.check_s)

    def _trip(self, trip: Trip) -> None:
        self.tripped = trip
        logger.error("watchdog: %s tripped; leaving the run (exit %d)", trip.describe(), trip.exit_code,
                     extra={"milestone": "watchdog_tripped", "fields": {
                         "rule": trip.rule, "exit_code": trip.exit_code, **trip.figures}})
        if self._metrics is not None:
            self._metrics.watchdog_tripped(trip.rule)
        self._on_trip(trip)

    def start(self) -> Optional[asyncio.Task]:
        """The checking task; None when the options turn the watchdog off (no sample is ever taken)."""
        if self._task is None and self.options.enabled:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="watchdog")
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
