"""`WorkerCalls`: a trainer's calls to workers, one client per worker, under the workers' flow control.

Everything a call to a worker goes through on the trainer's side lives here, so the microbatch's
route (node/trainer/microbatches.py) and the checks (node/trainer/reply_checks.py) only say whom
to call and what: which worker has a credit free (`pick`, or `pinned` for a Backward), the wait
for a credit, the completed-batch report the replica is owed (node/trainer/batch_reports.py), and
the call's outcome in the roster (node/trainer/routing.py), its time split in the stats and, when
the microbatch is traced, on its span (node/trainer/traces.py).

Flow control. A worker's reply says how many calls this trainer may have outstanding there; a call
to a worker at its credits waits here for one to free (or goes to another replica of the stage), so
the worker is not asked for more than it holds. A busy answer (RESOURCE_EXHAUSTED, which a trainer
keeping to its credits meets only when the worker is shared with callers it cannot tell apart) is
back-pressure: the same call is made again once a credit frees or the worker's pushback has passed,
on the route built so far, and it is no failed attempt, no ban, no batch given back. Only real
failures (a dead or wrong worker, a refused request) abandon a route.

`StageClients` keeps one `StageClient` per worker endpoint, rebuilt when another peer or stage
answers there: the TLS target name is the record's peer id and stage, so a handshake proves who
answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import Any, Awaitable, Callable

import torch

from agora.monitor.trainer_metrics import RpcClientMetrics
from agora.node.rpc.tls import ChannelFactory
from agora.node.trainer.batch_reports import CompletedBatchReports
from agora.node.trainer.blame import Blame
from agora.node.trainer.discovery import Discovery
from agora.node.trainer.inflight import WireFloor
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.routing import Roster, WorkerView
from agora.node.trainer.stage_client import (InputRefused, ReplyScales, StageCallError, StageClient,
                                             UnitNotHeld, WorkerBusy)
from agora.node.trainer.stats import HELD_OUT, TrainerStats
from agora.node.trainer.traces import MicrobatchTraces
from agora.pipeline.codec import WireCodec
from agora.pipeline.config import RunConfig
from agora.pipeline.fingerprint import run_fingerprint

__all__ = ["StageClients", "WorkerCalls"]

logger = logging.getLogger("agora.node.trainer")

# The longest a call waits for a worker's credit before looking at the roster again.
_CREDIT_POLL_S = 0.5


class StageClients:
    """One `StageClient` per worker endpoint, for the run of `config`; `channels`: mutual TLS with this
    trainer's credential (node/rpc/tls.TlsChannels), or None for plaintext (--insecure)."""

    def __init__(self, config: RunConfig, options: TrainerOptions, codec: WireCodec, scales: ReplyScales,
                 metrics: RpcClientMetrics, channels: ChannelFactory | None = None):
        self.config, self.options, self.codec, self.scales, self.channels = config, options, codec, scales, channels
        self.fingerprint = run_fingerprint(config)
        self._wire_metrics = metrics
        self._clients: dict[str, StageClient] = {}

    def for_worker(self, view: WorkerView) -> StageClient:
        client = self._clients.get(view.endpoint)
        if client is None or client.stage != view.stage or client.peer_id != view.peer_id:
            # The TLS target name is the record's peer id and stage: a new peer at an old address
            # (or a forged record) gets a new client, whose handshake proves who answers.
            client = StageClient(view.endpoint, run_id=self.options.run_id, stage=view.stage,
                                 model=self.config.model, fingerprint=self.fingerprint, peer_id=view.peer_id,
                                 channels=self.channels, codec=self.codec, timeout_s=self.options.call_timeout_s,
                                 metrics=self._wire_metrics, scales=self.scales)
            self._clients[view.endpoint] = client
        return client

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


class WorkerCalls:
    """Calls to the workers of `roster` through `clients`, under their flow control (module docstring)."""

    def __init__(self, clients: StageClients, roster: Roster, discovery: Discovery, stats: TrainerStats,
                 blame: Blame, batch_reports: CompletedBatchReports, options: TrainerOptions,
                 clock: Callable[[], float], traces: MicrobatchTraces | None = None):
        self.clients, self.roster, self.discovery, self.stats = clients, roster, discovery, stats
        self.blame, self.batch_reports, self.traces = blame, batch_reports, traces
        self.options, self.clock = options, clock
        self._last_refresh = float("-inf")
        self._refresh_lock = asyncio.Lock()
        self._returned = asyncio.Event()  # set (and replaced) whenever a call returns: a credit freed
        self.wire_floor = WireFloor()  # each link's own wire time, to tell queueing on it (node/trainer/inflight.py)

    async def refresh(self, force: bool = False) -> None:
        async with self._refresh_lock:
            if not force and self.clock() - self._last_refresh < self.options.roster_refresh_s:
                return
            self.roster.refresh(await self.discovery.workers())
            self._last_refresh = self.clock()

    async def pick(self, stage: int, exclude: frozenset[str], shares: Counter | None = None) -> tuple[WorkerView, float]:
        """A worker for `stage` with a credit free, reserved for the call about to be made; with
        `shares` (this batch's microbatches per peer on the stage), balanced across replicas (see
        node/trainer/routing.py) and counted there. Also returns the seconds it waited for a credit."""
        waiting_since = self.clock()
        notice = waiting_since + self.options.wait_notice_s
        pause = 0.05
        credit_wait = 0.0
        while True:
            await self.refresh()
            now = self.clock()
            view = self.roster.choose(stage, now, exclude, shares)
            if view is None and exclude and not self.roster.held_back(stage, now, exclude):
                view = self.roster.choose(stage, now, shares=shares)  # retry a peer rather than stall
            if view is not None:
                self.roster.started(view.peer_id)  # no await between the choice and the reservation
                if shares is not None:
                    shares[view.peer_id] += 1
                return view, credit_wait
            if self.roster.held_back(stage, now):  # workers there, at their credits: wait for one to free
                await self._credit_freed(self.roster.next_pause_end(stage, now))
                credit_wait += self.clock() - now
                continue
            if self.clock() >= notice:  # a stage emptied by churn: wait for a worker to (re)join
                notice = self.clock() + self.options.wait_notice_s
                logger.warning("waiting for a worker of stage %d: none routable for %.0f s (%d known)", stage,
                               self.clock() - waiting_since, len(self.roster.of_stage(stage)),
                               extra={"milestone": "waiting_for_workers",
                                      "fields": {"stage": stage, "seconds": round(self.clock() - waiting_since, 1)}})
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)
            await self.refresh(force=True)

    async def pinned(self, view: WorkerView) -> tuple[WorkerView, float]:
        """`view` itself (a Backward goes to the worker that ran its forward) once it has a credit free,
        reserved; and the seconds waited. A worker gone from the roster is called anyway: the call says."""
        waited = 0.0
        while True:
            now = self.clock()
            current = self.roster.workers.get(view.peer_id)
            if current is None or current.has_credit(now):
                self.roster.started(view.peer_id)
                return view, waited
            await self._credit_freed(current.paused_until if current.paused_until > now else None)
            waited += self.clock() - now

    async def _credit_freed(self, until: float | None) -> None:
        """Until a call of this trainer returns (a credit frees and fresh ones arrive), a paused worker may
        be called again (`until`, this trainer's clock), or `_CREDIT_POLL_S` at most."""
        timeout = _CREDIT_POLL_S if until is None else min(_CREDIT_POLL_S, max(0.0, until - self.clock()))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._returned.wait(), timeout)

    def _call_returned(self) -> None:
        returned, self._returned = self._returned, asyncio.Event()
        returned.set()

    async def call_stage(self, stage: int, pick: Callable[[], Awaitable[tuple[WorkerView, float]]],
                         call: Callable[[WorkerView], Awaitable], *, training: bool,
                         route: list[WorkerView] | None = None,
                         unpick: Callable[[WorkerView], None] | None = None) -> tuple[WorkerView, Any, float]:
        """One call to `stage` under flow control: `pick` a worker with a credit free (it waits for one),
        wait for the completed-batch report it is owed, call. A busy answer is back-pressure: the call is
        made again once a credit frees (on that replica or another: `pick` decides; `unpick` takes back
        what picking counted), and counts as no failure. Only a worker busy for every call of this one
        for `call_timeout_s` counts as failed (it is stuck, or refuses for good). `route`: the workers
        this microbatch touched, for its Abort. Returns the worker, the result and the seconds the call
        waited outside the worker: for credits, and on the wire beyond its link's floor (`WireFloor`)."""
        waited = 0.0
        busy_since: float | None = None
        while True:
            view, credit_wait = await pick()
            waited += credit_wait
            if training:  # the time split is of training calls (`TrainerStats.time_split`)
                self.stats.credit_wait(stage, credit_wait)
            try:
                if training:
                    owed_since = self.clock()
                    await self.batch_reports.reported(stage, view.peer_id)
                    self.stats.report_wait(self.clock() - owed_since)
            except BaseException:
                self.roster.released(view.peer_id)
                raise
            if route is not None:
                route.append(view)
            try:
                result, on_wire = await self._timed(view, call(view), training=training)
                return view, result, waited + on_wire
            except WorkerBusy:
                if route is not None:
                    route.pop()  # refused at the door: it holds nothing of this microbatch
                if unpick is not None:
                    unpick(view)
                self.stats.busy_retry()
                busy_since = self.clock() if busy_since is None else busy_since
                if self.clock() - busy_since >= self.options.call_timeout_s:
                    raise

    async def _timed(self, view: WorkerView, call: Awaitable, training: bool = True) -> tuple[Any, float]:
        """Await a call to `view`, reserved by `pick`/`pinned`: record its outcome in the roster (a busy
        answer as back-pressure, a failure with a ban) and its time split (and on its span, when traced).
        Returns the result and, for a training call, the seconds it queued on the wire (`WireFloor`)."""
        hop = self.traces.hop(view.stage, view.peer_id) if self.traces is not None else None
        started = self.clock()
        try:
            result = await (call if hop is None else hop.around(call))
        except WorkerBusy as error:
            self.roster.busy(view.peer_id, self.clock(), error.pushback_s)
            raise
        except InputRefused:  # whose fault it is, the route decides (`Blame.refused_input`)
            self.roster.released(view.peer_id)
            raise
        except UnitNotHeld:  # this trainer's lease, not the worker's fault (node/trainer/microbatches.py)
            self.roster.released(view.peer_id)
            raise
        except StageCallError as error:
            self.blame.failed(view, error)
            raise
        except BaseException:
            self.roster.released(view.peer_id)
            raise
        finally:
            self._call_returned()
        seconds = self.clock() - started
        if training:
            self.stats.calls_s += seconds
        self.roster.succeeded(view.peer_id, seconds, compute_s=result.compute_s, queued_s=result.queued_s,
                              credits=result.credits, in_flight_credits=result.in_flight_credits,
                              callers=result.callers)
        method = type(result).__name__.removesuffix("Result") if training else HELD_OUT
        # Held-out Forwards' frames are not training's: they feed no floor and count no queueing.
        on_wire = self.wire_floor.beyond((view.peer_id, method), seconds - result.compute_s - result.queued_s) \
            if training else 0.0
        self.stats.call(view.stage, method, seconds, result.compute_s, result.queued_s, on_wire)
        if hop is not None:
            hop.answered(seconds, result, training=training)
        return result, on_wire

    def held_out(self, view: WorkerView, probe_id: str, tokens: torch.Tensor, wire: bytes | memoryview | None,
                 targets: torch.Tensor | None, full_precision: bool) -> Awaitable:
        """A held-out Forward to `view` for a check (its credit reserved by the caller), timed as a call."""
        call = self.clients.for_worker(view).forward(probe_id, tokens, wire, targets, evaluate=True,
                                                     full_precision=full_precision)

        async def timed():
            result, _ = await self._timed(view, call, training=False)
            return result
        return timed()
