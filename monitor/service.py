"""`agora-node monitor`: the swarm seen from the DHT, read-only, served over HTTP.

Life: join the DHT as a client peer (with a `monitor` credential when the run has admission:
admitted peers answer its reads and refuse its stores, dht/security.py), then every
`poll_s` read every stage's worker records and the run's trainer records, turn them into a
`SwarmView` (monitor/swarm_view.py) and swap it in; the HTTP port (monitor/http.py) serves
whatever view is current. A poll that fails (a DHT timeout) is counted and logged and the
previous view stays, so a scrape never fails because the DHT hiccupped. SIGTERM/SIGINT stop it.

A metrics endpoint the scrape policy leaves out of `/sd` (monitor/scrape_policy.py) is logged
naming the record's peer and counted (`agora_monitor_scrape_targets_left_out_total`) once per
peer, endpoint and reason, not at every poll: the same record is read every `poll_s`.

With `ledger` (a sqlite file) and the run's root certificate, the monitor also keeps the run's
ledger of verified work (monitor/ledger.py): the trainers post their signed receipts to its HTTP
port, and each is checked against the worker's own count of what it served, read from the worker's
announced metrics endpoint (monitor/served_counts.py).

The DHT process is forked before the HTTP server's thread exists (hivemind forks; a process
with threads does not fork reliably).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time
from typing import Optional

from prometheus_client import CollectorRegistry

from agora.auth.credentials import CredentialVerifier
from agora.dht.keys import trainer_key
from agora.dht.records import TrainerRecord
from agora.dht.swarm import DHTRequestError, SwarmDHT
from agora.monitor.http import MonitorServer, start_monitor_server
from agora.monitor.ledger import LedgerMetrics, ReceiptLedger, ServedCount
from agora.monitor.options import MonitorOptions
from agora.monitor.scrape_policy import REFUSAL_REASONS
from agora.monitor.served_counts import served_count
from agora.monitor.swarm_metrics import MonitorMetrics, SwarmCollector
from agora.monitor.swarm_view import EvalHistory, LeftOutTarget, LossHistory, SwarmView, summarize

__all__ = ["SwarmMonitor", "run_monitor"]

logger = logging.getLogger("agora.monitor")

_REPORTED_CAPACITY = 4096


class SwarmMonitor:
    """Polls `swarm` for run `run_id` (of `n_stages` stages, or more when its workers say so) and
    serves the view; `run()` until stopped."""

    def __init__(self, swarm: SwarmDHT, options: MonitorOptions, registry: CollectorRegistry, *, run_id: str,
                 n_stages: int, clock=time.monotonic, root_pem: Optional[bytes] = None):
        self.swarm = swarm
        self.options = options
        self.run_id = run_id
        self.n_stages = n_stages
        self.registry = registry
        self._clock = clock
        self._started = clock()
        self._history = LossHistory()
        self._evals = EvalHistory()
        self._view: Optional[SwarmView] = None
        self._metrics = MonitorMetrics(registry)
        self._reported: set[LeftOutTarget] = set()  # left-out endpoints already logged and counted
        SwarmCollector(lambda: self._view, registry)
        self.server: Optional[MonitorServer] = None
        self.ledger: Optional[ReceiptLedger] = None
        if options.ledger is not None and root_pem is not None:
            verifier = CredentialVerifier(root_pem, run_id, clock=time.time)
            self.ledger = ReceiptLedger(options.ledger, verifier, LedgerMetrics(registry), clock=time.time)

    @property
    def view(self) -> Optional[SwarmView]:
        return self._view

    async def poll(self) -> SwarmView:
        """Read the swarm once and make it the current view."""
        started = self._clock()
        workers, trainers = await asyncio.gather(
            self.swarm.all_workers_async(self.run_id, self.n_stages),
            self.swarm.owned_entries_async(trainer_key(self.run_id), TrainerRecord))
        announced = max([self.n_stages] + [r.n_stages for rs in workers.values() for r in rs])
        if announced > self.n_stages:  # workers of a longer pipeline than configured: read them all
            workers = await self.swarm.all_workers_async(self.run_id, announced)
        view = summarize(self.run_id, workers,
                         [s.record for s in trainers.values() if s.record.run_id == self.run_id],
                         n_stages=self.n_stages, now=self._clock() - self._started,
                         static_targets=self.options.static_targets, trainer_hosts=self.options.trainer_hosts)
        view = dataclasses.replace(view, history=self._history.add(view), eval_history=self._evals.add(view))
        self._view = view
        self._report(view.left_out)
        self._metrics.poll_duration.observe(self._clock() - started)
        return view

    def _report(self, left_out: tuple[LeftOutTarget, ...]) -> None:
        if len(self._reported) > _REPORTED_CAPACITY:
            self._reported.clear()  # a churning swarm may report some again; memory stays bounded
        for target in left_out:
            if target in self._reported:
                continue
            self._reported.add(target)
            self._metrics.left_out.labels(role=target.role, reason=target.reason).inc()
            logger.warning("/sd leaves out the metrics endpoint %s that %s %s announced (%s)",
                           target.metrics_endpoint, target.role, target.peer_id, REFUSAL_REASONS[target.reason],
                           extra={"milestone": "scrape_target_left_out",
                                  "fields": {"role": target.role, "peer": target.peer_id,
                                             "metrics_endpoint": target.metrics_endpoint, "reason": target.reason}})

    def serve(self) -> str:
        """Start the HTTP port; the status page's URL."""
        self.server = start_monitor_server(self.registry, lambda: self._view, self.options.host, self.options.port,
                                           ledger=self.ledger, served=self.served)
        return f"http://{self.server.host}:{self.server.port}/"

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.poll()
                self._metrics.polls.labels(outcome="ok").inc()
            except DHTRequestError as error:
                self._metrics.polls.labels(outcome="failed").inc()
                logger.warning("reading the swarm failed (keeping the last view): %s", error)
            try:
                await asyncio.wait_for(stop.wait(), self.options.poll_s)
            except asyncio.TimeoutError:
                pass

    def served(self, worker: str, trainer: str) -> Optional[ServedCount]:
        """What `worker` says it served `trainer`, from the metrics endpoint it announced (None: unknown)."""
        view = self._view
        endpoints = {peer: endpoint for endpoint, _, peer in view.worker_targets} if view is not None else {}
        return served_count(endpoints[worker], trainer) if worker in endpoints else None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None


def run_monitor(swarm: SwarmDHT, options: MonitorOptions, registry: CollectorRegistry, *, run_id: str, n_stages: int,
                on_serving=lambda url: None, companions=(), root_pem: Optional[bytes] = None) -> int:
    """Blocking: serve until SIGINT/SIGTERM; `on_serving(url)` once the port answers. `companions`:
    async context managers that live as long as the monitor (the credential's renewer)."""
    from agora.pipeline.files import atomic_write

    monitor = SwarmMonitor(swarm, options, registry, run_id=run_id, n_stages=n_stages, root_pem=root_pem)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        async with contextlib.AsyncExitStack() as stack:
            for companion in companions:
                await stack.enter_async_context(companion)
            await serve(stop)

    async def serve(stop: asyncio.Event) -> None:
        url = monitor.serve()
        try:
            await monitor.poll()
        except DHTRequestError as error:
            logger.warning("first read of the swarm failed: %s", error)
        on_serving(url)
        if options.ready_file:
            atomic_write(options.ready_file, (url + "\n").encode())
        await monitor.run(stop)

    try:
        asyncio.run(main())
    finally:
        monitor.close()
    return 0
