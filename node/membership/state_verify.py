"""Checking a downloaded stage state before it is used: the network half of node/membership/state_check.py.

Design choices:
- One verdict per downloaded state (`StateVerifier.verify`): the local checks first (nothing to
  ask anyone), then the sketches of up to `second_members` other members of the stage, asked
  through the same `DownloadState` call with a sketch size (node/membership/state_transfer.py),
  so exactly the callers who may download a state may ask for its sketch. The second members are
  the plan's other donors (node/membership/state_download.py): members whose announced step the
  stage agrees with, never the outliers.
- When: the downloader asks (`StateVerifier.ask`) as soon as the donor's stream starts, which is
  when the donor takes its snapshot, and the answers wait for the download. Replicas keep
  training, so a second member's state drifts from the snapshot by every step it takes; asked
  at the end of a download lasting minutes it would be that many steps away, and the comparison
  would measure the download's length rather than the donor.
- The seed is drawn here for each state (`secrets`) and sent to the second members only, never
  to the donor, which has no way to see it unless a second member tells it (and a second member
  that helps the donor lie can lie itself: the verdict needs one honest second member, see
  node/membership/state_check.py). The downloaded state's own sketch is computed with it once
  the download is complete, off the event loop.
- A second member that does not answer (busy, gone, a malformed sketch) is replaced by the next
  one; while none answers, all are asked again a second later, for at most `ask_timeout_s`. One
  whose refusal will not change (it hosts another stage now, after rebalancing moved it, or it does
  not let this caller ask) is not asked again: waiting out the timeout on it only delays the verdict.
  Without any answer the state is `unverified`: not used, and not the donor's fault (nobody is
  reported); the downloader then ends, since a plan whose every other member is unreachable is
  stale.
- Alone: when the donor is the only member the plan holds, no cross-check is possible, and the
  verdict says so (`judge_alone`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Optional, Protocol, Sequence

import grpc

from agora.node.membership.check_options import StateCheckOptions
from agora.node.membership.state_check import StateSketch, Verdict, judge, judge_alone, local_refusal, norms_of, \
    sketch_state
from agora.node.rpc.server import message_options
from agora.node.rpc.tls import ChannelFactory, worker_server_name
from agora.pipeline.config import OptimConfig
from agora.pipeline.state_wire import StateReceiver, StateWireError
from agora.protos.state_adapter import StateRequest, StateStub

__all__ = ["StateChecks", "CheckReport", "SketchAsk", "StateVerifier", "UNVERIFIED"]

logger = logging.getLogger("agora.node.worker.state")

# The verdict's reason when no second member answered: the state is not used, its donor not blamed.
UNVERIFIED = "unverified"
# A second member's refusals that asking again cannot change: another stage or run, or not this caller.
_FINAL_REFUSALS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
                             grpc.StatusCode.UNAUTHENTICATED})
_REFUSED = "refused"  # `_ask`'s answer for such a member


class _Member(Protocol):
    """A member of the stage as the plan names it (node/membership/state_download.py's `Donor`)."""

    peer_id: str
    endpoint: str


@dataclass(frozen=True)
class StateChecks:
    """What a downloaded state is checked with: the options, this run's AdamW betas and eps (the moment
    bound), and `own`, the norms of this replica's own tensors (its initialisation or an older state:
    the scale reference when the donor is the stage's only member)."""

    options: StateCheckOptions
    betas: tuple[float, float]
    eps: float
    own: Callable[[], Awaitable[StateSketch]]

    @classmethod
    def for_run(cls, options: StateCheckOptions, optim: OptimConfig,
                own: Callable[[], Awaitable[StateSketch]]) -> "StateChecks":
        """The checks of a run whose optimizer is `optim` (its AdamW betas and eps)."""
        return cls(options, (float(optim.betas[0]), float(optim.betas[1])), float(optim.eps), own)


@dataclass(frozen=True)
class CheckReport:
    """One state's check: the verdict, the second members that answered (peer ids), the sketch bytes
    they sent, the seconds from the complete download to the verdict, and the second members whose
    sketch the state agrees with (none when it was checked alone)."""

    verdict: Verdict
    second_members: tuple[str, ...]
    sketch_bytes: int
    seconds: float
    confirmed_by: tuple[str, ...] = ()


@dataclass(frozen=True)
class SketchAsk:
    """The second members' sketches being gathered under `seed` for one donor's state: `answers`
    (a task) ends with (member, sketch, bytes) for each that answered."""

    seed: int
    answers: asyncio.Task

    def cancel(self) -> None:
        self.answers.cancel()


class StateVerifier:
    """Judges states downloaded for stage `stage` (see the module docstring)."""

    def __init__(self, *, run_id: str, stage: int, channels: ChannelFactory, metadata, checks: StateChecks,
                 max_message_bytes: int, ask_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.run_id, self.stage, self.channels, self.metadata = run_id, stage, channels, metadata
        self.checks, self.max_message_bytes, self.ask_timeout_s = checks, max_message_bytes, ask_timeout_s
        self._clock = clock

    def ask(self, others: Sequence[_Member], deadline: float) -> Optional[SketchAsk]:
        """Start gathering the sketches of up to `second_members` of `others` (the stage's credible
        members other than the donor, the plan's order) under a fresh seed; None when there is none
        to ask (the donor is the stage's only member)."""
        if not others:
            return None
        seed = secrets.randbits(63)
        return SketchAsk(seed, asyncio.create_task(self._answers(list(others), seed, deadline),
                                                   name=f"state-sketches-{self.stage}"))

    async def verify(self, tree: Any, asked: Optional[SketchAsk],
                     far_from_agreement: Callable[[int], bool]) -> CheckReport:
        """The verdict on a downloaded state `tree`; `asked`: what `ask` started when its download did."""
        started = self._clock()
        checks = self.checks
        local = local_refusal(tree, stage=self.stage, far_from_agreement=far_from_agreement, betas=checks.betas,
                              eps=checks.eps)
        if local is not None:
            return CheckReport(Verdict(*local), (), 0, self._clock() - started)
        model, step = tree["model"], tree["optimizer"]["steps"]
        if asked is None:
            verdict = judge_alone(await asyncio.to_thread(norms_of, model, step), await checks.own(), checks.options)
            return CheckReport(verdict, (), 0, self._clock() - started)
        expected = await asyncio.to_thread(sketch_state, model, asked.seed, checks.options.sketch_size, step)
        answers = await asked.answers
        if not answers:
            verdict = Verdict(UNVERIFIED, "no other member of the stage sent a sketch to check it against")
        elif dict(expected.numels) != dict(answers[0][1].numels):
            verdict = Verdict("state", "its parameters are not this stage's")
        else:
            verdict = judge(expected, [sketch for _, sketch, _ in answers], checks.options)
        return CheckReport(verdict, tuple(member.peer_id for member, _, _ in answers),
                           sum(size for _, _, size in answers), self._clock() - started,
                           tuple(answers[index][0].peer_id for index in verdict.agreeing))

    async def _answers(self, others: Sequence[_Member], seed: int,
                       deadline: float) -> list[tuple[_Member, StateSketch, int]]:
        """(member, its sketch, bytes) from up to `second_members` of `others`, in their order."""
        want = self.checks.options.second_members
        deadline = min(deadline, self._clock() + self.ask_timeout_s)
        numels = (await self.checks.own()).numels  # this stage's tensors: what every sketch must cover
        others = list(others)
        while True:
            answers, pending = [], list(others)
            while len(answers) < want and pending:
                batch, pending = pending[:want - len(answers)], pending[want - len(answers):]
                replies = await asyncio.gather(*(self._ask(member, seed, numels, deadline) for member in batch))
                for member, reply in zip(batch, replies):
                    if reply is _REFUSED:
                        others.remove(member)
                    elif reply is not None:
                        answers.append((member, *reply))
            if answers or not others or self._clock() + 1.0 >= deadline:
                return answers
            await asyncio.sleep(1.0)

    async def _ask(self, member: _Member, seed: int, numels: Mapping[str, int],
                   deadline: float) -> Optional[tuple[StateSketch, int]] | str:
        """Its sketch and bytes; None when asking again may get it; `_REFUSED` when it never will."""
        target = worker_server_name(self.stage, member.peer_id) if self.channels.secure else None
        channel = self.channels.open(member.endpoint, target_name=target,
                                     options=message_options(self.max_message_bytes))
        request = StateRequest(run_id=self.run_id, stage=self.stage, sketch_seed=seed,
                               sketch_size=self.checks.options.sketch_size)
        bound = len(numels) * (4 * self.checks.options.sketch_size + 1024) + 2**16
        try:
            timeout = max(0.1, min(self.ask_timeout_s, deadline - self._clock()))
            tree, size = await asyncio.wait_for(_receive(StateStub(channel), request, self.metadata, bound), timeout)
            return StateSketch.from_tree(tree, numels, self.checks.options.sketch_size), size
        except (grpc.aio.AioRpcError, StateWireError, asyncio.TimeoutError) as error:
            what = f"{error.code().name}: {error.details()}" if isinstance(error, grpc.aio.AioRpcError) else (
                str(error) or "no answer in time")
            logger.info("stage %d: second member %s sent no usable sketch (%s)", self.stage, member.endpoint, what)
            final = isinstance(error, grpc.aio.AioRpcError) and error.code() in _FINAL_REFUSALS
            return _REFUSED if final else None
        finally:
            await channel.close()


async def _receive(stub: StateStub, request: StateRequest, metadata, max_bytes: int) -> tuple[Any, int]:
    """One sketch call's stream, bounded by `max_bytes` and checked against its own SHA-256."""
    call = stub.download(request, metadata=metadata)
    receiver, digest = None, ""
    try:
        while (chunk := await call.next()) is not None:
            if receiver is None:
                receiver, digest = StateReceiver(chunk.total_bytes, max_bytes=max_bytes), chunk.sha256
            if chunk.offset != receiver.received:
                raise StateWireError(f"a chunk at offset {chunk.offset}, but {receiver.received} bytes are held")
            receiver.add(chunk.data)
    finally:
        call.cancel()
    if receiver is None or not receiver.complete or receiver.sha256() != digest:
        raise StateWireError("the sketch arrived incomplete or altered")
    return receiver.result(), receiver.total_bytes
