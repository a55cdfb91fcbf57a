"""`SwarmTrainer`: pushes microbatches through one worker per stage, over gRPC.

A trainer owns data units and the microbatch schedule, never weights. For each global batch
(one data unit) it cuts microbatches and runs up to `max_in_flight` of them at once; each
microbatch goes forward through a route of one worker per stage, chosen by the `Roster`
(earliest expected finish, equal shares of each batch among equally fast replicas, bans with
backoff), and backward in reverse pinned to the same workers. Any failure abandons the
microbatch's route and re-runs it on another (bounded attempts; a new microbatch id per
attempt, so a late reply of the abandoned route can never be confused with the new one). A
failure is counted against the worker at fault (node/trainer/blame.py): a reply whose values lie
far beyond its stage's recent ones is refused before it is relayed, and a worker refusing the
values the worker before (or after) it produced gets that producer blamed and excluded, not itself.
Every reply that passes those checks is also held to its stage's other replies by the verifier
(node/trainer/verification.py) before it is relayed: a worker whose replies drift away from its
stage's is excluded for the rest of the run, and the reply that showed it fails its route. With
`spot_check_share` a share of head and body Forwards is also sent, off the critical path, to a
second replica of the stage, and the two outputs compared (node/trainer/spot_checks.py): that
catches what statistics cannot (a replayed head reply, content shuffled within the batch, a lie
from a worker's first reply), at one extra forward per check. With `gradient_check_share` a share of
each worker's replies is checked against its own held-out answers on the same weights, off the
critical path (node/trainer/gradient_checks.py): input gradients by finite differences, outputs by
replay. A sign-flipped, scaled or noisy gradient, or a head's noisy or stale output, keeps every
statistic.

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
misses one lags a step) and goes on with the next one meanwhile; each replica then steps on its
own share of the batch, so the replicas of a stage keep one epoch counter and the centralized
run's learning-rate schedule.

The trainer writes the same JSON-lines schema as `train-local` (`StepRecord`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections import Counter
from typing import IO, AsyncContextManager, Callable

import torch

from agora.node.rpc.tls import ChannelFactory
from agora.node.trainer.discovery import Discovery
from agora.node.trainer.inflight import (DepthEstimate, InFlightLimit, adaptive_depth, in_flight_limit, initial_depth,
                                         resized_depth)
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.batch_reports import CompletedBatchReports
from agora.node.trainer.blame import Blame
from agora.node.trainer.calls import WorkerCalls
from agora.node.trainer.receipts import ReceiptBook
from agora.node.trainer.routing import Roster, WorkerView
from agora.node.trainer.reply_checks import ReplyChecks
from agora.node.trainer.stage_client import (
    InputRefused,
    ReplyScales,
    StageCallError,
    StageClient,
)
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.traces import MicrobatchTraces
from agora.node.trainer.turns import AccumulationOrder
from agora.node.trainer.units import FixedUnits, UnitSource, assigned_units
from agora.node.trainer.verification import Evidence, Source
from agora.monitor.trainer_metrics import RpcClientMetrics
from agora.pipeline.centralized import StepRecord
from agora.pipeline.codec import WireCodec
from agora.pipeline.config import RunConfig
from agora.pipeline.fingerprint import run_fingerprint
from agora.pipeline.optim import lr_at

__all__ = ["TrainerOptions", "SwarmTrainer", "MicrobatchFailed"]

logger = logging.getLogger("agora.node.trainer")

# How often a trainer with nothing to run looks again for a free unit (others hold the rest).
_IDLE_POLL_S = 0.5


class MicrobatchFailed(RuntimeError):
    pass




# Called with a stage index once a microbatch's gradient has been accumulated on that stage.
StageDone = Callable[[int], None]
Turn = Callable[[int], AsyncContextManager[None]]  # synchronous mode: a stage's turn to accumulate


class SwarmTrainer(WorkerCalls, CompletedBatchReports):
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
        # `receipts`: told of each finished batch's accepted work per worker (node/trainer/receipts.py).
        self.config = config
        self.channels = channels
        self.traces = traces
        self.fingerprint = run_fingerprint(config)
        self.data = data
        self.discovery = discovery
        self.options = options
        self.n_stages = len(config.layer_split)
        self.codec = WireCodec(options.wire_dtype)
        self.roster = Roster(microbatch_size=config.train.microbatch_size)
        self.log_json = log_json
        self.clock = clock
        self.on_record = on_record
        # Counters in the process's metrics registry (node/trainer/stats.py), or a private one.
        self.stats = stats if stats is not None else TrainerStats()
        self._wire_metrics = RpcClientMetrics(self.stats.registry)
        # Each stage's recent reply values, which a reply's must stay near (node/trainer/stage_client.py).
        self.scales = ReplyScales(options.reply_bound_factor, options.reply_bound_warmup)
        self.blame = Blame(self.roster, self.stats, self.scales, self.codec, clock, on_flagged)
        # The verifier, spot checks and self checks (node/trainer/reply_checks.py).
        self.checks = ReplyChecks(options, self.codec, self.roster, self.stats, self.blame, clock, self._held_out)
        self._clients: dict[str, StageClient] = {}
        self._last_refresh = float("-inf")
        self._refresh_lock = asyncio.Lock()
        self._run_started = clock()
        self._units_done = 0
        self._reports: set[asyncio.Task] = set()  # completed-batch reports still in flight
        self._unreported: set[str] = set()  # peers that refused a report (they step on their own)
        # Per stage and replica, the completed-batch report sent last; a call waits for its replica's.
        self._stage_reports: dict[int, dict[str, asyncio.Task]] = {}
        self._unit_reports: dict[int, list[asyncio.Task]] = {}  # a unit commits once its reports are in
        self.units = units
        self.receipts = receipts
        self.records: list[StepRecord] = []  # completed global batches, also when a run is cut short
        self.max_in_flight = in_flight_limit(options, config.train.microbatches)
        self.adaptive = adaptive_depth(options)
        # Until the first microbatch is measured: half a global batch (at most the cap).
        self._in_flight = InFlightLimit(initial_depth(self.max_in_flight, config.train.microbatches,
                                                      adaptive=self.adaptive))
        self.depth = DepthEstimate(self.n_stages)
        self._returned = asyncio.Event()  # set (and replaced) whenever a call returns: a credit freed

    # ------------------------------------------------------------------ one microbatch

    async def _route_once(self, microbatch_id: str, tokens: torch.Tensor, targets: torch.Tensor,
                          exclude: frozenset[str], evaluate: bool, on_stage_done: StageDone | None,
                          shares: list[Counter] | None, work_key: str = "", turn: Turn | None = None) -> float:
        route: list[WorkerView] = []
        try:
            return await self._forward_backward(microbatch_id, tokens, targets, exclude, evaluate, route,
                                                on_stage_done, shares, work_key, turn)
        except StageCallError:
            if not evaluate:
                await self._abort(microbatch_id, route)
                if shares is not None:  # the route's gradients were taken back: no longer a share
                    for stage, view in enumerate(route):
                        shares[stage][view.peer_id] -= 1
            raise

    async def _abort(self, microbatch_id: str, route: list[WorkerView]) -> None:
        """Best effort: every worker the abandoned route touched takes its part back."""
        async def one(view: WorkerView) -> None:
            try:
                reply = await self._client(view).abort(microbatch_id, timeout_s=min(5.0, self.options.call_timeout_s))
                self.stats.aborted(reply.outcome)
            except StageCallError:
                self.stats.aborted("unreachable")
        await asyncio.gather(*(one(view) for view in route))

    async def _forward_backward(self, microbatch_id: str, tokens: torch.Tensor, targets: torch.Tensor,
                                exclude: frozenset[str], evaluate: bool, route: list[WorkerView],
                                on_stage_done: StageDone | None = None, shares: list[Counter] | None = None,
                                work_key: str = "", turn: Turn | None = None) -> float:
        wire: bytes | None = None
        result = None
        started = self.clock()
        compute = [0.0] * self.n_stages  # each stage's compute on this microbatch, and all its queueing
        queued = 0.0  # at the workers and here, waiting for their credits
        upstream: list[Source] = []  # the replies this microbatch's next ones are computed from
        route_wires: list = []  # each stage's input wire and its Forward's weights version, for self checks
        for stage in range(self.n_stages):
            stage_shares = None if shares is None else shares[stage]
            tail = stage == self.n_stages - 1

            def forward(view: WorkerView, wire=wire, tail=tail):
                return self._client(view).forward(microbatch_id, tokens, wire, targets if tail else None,
                                                  evaluate=evaluate, work_key=work_key,
                                                  round_trip_s=view.round_trip_s or 0.0)

            def unpick(view: WorkerView, stage_shares=stage_shares) -> None:
                if stage_shares is not None:
                    stage_shares[view.peer_id] -= 1

            # Synchronous mode: the tail's turn is taken before its credit, so a microbatch waiting for
            # its turn never holds a credit the one before it needs.
            try:
                async with (turn(stage) if tail and turn is not None else contextlib.nullcontext()):
                    worker, result, waited = await self._call_stage(
                        stage, functools.partial(self._pick, stage, exclude, stage_shares), forward,
                        training=not evaluate, route=route, unpick=unpick)
            except InputRefused as refusal:
                raise self.blame.refused_input(refusal, route, stage, wire or b"", backward=False) from None
            request = self.checks.request(wire)  # decoded once for both of the reply's frames
            self.checks.verify(worker, "output", result.wire_frame, request, "Forward", upstream)
            self.checks.verify(worker, "input_grad", result.grad_frame, request, "Forward", upstream)
            if result.repeat:
                self.stats.repeated(stage)
            if not evaluate and not tail:
                self.checks.spot_check(worker, microbatch_id, tokens, wire, result.wire_frame)
            if not evaluate and (stage == 0 or tail and wire):
                self.checks.self_check(worker, microbatch_id, tokens, targets if tail else None, wire, result.grad_frame,
                                 None, result.weights_version, trained=(result.loss if tail else result.wire_frame,
                                                                        result.weights_version))
            route_wires.append((wire, result.weights_version))
            wire = result.wire_frame
            compute[stage] += result.compute_s
            queued += result.queued_s + waited
        if evaluate:
            return float(result.loss)
        if on_stage_done is not None:
            on_stage_done(self.n_stages - 1)  # the tail accumulated its gradient inside Forward
        grad = result.grad_frame
        for stage in reversed(range(self.n_stages - 1)):
            def backward(view: WorkerView, grad=grad):
                return self._client(view).backward(microbatch_id, grad, round_trip_s=view.round_trip_s or 0.0)

            try:
                async with (turn(stage) if turn is not None else contextlib.nullcontext()):
                    worker, back, waited = await self._call_stage(
                        stage, functools.partial(self._pinned, route[stage]), backward, training=True)
            except InputRefused as refusal:
                raise self.blame.refused_input(refusal, route, stage, grad, backward=True) from None
            self.checks.verify(worker, "input_grad", back.grad_frame, self.checks.request(grad), "Backward", upstream)
            if back.repeat:
                self.stats.repeated(stage)
            if stage > 0:
                (wire, forward_version), (output, _) = route_wires[stage], route_wires[stage + 1]
                self.checks.self_check(worker, microbatch_id, tokens, None, wire, back.grad_frame, grad, back.weights_version,
                                 trained=(output, forward_version))
            grad = back.grad_frame
            compute[stage] += back.compute_s
            queued += back.queued_s + waited
            if on_stage_done is not None:
                on_stage_done(stage)
        await self._observe_depth(self.clock() - started, compute, queued)
        return float(result.loss)

    async def _observe_depth(self, wall_s: float, compute: list[float], queued_s: float) -> None:
        """Feed one training microbatch to the depth estimate and resize the in-flight limit."""
        self.depth.observe(wall_s, compute, queued_s)
        credit_cap, stage_credits = self.roster.in_flight_cap(self.n_stages), self.roster.stage_credits(self.n_stages)
        depth = resized_depth(self.depth, adaptive=self.adaptive, max_in_flight=self.max_in_flight,
                              credit_cap=credit_cap, stage_credits=stage_credits)
        if depth is not None and depth != self._in_flight.limit:
            await self._in_flight.set(depth)
        self.stats.depth(self._in_flight.limit, credit_cap, stage_credits)

    async def run_microbatch(self, key: str, tokens: torch.Tensor, targets: torch.Tensor,
                             evaluate: bool = False, on_stage_done: StageDone | None = None,
                             shares: list[Counter] | None = None, turn: Turn | None = None) -> float:
        """`_run_microbatch`, under its trace's root span when it is sampled (`traces`)."""
        if self.traces is None:
            return await self._run_microbatch(key, tokens, targets, evaluate, on_stage_done, shares, turn)
        with self.traces.microbatch(key, evaluate=evaluate) as span:
            loss = await self._run_microbatch(key, tokens, targets, evaluate, on_stage_done, shares, turn)
            if span is not None:
                span.set_attribute("agora.loss", loss)
            return loss

    async def _run_microbatch(self, key: str, tokens: torch.Tensor, targets: torch.Tensor,
                              evaluate: bool = False, on_stage_done: StageDone | None = None,
                              shares: list[Counter] | None = None, turn: Turn | None = None) -> float:
        """Loss of one microbatch; reroutes on failure, raises MicrobatchFailed when out of attempts.
        `shares`: the global batch's microbatches per peer, one counter per stage (balanced routing).
        `key` names the work ("u12m3"): the same for every attempt and every trainer that runs this unit,
        so a worker that applied it once does not apply it again (node/replica/work_ledger.py).
        `turn(stage)`: synchronous mode's order of accumulation (node/trainer/turns.py)."""
        exclude: set[str] = set()
        last_error: Exception | None = None
        for attempt in range(self.options.max_attempts):
            # 128 random bits per attempt: unguessable, and never the id of another attempt (a late
            # reply of an abandoned route cannot be confused with the new one). The worker binds
            # it to this trainer's identity; the readable prefix is for logs.
            microbatch_id = f"{key}.a{attempt}.{secrets.token_hex(16)}"
            try:
                loss = await self._route_once(microbatch_id, tokens, targets, frozenset(exclude), evaluate,
                                              on_stage_done, shares, work_key="" if evaluate else key, turn=turn)
                if not evaluate:
                    self.stats.microbatch_done()
                return loss
            except StageCallError as error:  # a real failure: busy answers were waited out in `_call_stage`
                last_error = error
                peer = next((v.peer_id for v in self.roster.workers.values()
                             if v.endpoint == error.address), error.address)
                exclude.add(peer)
                self.stats.rerouted(peer)
                logger.warning("reroute microbatch %s (attempt %d): %s", key, attempt + 1, error,
                               extra={"milestone": "reroute",
                                      "fields": {"microbatch": key, "attempt": attempt + 1,
                                                 "endpoint": error.address, "code": error.code.name}})
                await self.refresh(force=True)
        raise MicrobatchFailed(f"microbatch {key} failed {self.options.max_attempts} times; last: {last_error}")

    # ------------------------------------------------------------------ global batches

    async def _step_barrier(self, step: int) -> list:
        replies = []
        for stage in range(self.n_stages):
            workers = self.roster.of_stage(stage)
            if len(workers) != 1:
                raise MicrobatchFailed(f"synchronous mode needs exactly one worker on stage {stage}, "
                                       f"found {len(workers)}")
            replies.append(await self._client(workers[0]).step(self.config.train.microbatches, step=step))
        return replies

    async def train_unit(self, unit_id: int) -> StepRecord:
        unit = self.data.train.unit(unit_id)
        n_micro = self.config.train.microbatches
        microbatches = unit.chunk(n_micro)
        # Asynchronous mode: which microbatches each stage has accumulated. A stage's replicas are
        # told the batch is done the moment its last microbatch has passed that stage (the tail
        # first, the head last), not when the whole pipeline is done: waiting for the head would
        # have the tail and bodies run the next batch's first microbatches on weights a step old.
        # Every call to a stage first waits for the reports in flight to it (`_reported`), so the
        # next batch's microbatches meet stepped weights (one in flight: exactly the centralized run).
        finished: list[set[int]] = [set() for _ in range(self.n_stages)]
        # Microbatches of this batch per replica, per stage: equally fast replicas get equal shares.
        shares: list[Counter] = [Counter() for _ in range(self.n_stages)]

        def stage_done(index: int) -> StageDone:
            def done(stage: int) -> None:
                if len(finished[stage]) < n_micro:
                    finished[stage].add(index)  # a rerun's second pass adds nothing
                    if len(finished[stage]) == n_micro:
                        self._report_batch_done(unit_id, stage)
            return done

        order = AccumulationOrder(self.n_stages) if self.options.synchronous else None

        async def one(index: int, batch: torch.Tensor) -> float:
            async with self._in_flight:
                started = self.clock()
                try:
                    return await self.run_microbatch(
                        f"u{unit_id}m{index}", batch[:, :-1], batch[:, 1:],
                        on_stage_done=None if self.options.synchronous else stage_done(index), shares=shares,
                        turn=None if order is None else functools.partial(order.turn, index=index))
                except BaseException:
                    if order is not None:
                        await order.abandon()  # the calls waiting for this one's turn give up
                    raise
                finally:
                    self.stats.microbatch_s += self.clock() - started

        losses = await asyncio.gather(*(one(i, mb) for i, mb in enumerate(microbatches)))
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
        await self.refresh(force=True)
        self._run_started = self.clock()
        cpu_started = time.process_time()
        records = self.records
        window = 1 if self.options.synchronous else \
            1 + -(-self.max_in_flight // self.config.train.microbatches)
        pending: dict[asyncio.Task, int] = {}
        failures_in_a_row = 0

        async def one_unit(unit_id: int) -> StepRecord:
            record = await self.train_unit(unit_id)
            reports = self._unit_reports.pop(unit_id, [])
            await asyncio.gather(*reports)  # every stage has taken its report (short timeouts each)
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
                    unit_id = await source.next_unit()
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
            await asyncio.gather(*self._reports, return_exceptions=True)  # short timeouts each
            await self.checks.drain()
            await source.close()
            self.stats.cpu_s += time.process_time() - cpu_started
        records.sort(key=lambda r: r.step)
        return records

    def _out_of_time(self) -> bool:
        budget = self.options.time_budget_s
        return budget is not None and self.clock() - self._run_started >= budget

    def in_flight_summary(self) -> dict:
        """The depth: how it was set, its cap, the last and the largest limit, what it was derived from, and
        the workers' credits for this trainer at the end (in flight, calls per stage)."""
        estimate = self.depth
        return {"mode": "adaptive" if self.adaptive else "fixed", "cap": self.max_in_flight,
                "last": self._in_flight.limit, "max": max(self.stats.depth_max, self._in_flight.limit),
                "latency_ms": round(1e3 * estimate.latency_s, 2),
                "stage_compute_ms": [round(1e3 * c, 2) for c in estimate.stage_compute_s],
                "credit_cap": self.roster.in_flight_cap(self.n_stages),
                "stage_credits": self.roster.stage_credits(self.n_stages)}

    def verification_summary(self) -> dict:
        return self.checks.verification_summary()

    async def evaluate(self, batches: list[torch.Tensor]) -> float:
        """Mean held-out loss through the swarm (forward only: nothing stashed or accumulated). Its
        microbatches are pipelined like training's, within the same in-flight limit and credits: one at
        a time, a batch of hundreds of microbatches would take hundreds of round trips. The losses are
        summed in microbatch order, so the figure does not depend on which finished first."""
        parts = [(f"eval{index}.{part}", micro) for index, batch in enumerate(batches)
                 for part, micro in enumerate(batch.chunk(self.config.train.microbatches))]

        async def one(key: str, micro: torch.Tensor) -> float:
            async with self._in_flight:
                return await self.run_microbatch(key, micro[:, :-1], micro[:, 1:], evaluate=True)

        losses = await asyncio.gather(*(one(key, micro) for key, micro in parts))
        return sum(losses) / max(1, len(losses))

    async def __aenter__(self) -> "SwarmTrainer":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
