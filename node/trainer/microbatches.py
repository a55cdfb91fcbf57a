"""`Microbatches`: one microbatch through the pipeline, rerouted until it passes or runs out of attempts.

Each microbatch goes forward through a route of one worker per stage, chosen by the `Roster`
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

A worker refusing work of a unit this trainer does not hold, as it reads the lease queue
(`UnitNotHeld`), is at no fault: the trainer asks the queue itself (`hold`, node/trainer/units.py).
Another trainer's unit is dropped here, every microbatch of it (`UnitLost`); its own, the worker read
the queue before the claim landed and is called again once it reads it anew (`_REREAD_WAIT_S`).
Counted as failures, such refusals had the trainer back off from the stage's only worker and give
the unit back after six tries, a minute later.

Every call goes through node/trainer/calls.py (credits, busy answers, the completed-batch report
a replica is owed). A sampled microbatch runs under its trace's root span, every attempt under it
(node/trainer/traces.py). Each training microbatch's wall time, compute and queueing go to the
trainer's depth (`observe_depth`, node/trainer/inflight.py), which sizes how many run at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
from collections import Counter
from typing import AsyncContextManager, Awaitable, Callable

import torch

from agora.node.trainer.blame import Blame
from agora.node.trainer.calls import WorkerCalls
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.reply_checks import ReplyChecks
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.stage_client import InputRefused, StageCallError, UnitNotHeld
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.traces import MicrobatchTraces
from agora.node.trainer.units import UnitHold, UnitLost
from agora.node.trainer.verification import Source

__all__ = ["Microbatches", "MicrobatchFailed", "StageDone", "Turn", "DepthObserver"]

logger = logging.getLogger("agora.node.trainer")


class MicrobatchFailed(RuntimeError):
    pass


# A worker that refused a caller's work of a unit refuses that caller from its cache for a second
# (node/worker/unit_holders.py, `refusal_memory_s`); a call made after that has it read the queue again.
_REREAD_WAIT_S = 1.2


# Called with a stage index once a microbatch's gradient has been accumulated on that stage.
StageDone = Callable[[int], None]
Turn = Callable[[int], AsyncContextManager[None]]  # synchronous mode: a stage's turn to accumulate
# Told of each training microbatch: its wall time, each stage's compute on it, its queueing (all seconds).
DepthObserver = Callable[[float, list[float], float], Awaitable[None]]


class Microbatches:
    """Runs microbatches through the workers `calls` reaches, every reply held to `checks` (module docstring)."""

    def __init__(self, calls: WorkerCalls, checks: ReplyChecks, blame: Blame, stats: TrainerStats,
                 options: TrainerOptions, *, n_stages: int, clock: Callable[[], float], observe_depth: DepthObserver,
                 traces: MicrobatchTraces | None = None):
        self.calls, self.clients, self.roster = calls, calls.clients, calls.roster
        self.checks, self.blame, self.stats, self.options = checks, blame, stats, options
        self.n_stages, self.clock, self._observe_depth, self.traces = n_stages, clock, observe_depth, traces

    async def run(self, key: str, tokens: torch.Tensor, targets: torch.Tensor,
                  evaluate: bool = False, on_stage_done: StageDone | None = None,
                  shares: list[Counter] | None = None, turn: Turn | None = None, hold: UnitHold | None = None) -> float:
        """`_run`, under its trace's root span when it is sampled (`traces`)."""
        if self.traces is None:
            return await self._run(key, tokens, targets, evaluate, on_stage_done, shares, turn, hold)
        with self.traces.microbatch(key, evaluate=evaluate) as span:
            loss = await self._run(key, tokens, targets, evaluate, on_stage_done, shares, turn, hold)
            if span is not None:
                span.set_attribute("agora.loss", loss)
            return loss

    async def _run(self, key: str, tokens: torch.Tensor, targets: torch.Tensor,
                   evaluate: bool = False, on_stage_done: StageDone | None = None,
                   shares: list[Counter] | None = None, turn: Turn | None = None, hold: UnitHold | None = None) -> float:
        """Loss of one microbatch; reroutes on failure, raises MicrobatchFailed when out of attempts, and
        UnitLost once `hold` (the unit's, None: always held) says another trainer holds the unit.
        `shares`: the global batch's microbatches per peer, one counter per stage (balanced routing).
        `key` names the work ("u12m3"): the same for every attempt and every trainer that runs this unit,
        so a worker that applied it once does not apply it again (node/replica/work_ledger.py).
        `turn(stage)`: synchronous mode's order of accumulation (node/trainer/turns.py)."""
        exclude: set[str] = set()
        last_error: Exception | None = None
        for attempt in range(self.options.max_attempts):
            if hold is not None and hold.lost:
                raise UnitLost(f"microbatch {key}: unit {hold.unit} is held by another trainer")
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
            except UnitNotHeld as error:  # the worker's view of the lease queue: no fault of its own
                last_error = error
                if hold is None or not await hold.confirm():
                    raise UnitLost(f"microbatch {key}: unit {error.unit} is held by another trainer: {error}") from None
                logger.info("microbatch %s: %s read the lease queue before this trainer's claim of unit %d landed; "
                            "calling again", key, error.address, error.unit)
                await asyncio.sleep(_REREAD_WAIT_S)
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
                await self.calls.refresh(force=True)
        raise MicrobatchFailed(f"microbatch {key} failed {self.options.max_attempts} times; last: {last_error}")

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
                reply = await self.clients.for_worker(view).abort(microbatch_id,
                                                                  timeout_s=min(5.0, self.options.call_timeout_s))
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
                return self.clients.for_worker(view).forward(microbatch_id, tokens, wire, targets if tail else None,
                                                             evaluate=evaluate, work_key=work_key,
                                                             round_trip_s=view.round_trip_s or 0.0)

            def unpick(view: WorkerView, stage_shares=stage_shares) -> None:
                if stage_shares is not None:
                    stage_shares[view.peer_id] -= 1

            # Synchronous mode: the tail's turn is taken before its credit, so a microbatch waiting for
            # its turn never holds a credit the one before it needs.
            try:
                async with (turn(stage) if tail and turn is not None else contextlib.nullcontext()):
                    worker, result, waited = await self.calls.call_stage(
                        stage, functools.partial(self.calls.pick, stage, exclude, stage_shares), forward,
                        training=not evaluate, route=route, unpick=unpick)
            except InputRefused as refusal:
                raise self.blame.refused_input(refusal, route, stage, wire or b"", backward=False) from None
            request = self.checks.request(wire)  # decoded once for both of the reply's frames
            self.checks.verify(worker, "output", result.wire_frame, request, "Forward", upstream, tokens,
                               result.weights_version)
            self.checks.verify(worker, "input_grad", result.grad_frame, request, "Forward", upstream, tokens,
                               result.weights_version)
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
                return self.clients.for_worker(view).backward(microbatch_id, grad,
                                                              round_trip_s=view.round_trip_s or 0.0)

            try:
                async with (turn(stage) if turn is not None else contextlib.nullcontext()):
                    worker, back, waited = await self.calls.call_stage(
                        stage, functools.partial(self.calls.pinned, route[stage]), backward, training=True)
            except InputRefused as refusal:
                raise self.blame.refused_input(refusal, route, stage, grad, backward=True) from None
            self.checks.verify(worker, "input_grad", back.grad_frame, self.checks.request(grad), "Backward", upstream,
                               tokens, back.weights_version)
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
