"""Weight sync, the joiner's side: download the stage's state from one of its live members.

Design choices:
- Donors are the stage's replicas announced in the DHT in phase `member` (not this node), in the
  order `plan_donors` gives (pure): closest to the step the members agree on first, then least
  loaded, ties broken at random so that joiners arriving together spread over the donors. Never the
  highest step first: a record's step is what its writer says about itself, and one member
  announcing step 10**9 would then serve every joiner and every export. The agreed step is the
  median the stage's members announce (the lower one of an even count, as the replica's epoch
  takes it: node/replica/epoch.py); a stage of one or two members has no majority, so there it is
  the median over the run's members of every stage (the stage's included), which count the same
  global batches. A member announcing a step more than `max_gap` from it (the report window's
  `ahead`: a replica that far from its stage is re-anchored by its own epoch rules) is an outlier:
  never asked, and reported once per downloader (a `state_donor_refused` milestone and the
  refusals metric, monitor/weight_sync_metrics.py).
- A donor that is full (RESOURCE_EXHAUSTED), refuses (not a member any more, a permission or
  fingerprint problem) or sends something unusable is left for the next; a transfer that drops
  (the connection, a deadline, the donor's own timeout) is resumed from the bytes already held,
  on the same donor and snapshot, up to `resumes_per_donor` times; a snapshot the donor no longer
  holds (NOT_FOUND) starts over there. The whole download has a deadline (`timeout_s`, the Agora
  run's 480 s by default) and each chunk one of its own (`next_chunk_s`), so a donor that stalls
  costs seconds, not the join.
- Bounded and checked as it arrives (pipeline/state_wire.py): the announced size must fit this
  stage's own state (`max_bytes`), every chunk must continue the same snapshot at the offset
  held, and the SHA-256 of the whole stream must equal the donor's before anything is used.
- Checked before it is returned (node/membership/state_verify.py, node/membership/state_check.py):
  the SHA-256 only says the bytes arrived as the donor sent them, so the values are checked too:
  finite, in range, and, where the stage has another credible member, agreeing with the sketch a
  second member computes of its own state. A refused state is never returned; its donor is
  reported (a `state_donor_refused` milestone, the refusals metric by reason) and the next donor
  tried. A state no other member answers for is not used either, but nobody is blamed: every
  other member being unreachable means the plan is stale, so the download ends and the caller
  reads the members again.
- Progress: a tqdm bar in bytes on a terminal, a plain line every few seconds otherwise
  (node/progress.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence

import grpc

from agora.auth.grpc_policy import FINGERPRINT_METADATA
from agora.dht.records import Phase, WorkerRecord
from agora.monitor.weight_sync_metrics import WeightSyncMetrics
from agora.node.membership.state_verify import UNVERIFIED, CheckReport, SketchAsk, StateChecks, StateVerifier
from agora.node.progress import Progress
from agora.node.replica.epoch import stage_step
from agora.node.rpc.server import message_options
from agora.node.rpc.tls import ChannelFactory, worker_server_name
from agora.pipeline.fingerprint import RunFingerprint
from agora.pipeline.state_wire import StateReceiver, StateWireError
from agora.protos.state_adapter import StateChunk, StateRequest, StateStub

__all__ = ["Donor", "DonorPlan", "plan_donors", "StateDownloadError", "DownloadedState", "StateDownloader"]

logger = logging.getLogger("agora.node.worker.state")

# Codes after which a transfer is resumed where it stopped (the link or the donor hiccuped).
_RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                        grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED})


@dataclass(frozen=True)
class Donor:
    peer_id: str
    endpoint: str
    step: int
    queue_depth: int = 0


@dataclass(frozen=True)
class DonorPlan:
    """Whom to download a stage's state from: `donors` in the order to try, `outliers` (members that
    announce a step more than `max_gap` from `agreed_step`: never asked), and the step they agree on."""

    donors: tuple[Donor, ...]
    outliers: tuple[Donor, ...] = ()
    agreed_step: Optional[int] = None
    max_gap: Optional[int] = None

    def far_from_agreement(self, step: int) -> bool:
        """`step` lies more than `max_gap` from the agreed step (False when either is unknown)."""
        return self.agreed_step is not None and self.max_gap is not None and abs(step - self.agreed_step) > self.max_gap


def _members(records: Sequence[WorkerRecord], own_peer_id: str) -> list[Donor]:
    return [Donor(r.peer_id, r.endpoint, r.step, r.queue_depth) for r in records
            if r.phase == Phase.MEMBER and r.peer_id != own_peer_id]


def plan_donors(by_stage: Mapping[int, Sequence[WorkerRecord]], stage: int, own_peer_id: str, rng: random.Random,
                *, max_gap: int) -> DonorPlan:
    """Stage `stage`'s members other than this node, closest to the step they agree on first, then
    least queued, ties at random; members farther than `max_gap` from it set apart (pure; see the
    module docstring)."""
    members = _members(by_stage.get(stage, ()), own_peer_id)
    steps = [d.step for d in members]
    if len(steps) < 3:  # no majority inside the stage: every stage's members count the same batches
        steps += [d.step for other, records in by_stage.items() if other != stage
                  for d in _members(records, own_peer_id)]
    agreed = stage_step(steps)
    if agreed is None:
        return DonorPlan((), max_gap=max_gap)
    keyed = sorted(((abs(d.step - agreed), d.queue_depth, rng.random(), d) for d in members),
                   key=lambda entry: entry[:3])
    ordered = [entry[-1] for entry in keyed]
    return DonorPlan(tuple(d for d in ordered if abs(d.step - agreed) <= max_gap),
                     tuple(d for d in ordered if abs(d.step - agreed) > max_gap), agreed, max_gap)


class StateDownloadError(RuntimeError):
    """No donor gave a usable state before the deadline; the message says what each did."""


@dataclass(frozen=True)
class DownloadedState:
    tree: Any  # pipeline/state_wire's tree: stage, step, model, optimizer, averaging
    step: int
    donor: Donor
    total_bytes: int
    seconds: float
    resumes: int  # transfers resumed after a drop
    attempts: list[str]  # what each try did, for the log
    check: Optional[CheckReport] = None  # how it was checked (None: the downloader checks nothing)


class StateDownloader:
    """Downloads stage `stage`'s state for a joiner (see the module docstring)."""

    def __init__(self, *, run_id: str, stage: int, fingerprint: RunFingerprint, channels: ChannelFactory,
                 max_bytes: int, checks: Optional[StateChecks], timeout_s: float = 480.0, next_chunk_s: float = 30.0,
                 resumes_per_donor: int = 3, max_message_bytes: int = 16 * 2**20, show_progress: bool = True,
                 label: str = "weight sync", clock: Callable[[], float] = time.monotonic,
                 on_progress: Optional[Callable[[int, int], None]] = None,
                 metrics: Optional[WeightSyncMetrics] = None):
        """`checks`: what a downloaded state must pass before it is returned (node/membership/state_verify.py;
        None, only for tests of the transfer itself: nothing). `on_progress(held, total)`: called with the
        bytes held after every chunk is taken (an observer: it must not raise); `metrics`: refusals and
        checks counted."""
        self.run_id, self.stage, self.channels = run_id, stage, channels
        self._metadata = ((FINGERPRINT_METADATA, fingerprint.text()),)
        self.max_bytes, self.timeout_s, self.next_chunk_s = max_bytes, timeout_s, next_chunk_s
        self.resumes_per_donor, self.max_message_bytes = resumes_per_donor, max_message_bytes
        self.show_progress, self.label = show_progress, label  # the progress bar's: "weight sync", "export"
        self.on_progress, self.metrics = on_progress, metrics
        self._clock = clock
        self._verifier = None if checks is None else StateVerifier(
            run_id=run_id, stage=stage, channels=channels, metadata=self._metadata, checks=checks,
            max_message_bytes=max_message_bytes, ask_timeout_s=next_chunk_s, clock=clock)
        self._reported: set[tuple[str, str]] = set()  # (peer id, reason) refused and reported

    def refuse(self, donor: Donor, reason: str, detail: str) -> None:
        """Report a donor whose state (or claim) is not used: a `state_donor_refused` milestone and the
        refusals metric, once per donor and reason."""
        if (donor.peer_id, reason) in self._reported:
            return
        self._reported.add((donor.peer_id, reason))
        logger.warning("stage %d: %s: donor %s (%s) refused: %s", self.stage, self.label, donor.peer_id,
                       donor.endpoint, detail,
                       extra={"milestone": "state_donor_refused",
                              "fields": {"stage": self.stage, "donor": donor.peer_id, "endpoint": donor.endpoint,
                                         "announced_step": donor.step, "reason": reason, "detail": detail}})
        if self.metrics is not None:
            self.metrics.refused(reason)

    def report_outliers(self, plan: DonorPlan) -> None:
        for outlier in plan.outliers:
            self.refuse(outlier, "step", f"it announces step {outlier.step}, {abs(outlier.step - plan.agreed_step)} "
                                         f"from step {plan.agreed_step} the members agree on (at most {plan.max_gap})")

    async def download(self, plan: DonorPlan,
                       replan: Optional[Callable[[], Awaitable[DonorPlan]]] = None) -> DownloadedState:
        """The state from the first donor of `plan` that gives a complete, intact one that passes its
        checks; StateDownloadError if none does before the deadline (donors are tried in turn, again
        from the first while time is left; a donor whose state was refused is not asked again), or as
        soon as a state cannot be checked (no other member answers). The plan's outliers are reported,
        never asked. `replan`: after a round in which no donor gave a state, the stage's members as
        the DHT has them now (a donor that left, or moved to another stage, is not waited for until
        the deadline; a plan with no donor keeps the one before)."""
        self.report_outliers(plan)
        donors = plan.donors
        if not donors:
            refused = f" ({len(plan.outliers)} refused for the step they announce)" if plan.outliers else ""
            raise StateDownloadError(f"no member of stage {self.stage} to download its state from{refused}")
        started = self._clock()
        deadline = started + self.timeout_s
        attempts: list[str] = []
        refused: set[str] = set()  # donors whose state this download refused: not asked again
        resumes = 0
        while self._clock() < deadline and len(refused) < len(donors):
            for donor in donors:
                if self._clock() >= deadline:
                    break
                if donor.peer_id in refused:
                    continue
                result, note, resumed = await self._attempt(donor, plan, deadline)
                resumes += resumed
                if result is not None:
                    tree, step, total_bytes, check = result
                    if check is None or check.verdict.refusal is None:
                        attempts.append(f"{donor.endpoint}: {note}")
                        return DownloadedState(tree, step, donor, total_bytes, self._clock() - started, resumes,
                                               attempts, check)
                    if check.verdict.refusal == UNVERIFIED:  # every other member is unreachable: a stale plan
                        raise StateDownloadError(f"stage {self.stage}: the state from {donor.endpoint} could not be "
                                                 f"checked ({check.verdict.detail}); it is not used")
                    refused.add(donor.peer_id)
                    note = f"{note}, refused: {check.verdict.refusal}: {check.verdict.detail}"
                attempts.append(f"{donor.endpoint}: {note}")
            await asyncio.sleep(min(1.0, max(0.0, deadline - self._clock())))  # every donor busy: a pause
            if replan is not None and self._clock() < deadline:
                fresh = await replan()
                if fresh.donors:
                    plan, donors = fresh, fresh.donors
        why = "every donor's state was refused" if len(refused) == len(donors) else \
            f"no donor gave a state that passed its checks within {self.timeout_s:g} s"
        raise StateDownloadError(f"stage {self.stage}: {why} (" + "; ".join(attempts[-6:]) + ")")

    async def _attempt(self, donor: Donor, plan: DonorPlan, deadline: float
                       ) -> tuple[Optional[tuple[Any, int, int, Optional[CheckReport]]], str, int]:
        """((state, step, bytes, its check) or None; what happened; resumes) for one donor. The second
        members are asked for their sketches when the donor's stream starts, when it takes its
        snapshot (node/membership/state_verify.py)."""
        asked: list[Optional[SketchAsk]] = []

        def ask_second_members() -> None:
            if self._verifier is not None and not asked:
                asked.append(self._verifier.ask([d for d in plan.donors if d.peer_id != donor.peer_id], deadline))

        try:
            result, note, resumes = await self._from(donor, deadline, ask_second_members)
            if result is None:
                return None, note, resumes
            receiver, step = result
            tree = receiver.result()
            check = await self._check(tree, donor, asked[0] if asked else None, plan)
            return (tree, step, receiver.total_bytes, check), note, resumes
        finally:
            if asked and asked[0] is not None:
                asked[0].cancel()

    async def _check(self, tree: Any, donor: Donor, asked: Optional[SketchAsk],
                     plan: DonorPlan) -> Optional[CheckReport]:
        """The verdict on a state `donor` sent, reported (a refusal: the donor; any: the metrics)."""
        if self._verifier is None:
            return None
        check = await self._verifier.verify(tree, asked, plan.far_from_agreement)
        if self.metrics is not None:
            self.metrics.checked(check.seconds, check.sketch_bytes)
        if check.verdict.refusal not in (None, UNVERIFIED):
            self.refuse(donor, check.verdict.refusal, f"its state is not used: {check.verdict.detail}")
        return check

    async def _from(self, donor: Donor, deadline: float, on_start: Callable[[], None]
                    ) -> tuple[Optional[tuple[StateReceiver, int]], str, int]:
        """(receiver and step, or None; what happened; resumes) for one donor; `on_start()` when its
        first chunk of a snapshot arrives."""
        target = worker_server_name(self.stage, donor.peer_id) if self.channels.secure else None
        channel = self.channels.open(donor.endpoint, target_name=target,
                                     options=message_options(self.max_message_bytes))
        transfer = _Transfer(StateStub(channel), StateRequest(run_id=self.run_id, stage=self.stage), self.max_bytes,
                             self._metadata, self.label, self.on_progress, on_start)
        resumes = 0
        try:
            while True:
                try:
                    await transfer.run(min(self.next_chunk_s, max(0.0, deadline - self._clock())),
                                       max(1.0, deadline - self._clock()), self.show_progress)
                    note = None if transfer.complete else "the stream ended before the state was complete"
                except grpc.aio.AioRpcError as error:
                    code = error.code()
                    note = f"{code.name}: {error.details()}"
                    if code == grpc.StatusCode.NOT_FOUND and transfer.snapshot is not None:
                        transfer.restart()  # the donor dropped the snapshot: start over there
                    elif code not in _RESUMABLE:
                        level = logging.INFO if code == grpc.StatusCode.RESOURCE_EXHAUSTED else logging.WARNING
                        logger.log(level, "state download from %s: %s; trying another donor", donor.endpoint, note)
                        return None, note, resumes
                except StateWireError as error:
                    logger.warning("donor %s sent an unusable state: %s", donor.endpoint, error)
                    return None, f"unusable state: {error}", resumes
                except asyncio.TimeoutError:
                    note = f"no chunk for {self.next_chunk_s:g} s"
                if note is None:
                    if transfer.receiver.sha256() != transfer.snapshot[1]:
                        logger.warning("donor %s: the state's SHA-256 differs from what it announced", donor.endpoint)
                        return None, "SHA-256 mismatch", resumes
                    return (transfer.receiver, transfer.snapshot[2]), f"{transfer.total_bytes} bytes", resumes
                if resumes >= self.resumes_per_donor or self._clock() >= deadline:
                    return None, note, resumes
                resumes += 1
                logger.warning("state download from %s interrupted (%s) at %d of %d bytes; resuming", donor.endpoint,
                               note, transfer.received, transfer.total_bytes)
        finally:
            transfer.close()
            await channel.close()


class _Transfer:
    """One donor's snapshot as received so far, across the calls that resume it."""

    def __init__(self, stub: StateStub, request: StateRequest, max_bytes: int, metadata, label: str,
                 on_progress: Optional[Callable[[int, int], None]] = None,
                 on_start: Optional[Callable[[], None]] = None):
        self.stub, self.request, self.max_bytes, self.metadata, self.label = stub, request, max_bytes, metadata, label
        self.on_progress, self.on_start = on_progress, on_start
        self.receiver: Optional[StateReceiver] = None
        self.snapshot: Optional[tuple[str, str, int]] = None  # id, sha256, step
        self._bar: Optional[Progress] = None

    @property
    def received(self) -> int:
        return self.receiver.received if self.receiver is not None else 0

    @property
    def total_bytes(self) -> int:
        return self.receiver.total_bytes if self.receiver is not None else 0

    @property
    def complete(self) -> bool:
        return self.receiver is not None and self.receiver.complete

    def restart(self) -> None:
        self.receiver, self.snapshot = None, None

    async def run(self, next_chunk_s: float, timeout_s: float, show_progress: bool) -> None:
        """One DownloadState call from where the transfer stands, until the donor ends the stream."""
        request = replace(self.request, snapshot_id=self.snapshot[0] if self.snapshot else "", offset=self.received)
        call = self.stub.download(request, metadata=self.metadata, timeout=timeout_s)
        try:
            while True:
                chunk = await asyncio.wait_for(call.next(), next_chunk_s)
                if chunk is None:
                    return
                self._take(chunk, show_progress)
        finally:
            call.cancel()  # a no-op once the call ended; drops it when this read failed

    def _take(self, chunk: StateChunk, show_progress: bool) -> None:
        if self.receiver is None:
            self.receiver = StateReceiver(chunk.total_bytes, max_bytes=self.max_bytes)
            self.snapshot = (chunk.snapshot_id, chunk.sha256, chunk.step)
            if self.on_start is not None:
                self.on_start()
        elif (chunk.snapshot_id, chunk.sha256, chunk.step) != self.snapshot \
                or chunk.total_bytes != self.receiver.total_bytes:
            raise StateWireError("a chunk of another snapshot arrived in the middle of a transfer")
        if chunk.offset != self.receiver.received:
            raise StateWireError(f"a chunk at offset {chunk.offset}, but {self.receiver.received} bytes are held")
        self.receiver.add(chunk.data)
        if self.on_progress is not None:
            self.on_progress(self.receiver.received, self.receiver.total_bytes)
        if show_progress:
            if self._bar is None:
                self._bar = Progress(self.receiver.total_bytes, f"{self.label} (stage {self.request.stage})", unit="B",
                                     line_every_s=5.0)
            self._bar.update(self.receiver.received, f"step {chunk.step}", force=self.receiver.complete)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
