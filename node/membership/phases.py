"""A replica's life before it counts: weight sync, optimizer sync, then member (docs/design.md).

A replica that joins a stage mid-run (or comes back without a recent checkpoint) must neither
average its fresh weights into the trained ones nor take traffic before it holds the stage's state:

- weight_sync: it downloads the stage's whole state from a live member (node/membership/state_download.py),
  refuses Forward and Backward, and is not routed (trainers route to member and optimizer_sync
  only); it still counts the trainers' completed-batch reports, so it keeps the stage's epoch. Then
  it averages with weight 0 (node/averaging/loop.py: weight 0 unless member) until every slice of
  one SPARTA rotation has come back to it from a round: the download is minutes old by the time it
  lands on a real run, and each round replaces one slice of it with the members' current mean.
- optimizer_sync: trainers route to it; it trains on live microbatches, still with weight 0 in
  averaging, until `optimizer_sync_steps` optimizer steps with updates have warmed its Adam moments
  (the optimizer state it downloaded is as old as the parameters).
- member: full weight, and a donor for the next joiner.

Design choices:
- The decisions are pure functions over what the replica observes (`entry_phase`, `next_phase`),
  unit-tested without sockets; `SyncPhases` only feeds them and applies what they say.
- Nothing to download from (no member of the stage announces itself) means the replica is the
  first of its stage, or the last: it is the stage's state, so it is a member at once, unless
  the run is ahead of it (a member of another stage announces a step more than `lag_tolerance`
  past its own). Then the stage's state exists, or existed: a DHT read under churn can miss a
  live member's record (a newcomer's first read did, with its stage's other replica training,
  and its fresh weights were averaged into the trained ones), so it waits in weight sync for a
  member to download from, and only after `empty_stage_wait_s` with none takes the stage as
  lost and becomes its state, saying so in a warning. So is one
  at most `lag_tolerance` steps behind the stage's most advanced member: replicas that start
  together are identical by construction (name-seeded initialisation), a few steps apart are
  what averaging evens out, and a download would cost them the rotation for nothing. A replica
  resumed from a checkpoint that was not a member's syncs again.
- A stage whose only members announce steps far from what the run's members agree on
  (node/membership/state_download.py's `plan_donors`) is not empty: its members are reported and
  asked again every `retry_s`, for as long as it takes. Taking it as lost would make this replica's
  fresh weights the stage's state on one member's word about itself.
- A syncing replica that holds the stage's state (weight sync after its download, optimizer
  sync) while no member of the stage is left (the last one died mid-sync: chaos did it) holds
  the freshest copy there is, and becomes a member: `SyncPhases` reads the stage every
  `member_check_s` while it syncs, and two reads in a row without a member decide. It is then
  routed (trainers do not route to weight sync: the whole pipeline would wait for its rounds
  with nobody) and a donor for the next joiner, who would otherwise find nobody to download
  from and, after `empty_stage_wait_s`, start the stage again from fresh weights.
- Fallbacks, so a replica never stays out for good: weight sync ends after `fallback_rotations`
  rotations' worth of rounds (`n_slices` each) even if some slice's rounds kept failing (counted in
  rounds, not steps: on a small model steps outpace rounds), and optimizer sync after
  `fallback_rotations` times its steps counted in stage steps when the trainers sent it too little
  traffic to update as often. Either is logged.
- Every phase entered is a `sync_phase` milestone (with why), and every change the worker's
  `phase_changed` milestone, its DHT record's phase and the `agora_worker_phase` gauge; `history`
  keeps each phase with its seconds since the daemon started, which the join daemon writes into
  its stats file for the demo's summary. The download is a `state_downloaded` milestone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Sequence

from agora.dht.averaging import RoundResult
from agora.dht.records import Phase
from agora.node.replica.compute import StageCompute
from agora.node.membership.state_download import Donor, DonorPlan, DownloadedState, StateDownloader, StateDownloadError
from agora.node.worker.worker import StageWorker
from agora.pipeline.config import SyncConfig
from agora.pipeline.state_wire import StateWireError

__all__ = ["SyncPolicy", "SyncProgress", "StageView", "behind_the_run", "entry_phase", "next_phase",
           "rotation_slices", "SyncPhases"]

logger = logging.getLogger("agora.node.join")


@dataclass(frozen=True)
class SyncPolicy:
    optimizer_sync_steps: int = 100  # steps with updates in optimizer sync (the Agora run's 100)
    lag_tolerance: int = 3  # steps behind the stage's members that still join as a member (the Agora run's 3)
    fallback_rotations: int = 2  # see the module docstring
    empty_stage_wait_s: float = 30.0  # behind the run, how long no member of its stage means the stage is lost
    member_check_s: float = 5.0  # while syncing with the stage's state, how often it checks a member is left

    def __post_init__(self):
        if self.optimizer_sync_steps < 0 or self.lag_tolerance < 0 or self.fallback_rotations < 1:
            raise ValueError("optimizer_sync_steps and lag_tolerance must be >= 0, fallback_rotations >= 1")
        if not (self.empty_stage_wait_s >= 0 and self.member_check_s > 0):
            raise ValueError("empty_stage_wait_s must be >= 0, member_check_s > 0")

    @classmethod
    def from_config(cls, sync: SyncConfig) -> "SyncPolicy":
        """The run's policy, with this joiner's own warm-up (a machine-local setting)."""
        return cls(optimizer_sync_steps=sync.optimizer_sync_steps)


@dataclass(frozen=True)
class StageView:
    """What the DHT says now: whom to download the stage's state from (`plan`: its members other
    than this replica, best donor first, and those refused for the step they announce), and the
    highest step a member of any stage announces (None: no member anywhere)."""

    plan: DonorPlan
    run_step: Optional[int] = None

    @property
    def donors(self) -> Sequence[Donor]:
        return self.plan.donors


def behind_the_run(own_step: int, run_step: Optional[int], policy: SyncPolicy) -> bool:
    """The run's members are more than `lag_tolerance` steps past `own_step` (pure)."""
    return run_step is not None and run_step - own_step > policy.lag_tolerance


def rotation_slices(sync: Optional[SyncConfig]) -> int:
    """Slices (sparta) or fragments (diloco) in one full rotation of the averaging; 0 without averaging
    (one rotation takes `every_steps` times as many stage steps: 400 with the report's 5% every 20)."""
    return 0 if sync is None or sync.method == "none" else sync.n_slices


def entry_phase(*, own_step: int, resumed_phase: Optional[str], donor_steps: Sequence[int],
                policy: SyncPolicy, run_step: Optional[int] = None) -> Phase:
    """Where a starting replica begins: a member or in weight sync (see the module docstring).

    `own_step`: its optimizer step (0 when fresh, a checkpoint's when resumed); `resumed_phase`: the
    phase its checkpoint was written in (None: fresh); `donor_steps`: the steps the stage's
    members announce; `run_step`: the highest step any member of the run announces."""
    if not donor_steps:
        return Phase.WEIGHT_SYNC if behind_the_run(own_step, run_step, policy) else Phase.MEMBER
    if resumed_phase not in (None, Phase.MEMBER):
        return Phase.WEIGHT_SYNC
    return Phase.MEMBER if max(donor_steps) - own_step <= policy.lag_tolerance else Phase.WEIGHT_SYNC


@dataclass(frozen=True)
class SyncProgress:
    """What a syncing replica has observed since its phase began."""

    phase: Phase
    downloaded: bool  # weight sync: the state is in
    steps: int  # stage steps counted (completed-batch reports) since the phase began
    updates: int  # of those, steps that changed its weights (it had microbatches)
    rounds: int  # averaging rounds it took part in (any outcome) since the download
    slices_averaged: frozenset[int]  # slices whose round committed since the download
    n_slices: int  # in one rotation; 0 without averaging


def next_phase(progress: SyncProgress, policy: SyncPolicy) -> Optional[tuple[Phase, str]]:
    """(the phase to move to, why), or None to stay (pure)."""
    if progress.phase == Phase.WEIGHT_SYNC:
        if not progress.downloaded:
            return None
        if progress.n_slices == 0:
            return Phase.OPTIMIZER_SYNC, "state downloaded (no averaging in this run)"
        if len(progress.slices_averaged) >= progress.n_slices:
            return Phase.OPTIMIZER_SYNC, f"every one of the {progress.n_slices} slices averaged since the download"
        if progress.rounds >= policy.fallback_rotations * progress.n_slices:
            return Phase.OPTIMIZER_SYNC, (f"{progress.rounds} rounds ({policy.fallback_rotations} rotations) ran with "
                                      f"{len(progress.slices_averaged)} of {progress.n_slices} slices averaged")
        return None
    if progress.phase == Phase.OPTIMIZER_SYNC:
        if progress.updates >= policy.optimizer_sync_steps:
            return Phase.MEMBER, f"{progress.updates} optimizer steps warmed its Adam moments"
        if progress.steps >= policy.fallback_rotations * max(1, policy.optimizer_sync_steps):
            return Phase.MEMBER, (f"{progress.steps} stage steps passed with only {progress.updates} updates of "
                                  "its own (little traffic routed to it)")
    return None


class SyncPhases:
    """Moves one started worker through its phases (see the module docstring)."""

    def __init__(self, worker: StageWorker, policy: SyncPolicy, sync: Optional[SyncConfig],
                 clock: Callable[[], float] = time.monotonic):
        self.worker, self.policy = worker, policy
        self.n_slices = rotation_slices(sync)
        self._clock = clock
        self._started = clock()
        self.history: list[tuple[str, float]] = []
        self.downloaded = False
        self._slices: set[int] = set()
        self._steps = 0
        self._updates = 0
        self._rounds = 0
        self._wake = asyncio.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None
        self._own_step = 0
        self._members_source: Optional[Callable[[], Awaitable[StageView]]] = None
        self._empty_reads = 0  # consecutive reads, while syncing, that showed no member of the stage

    @property
    def phase(self) -> Phase:
        return self.worker.phase

    def enter(self, phase: Phase, why: str) -> None:
        """Set the worker's phase (the record, metrics and milestone follow it) and remember when."""
        at = round(self._clock() - self._started, 3)
        logger.info("stage %d: phase %s (%s)", self.worker.stage_index, phase, why,
                    extra={"milestone": "sync_phase", "fields": {"stage": self.worker.stage_index, "phase": phase,
                                                                 "why": why, "seconds": at}})
        if self.history:
            self.worker.phase = phase  # the worker's phase_changed milestone
        else:
            self.worker.start_in_phase(phase)  # before its first announce: it never was in another
        self.history.append((phase, at))
        self._steps = self._updates = 0

    def state_downloaded(self) -> None:
        self.downloaded = True
        self._steps = self._updates = self._rounds = 0
        self._slices.clear()

    async def begin(self, *, own_step: int, resumed_phase: Optional[str],
                    members: Callable[[], Awaitable[StageView]]) -> None:
        """Decide where this replica starts (`entry_phase`) from the members its stage announces now. If
        the DHT cannot say, it starts in weight sync, whose download asks again (a replica is never a
        member by default: that is the mistake the phases exist to prevent)."""
        self._own_step = own_step
        self._members_source = members
        view = await self._members(members, attempts=3)
        if view is None:
            self.enter(Phase.WEIGHT_SYNC, "the stage's members could not be read from the DHT")
            return
        donors = view.donors
        phase = entry_phase(own_step=own_step, resumed_phase=resumed_phase, donor_steps=[d.step for d in donors],
                            policy=self.policy, run_step=view.run_step)
        if phase == Phase.MEMBER:
            why = ("no other member of the stage announces itself: this replica is its state" if not donors else
                   f"at step {own_step}, within {self.policy.lag_tolerance} of the stage's members "
                   f"(at most step {max(d.step for d in donors)})")
        elif not donors:
            why = (f"no member of the stage announces itself yet, but the run's members are at step "
                   f"{view.run_step} and this replica at {own_step}: waiting for one to download from")
        else:
            why = (f"the stage's members are at step {max(d.step for d in donors)}, this replica at {own_step}"
                   + ("" if resumed_phase in (None, Phase.MEMBER) else f" (resumed in phase {resumed_phase})"))
        self.enter(phase, why)

    async def download(self, downloader: StateDownloader, members: Callable[[], Awaitable[StageView]],
                       apply: Callable[[object], Awaitable[int]], retry_s: float = 5.0) -> Optional[DownloadedState]:
        """Weight sync's download: from the members announced now, again after `retry_s` when none gave
        its state; None when no member is left (this replica then is the stage's state: a member),
        which, behind the run, only `empty_stage_wait_s` without one says (the module docstring)."""
        empty_since = None

        async def members_now() -> DonorPlan:  # a donor that left or moved is not waited for
            fresh = await self._members(members, attempts=1)
            return fresh.plan if fresh is not None else DonorPlan(())
        while True:
            view = await self._members(members, attempts=1)
            if view is None:
                await asyncio.sleep(retry_s)
                continue
            donors = view.donors
            if not donors and view.plan.outliers:  # members, none of them credible: never the stage's state
                downloader.report_outliers(view.plan)
                logger.warning("stage %d: weight sync: the stage's only members announce steps far from the "
                               "run's; asking again in %g s", self.worker.stage_index, retry_s)
                await asyncio.sleep(retry_s)
                continue
            if not donors:
                now = self._clock()
                empty_since = now if empty_since is None else empty_since
                behind = behind_the_run(self._own_step, view.run_step, self.policy)
                if behind and now - empty_since < self.policy.empty_stage_wait_s:
                    logger.warning("stage %d: weight sync: no member of the stage announces itself while the "
                                   "run's members are at step %d; asking again in %g s (after %g s without one the "
                                   "stage's state is taken as lost)", self.worker.stage_index, view.run_step,
                                   retry_s, self.policy.empty_stage_wait_s)
                    await asyncio.sleep(retry_s)
                    continue
                if behind:
                    logger.warning("stage %d: no member of the stage for %.0f s while the run's members are at "
                                   "step %d: its state is lost, and this replica's (step %d) becomes it",
                                   self.worker.stage_index, now - empty_since, view.run_step, self._own_step)
                    self.enter(Phase.MEMBER, f"no member of the stage for {now - empty_since:.0f} s while the run is "
                                             f"at step {view.run_step}: the stage's state was lost, this replica is it now")
                else:
                    self.enter(Phase.MEMBER,
                               "no member of the stage is left to download from: this replica is its state")
                return None
            empty_since = None
            try:
                result = await downloader.download(view.plan, replan=members_now)
                step = await apply(result.tree)
            except (StateDownloadError, StateWireError) as error:
                logger.warning("stage %d: weight sync: %s; trying again in %g s", self.worker.stage_index, error,
                               retry_s)
                await asyncio.sleep(retry_s)
                continue
            self.state_downloaded()
            fields = {"stage": self.worker.stage_index, "donor": result.donor.peer_id, "step": step,
                      "bytes": result.total_bytes, "seconds": round(result.seconds, 3), "resumes": result.resumes}
            logger.info("stage %d: state downloaded from %s at step %d (%d bytes in %.2f s, %d resumes)",
                        self.worker.stage_index, result.donor.endpoint, result.step, result.total_bytes,
                        result.seconds, result.resumes, extra={"milestone": "state_downloaded", "fields": fields})
            return result

    async def _members(self, members: Callable[[], Awaitable[StageView]], attempts: int,
                       pause_s: float = 1.0) -> Optional[StageView]:
        for attempt in range(attempts):
            try:
                return await members()
            except Exception as error:  # a DHT hiccup: asked again, never a crash
                logger.warning("stage %d: could not read the stage's members: %s", self.worker.stage_index, error)
                if attempt + 1 < attempts:
                    await asyncio.sleep(pause_s)
        return None

    async def start(self, averaging=None) -> None:
        """Watch the stage's steps (a step hook) and the averaging rounds until the replica is a member."""
        self._loop = asyncio.get_running_loop()
        if averaging is not None:
            averaging.round_observers.append(self._on_round)
        await self.worker.on_compute(lambda compute: compute.step_hooks.append(self._on_step))
        self._task = asyncio.create_task(self._run(), name="sync-phases")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
            await self._remove_hook()

    def progress(self) -> SyncProgress:
        return SyncProgress(self.phase, self.downloaded, self._steps, self._updates, self._rounds,
                            frozenset(self._slices), self.n_slices)

    def _on_step(self, compute: StageCompute) -> None:  # compute thread, after every step or advance
        updated = compute.last_step is not None and compute.last_step.step == compute.optimizer.steps
        self._loop.call_soon_threadsafe(self._count_step, updated)

    def _count_step(self, updated: bool) -> None:
        self._steps += 1
        self._updates += int(updated)
        self._wake.set()

    def _on_round(self, result: RoundResult, index: int, applied: bool) -> None:
        if not self.downloaded:
            return
        self._rounds += 1
        if result.outcome == "committed":
            self._slices.add(index)
        self._wake.set()

    async def _run(self) -> None:
        checked = self._clock()
        while self.phase in (Phase.WEIGHT_SYNC, Phase.OPTIMIZER_SYNC):
            move = next_phase(self.progress(), self.policy)
            if move is not None:
                self.enter(*move)
                continue
            if self._clock() - checked >= self.policy.member_check_s:
                checked = self._clock()
                if await self._last_copy():
                    continue
            try:
                await asyncio.wait_for(self._wake.wait(), self.policy.member_check_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
        await self._remove_hook()  # a member's steps need no counting

    async def _last_copy(self) -> bool:
        """Make this replica a member if it holds the stage's state and no member is left (see the
        module docstring); whether it did. A read that fails says nothing: it stays."""
        if self._members_source is None or (self.phase == Phase.WEIGHT_SYNC and not self.downloaded):
            return False
        view = await self._members(self._members_source, attempts=1)
        if view is None or view.donors:
            self._empty_reads = 0
            return False
        self._empty_reads += 1
        if self._empty_reads < 2:  # one read can miss a live member's record under churn: ask once more
            return False
        logger.warning("stage %d: no member of the stage is left while this replica syncs with its state: it is "
                       "the stage's freshest copy, a member now", self.worker.stage_index)
        self.enter(Phase.MEMBER, f"no member of the stage is left, and this replica holds its state ({self.phase}, "
                             "downloaded): the stage's freshest copy")
        return True

    async def _remove_hook(self) -> None:
        try:
            await self.worker.on_compute(lambda compute: compute.step_hooks.remove(self._on_step))
        except (RuntimeError, ValueError):
            pass  # the compute thread is gone already, or the hook was removed
