"""Which control messages a replica accepts: the completed-batch window and the Step bounds. Pure.

Asynchronous mode steps a replica once per global batch a trainer reports done (`Step` with
`completed_batch`; node/replica/compute.py), so a report moves the optimizer's step count and with it
the learning-rate schedule and the averaging rounds, for good. Any admitted trainer can send one, so
a report is judged against the replica's own count `s` before it is applied:

- Replay: a batch already counted gets its recorded reply (retries, and every trainer reporting the
  same batch). Nothing changes.
- Joining: the first report a replica counts (it started, restarted or joined mid-run) is taken as
  the stage's epoch: a batch more than `catch_up` beyond `s` sets the count to it, so the newcomer's
  learning rate is the swarm's and not a second warmup. When the stage's other replicas announce
  their step counts (their DHT records, signed by each; the join daemon passes their median as
  `stage_step`), that first report must lie within the window around it; only a replica alone in
  its stage takes whatever its first reporter says (below 2**53).
- Re-anchoring: a replica whose own count is more than `ahead` away from `stage_step` (it was cut
  off for a while, or a bad first report set it) counts a report near `stage_step` and takes it as
  its count, in either direction. A trainer alone cannot move a replica away from what its stage's
  other replicas announce; a stage whose other replicas lie is out of reach of any of this.
- Too far ahead: after that, a batch more than `ahead` beyond `s` is refused, not applied. Reports of
  several trainers arrive out of order, and a replica that missed some lags a few; `ahead` covers
  that with room to spare (trainers keep about two global batches each in flight, see
  node/trainer/trainer.py).
- Jumps: within the window, a batch more than `catch_up` ahead moves the count towards it (a replica
  that missed reports catches up), but only as far as two things reach. The stage's count is free:
  a replica behind `stage_step` may jump up to it, since its other replicas are there already. Beyond
  that a jump is paid from the reporter's credit here: each report a replica counts earns its
  trainer one step of credit (at most `ahead` of it kept), and a jump of d steps beyond the stage's
  count spends d. What the credit does not cover is not jumped: the report is counted as one step.
  So one trainer's reports move a replica at most twice as far as they are many (one step each,
  one more of credit) plus the `ahead` it may have saved, and the stage's median with it: sent to
  every replica of a stage, 780 reports of a batch 256 ahead move the stage by at most 1,816 steps,
  not to the end of a 200k-step schedule (before, each moved every replica, and so the median, by
  256). An honest trainer's credit is what it reported, far more than the few batches a replica
  that missed some needs; a replica alone in its stage (no `stage_step`) catches up on that credit
  alone. Which trainer reports which batch is bound to the unit's lease
  (node/worker/unit_holders.py); reports are still not bound to work done, so a trainer can still
  advance a replica one step per batch it holds and reports.
- Stale: a batch below `s - behind` is refused instead of forcing a step. Counted batches are
  remembered while they are inside the window (pruned below `s - behind`, never more than
  `behind + ahead + 1` of them), so every batch either replays, is refused as stale, or counts once:
  no batch forces a second step however late it comes (before, a report was only compared with the
  last 4096 counted, and an older number forced a step each time).

Step's other fields scale the gradient (the accumulated sum is divided by `microbatches / replicas`),
so they are bounded too: `microbatches` by the run's `train.microbatches` (what every trainer sends;
the fingerprint makes trainers and workers agree on it) and `replicas` by `max_replicas`, a sane
bound on a stage's replicas rather than the live count, which a worker does not know (its averaging
group is a subset). The gradient is then clipped by the optimizer, so what a bad `replicas` can still
do is bounded by the clip. A synchronous barrier must name the step it closes (the trainer always
does), so a stray Step cannot step a worker mid-batch by leaving it out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional, TypeVar

__all__ = [
    "ReportWindow",
    "ReportDecision",
    "ReportCredits",
    "judge_report",
    "jump",
    "stage_step",
    "prune_counted",
    "check_step_fields",
    "MAX_COMPLETED_BATCH",
    "EPOCH_CATCH_UP_BATCHES",
    "DEFAULT_REPORT_AHEAD",
    "DEFAULT_REPORT_BEHIND",
    "DEFAULT_MAX_REPLICAS",
]

# Global batch ids a completed-batch report may carry. The catch-up adopts the id as the step
# count, and every reply carries that count as a uint64: a report of 2**64 - 1 made every later reply
# unencodable (UNKNOWN, for good). Below 2**53 the count also stays exact as a float64 (the
# learning-rate schedule computes with it); no run gets near it.
MAX_COMPLETED_BATCH = 2**53
# A report this far beyond the replica's count means it missed reports (or is joining): it adopts the
# batch as its count. Reports of several trainers arrive a little out of order, never by this much.
EPOCH_CATCH_UP_BATCHES = 32
# After the first counted report: how far beyond its count a report may be (8 trainers with two
# global batches in flight each are 16 apart at most; the rest is room for a replica that missed some).
DEFAULT_REPORT_AHEAD = 256
# How far behind its count a report is still counted (a slow trainer's batch finishing late).
DEFAULT_REPORT_BEHIND = 1024
# Replicas a report may claim for one stage.
DEFAULT_MAX_REPLICAS = 1024

R = TypeVar("R")


@dataclass(frozen=True)
class ReportWindow:
    ahead: int = DEFAULT_REPORT_AHEAD
    behind: int = DEFAULT_REPORT_BEHIND
    catch_up: int = EPOCH_CATCH_UP_BATCHES
    max_replicas: int = DEFAULT_MAX_REPLICAS

    def __post_init__(self):
        if self.ahead < self.catch_up or self.catch_up < 1 or self.behind < 1 or self.max_replicas < 1:
            raise ValueError(f"report window: need ahead >= catch_up >= 1, behind >= 1 and max_replicas >= 1, got "
                             f"ahead={self.ahead}, catch_up={self.catch_up}, behind={self.behind}, "
                             f"max_replicas={self.max_replicas}")


@dataclass(frozen=True)
class ReportDecision:
    """`refusal`: why the report is refused (None: count it); `adopt`: the step count to take first;
    `spent`: the reporter's credit that jump costs (see the module docstring)."""

    refusal: Optional[str] = None
    adopt: Optional[int] = None
    spent: int = 0


def jump(batch: int, steps: int, stage_step: Optional[int], credit: int) -> ReportDecision:
    """Move a count of `steps` towards `batch`: free up to the stage's count, beyond it on the
    reporter's `credit` (see the module docstring)."""
    free_to = steps if stage_step is None else max(steps, stage_step)
    target = min(batch, free_to + max(0, credit))
    if target <= steps:
        return ReportDecision()
    return ReportDecision(adopt=target, spent=max(0, target - free_to))


def judge_report(batch: int, steps: int, *, joined: bool, window: ReportWindow,
                 stage_step: Optional[int] = None, credit: int = 0) -> ReportDecision:
    """Whether a replica at step count `steps` counts a report of global batch `batch` (not already
    counted, below MAX_COMPLETED_BATCH); `joined`: it has counted a report before; `stage_step`: the
    step count the stage's other replicas announce (their median), if any; `credit`: the reporter's
    here (see the module)."""
    ahead = batch - steps
    near_stage = stage_step is not None and stage_step - window.behind <= batch <= stage_step + window.ahead
    if not joined:
        if stage_step is not None and not near_stage:
            return ReportDecision(refusal=(
                f"completed_batch {batch} is far from the step count {stage_step} this stage's other replicas "
                f"announce; a first report is counted within [{max(0, stage_step - window.behind)}, "
                f"{stage_step + window.ahead}]"))
        if ahead <= window.catch_up:
            return ReportDecision()
        # Alone in its stage, a replica takes its first reporter's count: nothing else tells the epoch.
        return ReportDecision(adopt=batch) if stage_step is None else jump(batch, steps, stage_step, credit)
    if ahead > window.ahead:
        if near_stage and stage_step - steps > window.ahead:  # this replica lags its whole stage
            return jump(batch, steps, stage_step, credit)
        return ReportDecision(refusal=(
            f"completed_batch {batch} is {ahead} batches ahead of this replica's step count {steps}; reports are "
            f"counted within [{max(0, steps - window.behind)}, {steps + window.ahead}] (the last {window.behind} "
            f"to the next {window.ahead} batches)"))
    if batch < steps - window.behind:
        if near_stage and steps - stage_step > window.ahead:  # this replica runs ahead of its whole stage
            return ReportDecision(adopt=batch)
        return ReportDecision(refusal=(
            f"completed_batch {batch} is stale: {steps - batch} batches behind this replica's step count {steps}; "
            f"reports are counted within [{steps - window.behind}, {steps + window.ahead}], and an older one "
            "would step the stage a second time for a batch it has long stepped for"))
    return jump(batch, steps, stage_step, credit) if ahead > window.catch_up else ReportDecision()


class ReportCredits:
    """Each trainer's credit of jump steps at one replica (see the module docstring): earned one per
    report counted, kept up to `cap`, for at most `max_trainers` trainers (the least recently heard
    from is forgotten, so a flood of identities costs memory once)."""

    def __init__(self, cap: int, max_trainers: int = 4096):
        self.cap = cap
        self.max_trainers = max_trainers
        self._credit: OrderedDict[str, int] = OrderedDict()

    def of(self, trainer: str) -> int:
        return self._credit.get(trainer, 0)

    def counted(self, trainer: str, spent: int) -> None:
        """A report of `trainer` was counted, its jump costing `spent`."""
        self._credit[trainer] = min(self.cap, max(0, self.of(trainer) - spent) + 1)
        self._credit.move_to_end(trainer)
        if len(self._credit) > self.max_trainers:
            self._credit.popitem(last=False)


def stage_step(steps: Iterable[int]) -> Optional[int]:
    """What `judge_report` takes as the stage's count: the median step the stage's other replicas
    announce (the lower one of an even count), or None when none does."""
    ordered = sorted(steps)
    return ordered[(len(ordered) - 1) // 2] if ordered else None


def prune_counted(counted: "OrderedDict[int, R]", steps: int, window: ReportWindow) -> None:
    """Forget counted batches that `judge_report` now refuses as stale (they can never count again)."""
    floor = steps - window.behind
    for batch in [b for b in counted if b < floor]:
        del counted[batch]


def check_step_fields(*, microbatches: int, replicas: Optional[int], configured_microbatches: int,
                      window: ReportWindow) -> Optional[str]:
    """Why a Step's `microbatches` / `replicas` (None: a barrier, which has none) are refused, or None."""
    if not 1 <= microbatches <= configured_microbatches:
        return (f"microbatches must be 1..{configured_microbatches} (this run's train.microbatches), "
                f"got {microbatches}")
    if replicas is not None and not 1 <= replicas <= window.max_replicas:
        return f"replicas must be 1..{window.max_replicas} (the stage's replicas a trainer routes to), got {replicas}"
    return None
