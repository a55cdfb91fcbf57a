"""`SwarmTrainer`: pushes microbatches through one worker per stage, over gRPC.

A trainer owns data units and the microbatch schedule, never weights. For each global batch
(one data unit) it cuts microbatches and runs up to `max_in_flight` of them at once, each
through a route of one worker per stage, rerouted on failure and every reply checked
(node/trainer/microbatches.py).

How much is in flight is the asynchronous pipeline's one real trade-off. A microbatch started
before a worker steps is finished with newer weights: the staleness is about (microbatches in
flight) / (microbatches per global batch) optimizer steps, and tokens/s rises with the depth until
the busiest stage is busy all the time. In asynchronous mode the depth adapts to what the trainer
measures (node/trainer/inflight.py): enough microbatches to hide one microbatch's unqueued
latency (compute, round trips, the trainer's own work) behind the busiest stage's compute, capped
by `max_staleness` global batches; `--max-in-flight N` fixes it instead. Synchronous mode keeps
half a global batch (its barrier closes every batch anyway). Whatever sets it, the depth stays
within the workers' credits (node/worker/flow.py): what they keep for this trainer between Forward
and Backward, and the calls they let it have outstanding.

Every replica of every stage steps once per global batch. Synchronous mode (one replica per
stage) closes each global batch with a Step barrier on every stage: this is the centralized run,
and its loss trace must equal `train-local`'s, so each stage accumulates the batch's microbatches
in index order (node/trainer/turns.py). Asynchronous mode reports each finished global
batch to every worker it knows (`Step` with `completed_batch`, stage by stage as soon as the
batch's last microbatch has passed that stage, in the background, best effort: a worker that
misses one lags a step; node/trainer/batch_reports.py) and goes on with the next one meanwhile;
each replica then steps on its own share of the batch, so the replicas of a stage keep one epoch
counter and the centralized run's learning-rate schedule.

This module is the trainer's assembly and its main loop: `run` keeps a window of global batches
open, `train_unit` runs one, closes it and records it. Each part it holds lives in a module of
its own: the calls to workers under their flow control (node/trainer/calls.py), one microbatch's
route (node/trainer/microbatches.py), the completed-batch reports, the reply checks
(node/trainer/reply_checks.py), the blame (node/trainer/blame.py) and the depth's rules
(node/trainer/inflight.py).

The trainer writes the same JSON-lines schema as `train-local` (`StepRecord`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections import Counter
from typing import IO, Callable

import torch

from agora.node.host_cpu import TREE_PARTS, tree_cpu_by_part
from agora.node.rpc.tls import ChannelFactory
from agora.node.trainer.batch_reports import CompletedBatchReports
from agora.node.trainer.blame import Blame
from agora.node.trainer.calls import StageClients, WorkerCalls
from agora.node.trainer.discovery import Discovery
from agora.node.trainer.inflight import (DepthEstimate, InFlightLimit, adaptive_depth, in_flight_limit, initial_depth,
                                         resized_depth)
from agora.node.trainer.microbatches import MicrobatchFailed, Microbatches, StageDone
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.receipt_delivery import ReceiptDelivery
from agora.node.trainer.receipts import ReceiptBook
from agora.node.trainer.reply_checks import ReplyChecks
from agora.node.trainer.routing import Roster
from agora.node.trainer.stage_client import ReplyScales
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.traces import MicrobatchTraces
from agora.node.trainer.turns import AccumulationOrder
from agora.node.trainer.units import FixedUnits, UnitHold, UnitLost, UnitSource, assigned_units
from agora.node.trainer.verification import Evidence
from agora.monitor.trainer_metrics import RpcClientMetrics
from agora.pipeline.centralized import StepRecord
from agora.pipeline.codec import WireCodec
from agora.pipeline.config import RunConfig
from agora.pipeline.optim import lr_at

__all__ = ["SwarmTrainer"]

logger = logging.getLogger("agora.node.trainer")

# How often a trainer with nothing to run looks again for a free unit (others hold the rest).
_IDLE_POLL_S = 0.5


class SwarmTrainer:
    """Trains a run's global batches through the workers `discovery` finds (module docstring)."""

    def __init__(self, config: RunConfig, data, discovery: Discovery, options: TrainerOptions, *,
                 log_json: IO[str] | None = None, clock: Callable[[], float] = time.monotonic,
                 on_record: Callable[[StepRecord], None] | None = None, channels: ChannelFactory | None = None,
                 stats: TrainerStats | None = None, units: UnitSource | None = None,
                 on_flagged: Callable[[Evidence], None] = lambda evidence: None,
                 traces: MicrobatchTraces | None = None, receipts: ReceiptBook | None = None):
        # `channels`: mutual TLS with this trainer's credential (node/rpc/tls.TlsChannels), or
        # None for plaintext (--insecure). Every call carries the run fingerprint either way.
        # `on_flagged`: told of each worker the verifier flags, once (node/trainer/reports.py).
        # `traces`: spans of a sampled share of the microbatches (node/trainer/traces.py); None: off.
        # `receipts`: told of each finished batch's accepted work per worker (node/trainer/receipts.py);
        # each round it signs also goes to the workers it names (node/trainer/receipt_delivery.py).
        self.config = config
        self.data = data
        self.options = options
        self.n_stages = len(config.layer_split)
        self.codec = WireCodec(options.wire_dtype)
        self.roster = Roster(microbatch_size=config.train.microbatch_size)
        self.log_json = log_json
        self.clock = clock
        self.on_record = on_record
        # Counters in the process's metrics registry (node/trainer/stats.py), or a private one.
        self.stats = stats if stats is not None else TrainerStats()
        # Each stage's recent reply values, which a reply's must stay near (node/trainer/stage_client.py).
        self.scales = ReplyScales(options.reply_bound_factor, options.reply_bound_warmup)
        self.blame = Blame(self.roster, self.stats, self.scales, self.codec, clock, on_flagged)
        self.clients = StageClients(config, options, self.codec, self.scales, RpcClientMetrics(self.stats.registry),
                                    channels)
        # Asynchronous mode's completed-batch reports (node/trainer/batch_reports.py).
        self.batch_reports = CompletedBatchReports(self.roster, self.clients.for_worker, self.stats,
                                                   microbatches=config.train.microbatches,
                                                   call_timeout_s=options.call_timeout_s)
        # Every call to a worker, under its flow control (node/trainer/calls.py).
        self.calls = WorkerCalls(self.clients, self.roster, discovery, self.stats, self.blame, self.batch_reports,
                                 options, clock, traces)
        # The verifier, spot checks and self checks (node/trainer/reply_checks.py).
        self.checks = ReplyChecks(options, self.codec, self.roster, self.stats, self.blame, clock, self.calls.held_out)
        self.max_in_flight = in_flight_limit(options, config.train.microbatches)
        self.adaptive = adaptive_depth(options)
        # Until the first microbatch is measured: half a global batch (at most the cap), within the workers'
        # credits once `run` has read their records.
        self._in_flight = InFlightLimit(initial_depth(self.max_in_flight, adaptive=self.adaptive))
        self.depth = DepthEstimate(self.n_stages)
        # One microbatch's route, checks and reroutes (node/trainer/microbatches.py).
        self.microbatches = Microbatches(self.calls, self.checks, self.blame, self.stats, options,
                                         n_stages=self.n_stages, clock=clock, observe_depth=self._observe_depth,
                                         traces=traces)
        self.units = units
        self.receipts = receipts
        # Each worker gets its own receipt of every round, through this trainer's client for it.
        self.receipt_delivery = None
        if receipts is not None:
            self.receipt_delivery = ReceiptDelivery(self.roster, self.clients.for_worker, self.stats,
                                                    timeout_s=min(5.0, options.call_timeout_s))
            receipts.also_deliver(self.receipt_delivery.submit)
        self.records: list[StepRecord] = []  # completed global batches, also when a run is cut short
        self._run_started = clock()
        self._units_done = 0

    async def run(self, total_steps: int) -> list[StepRecord]:
        """Train global batches of a `total_steps` run until every one is committed.

        The units come from `units` (node/trainer/units.py: leases on the DHT) or, without one, this
        trainer's static stripe of the run. Synchronous mode runs one global batch at a time (the
        barrier closes each). Otherwise a window of global batches overlaps so the pipeline stays
        full across batch boundaries; `max_in_flight` still bounds the microbatches in flight. A
        global batch whose microbatches ran out of routes is given back (another trainer, or this
        one later, runs it) and the run stops only after `unit_failures` such batches in a row.
        """
        source = self.units if self.units is not None else FixedUnits(
            assigned_units(total_steps, self.options.trainer_index, self.options.trainers), total_steps)
        await self.calls.refresh(force=True)
        if self.depth.samples == 0:
            await self._set_first_depth()
        self._run_started = self.clock()
        cpu_started = time.process_time()
        tree_started = tree_cpu_by_part(os.getpid())  # with its p2pd and DHT process: what the run cost the host
        records = self.records
        window = 1 if self.options.synchronous else \
            1 + -(-self.max_in_flight // self.config.train.microbatches)
        pending: dict[asyncio.Task, int] = {}
        failures_in_a_row = 0

        async def one_unit(unit_id: int) -> StepRecord:
            record = await self.train_unit(unit_id)
            await self.batch_reports.taken(unit_id)  # short timeouts each
            # Logged before it is committed: a trainer killed in between leaves the line and the
            # unit is run again by another, which is what happened to the weights (run twice).
            records.append(record)
            if self.log_json is not None:
                self.log_json.write(record.to_json() + "\n")
                self.log_json.flush()
            if self.on_record is not None:
                self.on_record(record)
            await source.committed(unit_id)
            return record

        async def finish(done: set[asyncio.Task]) -> None:
            nonlocal failures_in_a_row
            for task in sorted(done, key=lambda t: pending[t]):
                unit_id = pending.pop(task)
                try:
                    task.result()
                except UnitLost as error:  # another trainer's now: not this one's failure, nothing to give back
                    logger.warning("global batch %d dropped: %s", unit_id, error)
                    await source.failed(unit_id)  # its claim withdrawn
                    continue
                except MicrobatchFailed as error:
                    failures_in_a_row += 1
                    logger.warning("global batch %d given back: %s", unit_id, error)
                    await source.failed(unit_id)
                    if failures_in_a_row >= self.options.unit_failures:
                        raise
                    continue
                failures_in_a_row = 0

        try:
            while True:
                while len(pending) < window and not self._out_of_time():
                    unit_id = await source.next_unit(ahead=window)  # a window's worth claimed ahead
                    if unit_id is None:
                        break
                    pending[asyncio.create_task(one_unit(unit_id))] = unit_id
                if not pending:
                    if source.finished() or self._out_of_time():
                        break
                    await asyncio.sleep(_IDLE_POLL_S)  # the units left are held by other trainers
                    continue
                done, _ = await asyncio.wait(set(pending), return_when=asyncio.FIRST_COMPLETED,
                                             timeout=None if len(pending) >= window else _IDLE_POLL_S)
                await finish(done)
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self.batch_reports.drain()
            await self.checks.drain()
            await source.close()
            self.stats.cpu_s += time.process_time() - cpu_started
            tree = tree_cpu_by_part(os.getpid())
            for part in TREE_PARTS:
                self.stats.process_cpu_s[part] = self.stats.process_cpu_s.get(part, 0.0) + tree[part] - tree_started[part]
        records.sort(key=lambda r: r.step)
        return records

    async def train_unit(self, unit_id: int) -> StepRecord:
        unit = self.data.train.unit(unit_id)
        n_micro = self.config.train.microbatches
        microbatches = unit.chunk(n_micro)
        # Asynchronous mode: which microbatches each stage has accumulated. A stage's replicas are
        # told the batch is done the moment its last microbatch has passed that stage (the tail
        # first, the head last), not when the whole pipeline is done: waiting for the head would
        # have the tail and bodies run the next batch's first microbatches on weights a step old.
        # Every call to a stage first waits for the reports in flight to it (node/trainer/batch_reports.py),
        # so the next batch's microbatches meet stepped weights (one in flight: exactly the centralized run).
        finished: list[set[int]] = [set() for _ in range(self.n_stages)]
        # Microbatches of this batch per replica, per stage: equally fast replicas get equal shares.
        shares: list[Counter] = [Counter() for _ in range(self.n_stages)]

        def stage_done(index: int) -> StageDone:
            def done(stage: int) -> None:
                if len(finished[stage]) < n_micro:
                    finished[stage].add(index)  # a rerun's second pass adds nothing
                    if len(finished[stage]) == n_micro:
                        self.batch_reports.send(unit_id, stage)
            return done

        order = AccumulationOrder(self.n_stages) if self.options.synchronous else None
        hold = UnitHold(unit_id, self.units, self.clock) if self.units is not None else None

        async def one(index: int, batch: torch.Tensor) -> float:
            async with self._in_flight:
                started = self.clock()
                try:
                    return await self.microbatches.run(
                        f"u{unit_id}m{index}", batch[:, :-1], batch[:, 1:],
                        on_stage_done=None if self.options.synchronous else stage_done(index), shares=shares,
                        turn=None if order is None else functools.partial(order.turn, index=index), hold=hold)
                except BaseException:
                    if order is not None:
                        await order.abandon()  # the calls waiting for this one's turn give up
                    raise
                finally:
                    self.stats.microbatch_s += self.clock() - started

        # Every microbatch ends before the unit does (a lost unit's stop at their next attempt), so none
        # runs on after the unit is given back or dropped.
        outcomes = await asyncio.gather(*(one(i, mb) for i, mb in enumerate(microbatches)), return_exceptions=True)
        errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if errors:
            raise next((error for error in errors if isinstance(error, UnitLost)), errors[0])
        losses = list(outcomes)
        for stage, stage_shares in enumerate(shares):
            self.roster.batch_done(stage, stage_shares)  # who got none of it (routing's probe)
        if self.receipts is not None:  # only the routes that completed are left in the shares
            self.receipts.batch_served(shares, unit.shape[0] // n_micro * (unit.shape[1] - 1))
        grad_norms: list[float] = []
        if self.options.synchronous:
            replies = await self._step_barrier(unit_id)
            grad_norms = [round(r.grad_norm, 6) for r in replies]
            lr = replies[0].lr
        else:
            lr = lr_at(unit_id, self.config.optim)  # each replica stepped on its own share; no norms here
        elapsed = self.clock() - self._run_started
        tokens_per_unit = unit.shape[0] * (unit.shape[1] - 1)
        self._units_done += 1
        self.stats.batch_done(tokens_per_unit, sum(losses) / len(losses), lr)
        return StepRecord(
            step=unit_id + 1, loss=sum(losses) / len(losses), tokens=(unit_id + 1) * tokens_per_unit, lr=lr,
            grad_norm=grad_norms, elapsed_s=elapsed,
            tokens_per_s=self._units_done * tokens_per_unit / max(elapsed, 1e-9),
            extra={"trainer": self.options.trainer_index, "reroutes": self.stats.reroutes},
        )

    async def _step_barrier(self, step: int) -> list:
        replies = []
        for stage in range(self.n_stages):
            workers = self.roster.of_stage(stage)
            if len(workers) != 1:
                raise MicrobatchFailed(f"synchronous mode needs exactly one worker on stage {stage}, "
                                       f"found {len(workers)}")
            client = self.clients.for_worker(workers[0])
            replies.append(await client.step(self.config.train.microbatches, step=step))
        return replies

    def _out_of_time(self) -> bool:
        budget = self.options.time_budget_s
        return budget is not None and self.clock() - self._run_started >= budget

    async def evaluate(self, batches: list[torch.Tensor]) -> float:
        """Mean held-out loss through the swarm (forward only: nothing stashed or accumulated). Its
        microbatches are pipelined like training's, within the same in-flight limit and credits: one at
        a time, a batch of hundreds of microbatches would take hundreds of round trips. The losses are
        summed in microbatch order, so the figure does not depend on which finished first."""
        parts = [(f"eval{index}.{part}", micro) for index, batch in enumerate(batches)
                 for part, micro in enumerate(batch.chunk(self.config.train.microbatches))]

        async def one(key: str, micro: torch.Tensor) -> float:
            async with self._in_flight:
                return await self.microbatches.run(key, micro[:, :-1], micro[:, 1:], evaluate=True)

        losses = await asyncio.gather(*(one(key, micro) for key, micro in parts))
        return sum(losses) / max(1, len(losses))

    async def _set_first_depth(self) -> None:
        """The depth until a microbatch is measured, within what the workers' records announce."""
        credit_cap, stage_credits = self.roster.in_flight_cap(self.n_stages), self.roster.stage_credits(self.n_stages)
        await self._in_flight.set(initial_depth(self.max_in_flight, adaptive=self.adaptive,
                                                credit_cap=credit_cap, stage_credits=stage_credits))
        self.stats.depth(self._in_flight.limit, credit_cap, stage_credits)

    async def _observe_depth(self, wall_s: float, compute: list[float], queued_s: float) -> None:
        """Feed one training microbatch to the depth estimate and resize the in-flight limit."""
        self.depth.observe(wall_s, compute, queued_s)
        credit_cap, stage_credits = self.roster.in_flight_cap(self.n_stages), self.roster.stage_credits(self.n_stages)
        depth = resized_depth(self.depth, adaptive=self.adaptive, max_in_flight=self.max_in_flight,
                              credit_cap=credit_cap, stage_credits=stage_credits,
                              stage_shares=self.roster.stage_shares(self.n_stages))
        if depth is not None and depth != self._in_flight.limit:
            await self._in_flight.set(depth)
        self.stats.depth(self._in_flight.limit, credit_cap, stage_credits)

    def in_flight_summary(self) -> dict:
        """The depth: how it was set, its cap, the last and the largest limit, what it was derived from (the
        stages' compute and this trainer's share of their replicas), and the workers' credits for this
        trainer at the end (in flight, calls per stage)."""
        estimate = self.depth
        return {"mode": "adaptive" if self.adaptive else "fixed", "cap": self.max_in_flight,
                "last": self._in_flight.limit, "max": max(self.stats.depth_max, self._in_flight.limit),
                "latency_ms": round(1e3 * estimate.latency_s, 2),
                "stage_compute_ms": [round(1e3 * c, 2) for c in estimate.stage_compute_s],
                "stage_shares": [round(share, 2) for share in self.roster.stage_shares(self.n_stages)],
                "credit_cap": self.roster.in_flight_cap(self.n_stages),
                "stage_credits": self.roster.stage_credits(self.n_stages)}

    def verification_summary(self) -> dict:
        return self.checks.verification_summary()

    async def __aenter__(self) -> "SwarmTrainer":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self.receipt_delivery is not None:  # the last round's receipts, before the clients close
            await self.receipt_delivery.close()
        await self.clients.close()
