"""Spot checks: a share of microbatches' Forwards also asked of a second replica, and the answers compared.

The statistical verifier (node/trainer/verification.py) holds each reply's marginal statistics to
its stage's. Some lies keep every one of them: a head replaying an earlier reply (a head's Forward
has no request frame to align with), a head answering for other rows of the batch, a worker
lying from its first reply when the reference is its own history. Another replica of the stage
computing the same Forward tells them apart at once. Design choices:

- **The duplicate is a held-out Forward** (`evaluate`: the same tokens and input wire, no
  gradient, nothing stashed, no unit check): it leaves no state that a later Backward, Step or
  Abort would apply or have to take back, needs no proto field, and costs the second replica one
  forward without autograd (a third of a training microbatch's compute or less). A worker can tell
  it from a training Forward (the flag is on the wire), and can answer it honestly while it lies
  in training: that is the reply checked, so it does not help the liar; lying in checks only
  makes it disagree with more honest replicas.
- **Off the critical path.** The primary's reply is relayed at once; the duplicate runs as a
  background task. It is sent only when another routable replica of the stage has a credit free
  now (taken like any call's, released when it returns), else skipped and counted: a spot check
  never waits for, nor takes, a credit the pipeline is waiting on. Sampling is per head or body
  Forward of a training microbatch, with probability `share` from a private random generator the
  workers cannot predict. The tail is not checked: its held-out Forward answers a loss, and what
  a tail could lie about is its input gradient, which the verifier aligns with its input and the
  gradient checks (node/trainer/gradient_checks.py) probe along its own direction.
- **What counts as a disagreement.** `output_distance`: the two outputs' L2 distance over their
  mean RMS (0 equal, 2 opposite; symmetric). Replicas of a stage differ honestly because
  asynchronous averaging leaves their weights apart, so each stage keeps the distances of its
  last `window` agreeing checks, and a distance is a disagreement when it passes
  `median + SPREADS * spread` of them (4 spreads), the spread 1.4826 MAD floored at half the
  median (the drift of a scale is relative), and never below `tolerance`. Disagreements stay out
  of the reference, so a liar in many pairs cannot lift the bar it is held to. On tiny, two body
  replicas averaged every third step stand 0 apart just after a round and 0.02 to 0.07 between
  rounds (0.2 over the first steps); two head replicas (an embedding of std 0.02, which each
  replica's Adam moves on its own tokens) averaged every other step up to 0.5 at tiny's learning
  rate over the first steps, 0.1 to 0.25 at a quarter of it. A replayed or row-shuffled head
  output stands 0.35 to 1.4 off, a x1.2 scale 0.18. So the default tolerance, 0.25, keeps
  settled honest drift below the bar and catches replays and content lies; a small bias is the
  verifier's to catch, and bursts of drift past the bar are left to the blame rule. Replicas never
  averaged drift as far apart as a lie within a dozen of tiny's steps: no comparison tells them
  apart then.
- **Whom to blame.** A disagreement says one of two answers is wrong, not which. What a check
  judges is the primary's training reply; the checker's held-out answer is the witness. Over a
  stage's last `window` checks (`case_against`), a worker is flagged when (1) `MIN_CHECKED` (16)
  of its replies were checked and they disagreed at least `MAJORITY` (4) times as often as they
  agreed; (2) its share of disagreements is at least `MAJORITY` times that of the checks of the
  stage's other replies by other checkers (`MIN_OTHERS`, 8, of them at least): else the stage
  drifts as a whole (its first steps, between averaging rounds: every pair then stands past the
  bar now and then, a liar's only its own); and (3) `PARTNERS` (2) of the checkers its replies
  disagreed with are vouched for, each having agreed with another worker's reply. A lone liar
  among three or more replicas meets all three; an honest worker's replies disagree only with
  lying witnesses, which vouch for no one unless liars collude, or with everyone's during drift,
  which (2) sets aside. A liar answering checks honestly gains nothing: its training replies are
  what is judged. Liars that also lie in their checks raise the others' share of disagreements:
  two such of four replicas may hide each other (naming no one). With exactly two replicas nobody
  can be named (no third worker's replies to compare the share with, no witness to vouch for):
  disagreements are counted and logged (`spot_check_disagreement`) and a flag waits for a third
  replica. Colluding liars making up half a stage's replicas can name an honest one, as in robust
  averaging. Checking at a share s, a liar with 1/R of a stage's Forwards is named after some
  16 R / s of them: at 0.02 and three replicas, some 2,400 of the stage's Forwards.
- A flagged worker takes the verifier's path (`Blame.suspect`): excluded for the rest of the run,
  counted in `agora_trainer_flagged_workers_total` and logged `worker_flagged` with this module's
  evidence. The primary reply was relayed already (the check is off the critical path); what the
  liar sent before its flag was trained on, as with the verifier's warm-up.
- Cost, per checked Forward: one more forward on another replica (`agora_trainer_spot_checks_total`,
  its compute in `agora_trainer_spot_check_compute_seconds_total`), the input frame sent twice, and
  two decodes here. At `share` s, s of each checked stage's training Forwards run again without
  autograd: with a Forward a third of a microbatch's compute or less, 2% costs under 1% of those
  stages' compute. The duplicate counts in the checker's call times like any call (routing's
  estimate of it, the trainer's time split). bench/spot_checks.py puts tokens/s side by side.

`SpotJudge` is pure (no socket, no clock, no torch beyond `output_distance`); `SpotChecks` samples,
sends and compares on the trainer's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import torch

from agora.dht.records import TRAINING_PHASES
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.stage_client import StageCallError
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.verification import Evidence
from agora.pipeline.codec import WireCodec

__all__ = ["SPREADS", "PARTNERS", "MAJORITY", "MIN_CHECKED", "MIN_OTHERS", "SpotCheckEvidence", "SpotVerdict", "SpotJudge", "SpotChecks", "Check", "case_against", "output_distance"]

logger = logging.getLogger("agora.node.trainer")

# A distance this many spreads above the median of a stage's recent agreeing checks is a disagreement.
SPREADS = 4.0
# Whom the checks name (module docstring, `case_against`): vouched checkers a worker's replies must
# have disagreed with; how many times its disagreements must outnumber its agreements, and its share
# of disagreements the share among the stage's other checks; its replies checked, and the others'
# checks, before anything is decided (honest drift comes in bursts a few checks can all fall in).
PARTNERS = 2
MAJORITY = 4
MIN_CHECKED = 16
MIN_OTHERS = 8
# The spread of the agreeing distances is at least this share of their median.
_RELATIVE_SPREAD_FLOOR = 0.5
_MAD_TO_SIGMA = 1.4826
_EPSILON = 1e-30


def output_distance(first: torch.Tensor, second: torch.Tensor) -> float:
    """The L2 distance between two outputs over their mean RMS: 0 when equal, 2 when opposite."""
    first, second = first.to(torch.float32), second.to(torch.float32)
    mean_square = (first.square().sum() + second.square().sum()) / 2
    return float((first - second).norm() / (mean_square.sqrt() + _EPSILON))


class SpotCheckEvidence(Evidence):
    """Why spot checks flagged a worker: `cusum` holds the witnesses its replies disagreed with, `value`
    the last distance, `mean` its disagreements' median, `centre` and `spread` the stage's reference
    and bar, `replies` its replies checked."""

    def describe(self) -> str:
        return (f"stage {self.stage} {self.kind}: its Forwards disagreed on spot checks with {int(self.cusum)} replicas "
                f"that agree with others (last distance {self.value:.3g}, its median {self.mean:.3g}; the stage's "
                f"agreeing checks {self.centre:.3g}, bar {self.spread:.3g}; {self.replies} of its replies checked)")


@dataclass(frozen=True)
class SpotVerdict:
    agreed: bool
    distance: float
    bar: float
    flagged: SpotCheckEvidence | None = None  # a worker the checks now name (module docstring)


@dataclass(frozen=True)
class Check:
    """One spot check: `primary`'s training reply against `checker`'s held-out answer."""

    primary: str
    checker: str
    agreed: bool
    distance: float


@dataclass
class _StageRecord:
    distances: deque  # the recent agreeing distances: the reference
    checks: deque  # the recent checks: whom they name
    flagged: set[str] = field(default_factory=set)


class SpotJudge:
    """Per stage: the reference of honest disagreement and whose replies disagreed with whose answers
    (module docstring)."""

    def __init__(self, tolerance: float, window: int = 96):
        if not 0 < tolerance <= 2:
            raise ValueError(f"tolerance must lie in (0, 2], got {tolerance}")
        self.tolerance = tolerance
        self._window = window
        self._stages: dict[int, _StageRecord] = {}

    def _record(self, stage: int) -> _StageRecord:
        if stage not in self._stages:
            self._stages[stage] = _StageRecord(deque(maxlen=self._window), deque(maxlen=self._window))
        return self._stages[stage]

    def reference(self, stage: int) -> tuple[float, float]:
        """The median of the stage's recent agreeing distances (0 before any) and the bar above it."""
        values = list(self._record(stage).distances)
        if not values:
            return 0.0, self.tolerance
        middle = statistics.median(values)
        spread = max(_MAD_TO_SIGMA * statistics.median(abs(value - middle) for value in values),
                     _RELATIVE_SPREAD_FLOOR * middle)
        return middle, max(self.tolerance, middle + SPREADS * spread)

    def compare(self, stage: int, primary: str, checker: str, distance: float) -> SpotVerdict:
        """One spot check: `primary`'s training reply against `checker`'s held-out answer, `distance` apart."""
        record = self._record(stage)
        centre, bar = self.reference(stage)
        agreed = distance <= bar
        if agreed:
            record.distances.append(distance)
        record.checks.append(Check(primary, checker, agreed, distance))
        return SpotVerdict(agreed, distance, bar, self._named(stage, record, distance, centre, bar))

    def _named(self, stage: int, record: _StageRecord, distance: float, centre: float,
               bar: float) -> SpotCheckEvidence | None:
        """A worker the checks name now (a new agreement can complete a case as well as a new
        disagreement: every worker checked is looked at; at most one named per check)."""
        checks = [check for check in record.checks
                  if check.primary not in record.flagged and check.checker not in record.flagged]
        for peer in sorted({check.primary for check in checks}):
            witnesses = case_against(peer, checks)
            if witnesses is not None:
                record.flagged.add(peer)
                mine = [check for check in checks if check.primary == peer]
                return SpotCheckEvidence(
                    stage=stage, kind="output", peer=peer, feature="spot_check", direction="high",
                    cusum=float(len(witnesses)), value=distance,
                    mean=statistics.median(check.distance for check in mine if not check.agreed),
                    centre=centre, spread=bar, replies=len(mine))
        return None


def case_against(peer: str, checks: list[Check]) -> set[str] | None:
    """The witnesses that name `peer` on these checks, or None (module docstring: whom to blame)."""
    mine = [check for check in checks if check.primary == peer]
    refuted = [check for check in mine if not check.agreed]
    if len(mine) < MIN_CHECKED or len(refuted) < MAJORITY * (len(mine) - len(refuted)):
        return None
    others = [check for check in checks if peer not in (check.primary, check.checker)]
    others_refuted = sum(1 for check in others if not check.agreed)
    if len(others) < MIN_OTHERS or len(refuted) * len(others) < MAJORITY * others_refuted * len(mine):
        return None  # the stage's other replies disagree nearly as often: its drift, not this worker
    vouched = {check.checker for check in others if check.agreed}
    witnesses = {check.checker for check in refuted} & vouched
    return witnesses if len(witnesses) >= PARTNERS else None


class SpotChecks:
    """Samples Forwards to check, judges each duplicate's answer in the background (module docstring).

    `flag(evidence)` takes the worker it names out of the run (it may be
    one that took no part in the check that completed the case against it)."""

    def __init__(self, share: float, judge: SpotJudge, codec: WireCodec, stats: TrainerStats,
                 flag: Callable[[SpotCheckEvidence], None], rng: random.Random | None = None):
        self.share, self.judge, self.codec, self.stats, self.flag = share, judge, codec, stats, flag
        self.rng = rng if rng is not None else random.Random()
        self._tasks: set[asyncio.Task] = set()

    def checker(self, primary: WorkerView, candidates: list[WorkerView], now: float) -> WorkerView | None:
        """Whether to check this Forward, and on which replica: None when not sampled or none is free."""
        if self.share <= 0 or self.rng.random() >= self.share:
            return None
        others = [v for v in candidates if v.peer_id != primary.peer_id and v.phase in TRAINING_PHASES
                  and v.banned_until <= now]
        if not others:
            return None
        free = [v for v in others if v.has_credit(now)]
        if not free:
            self.stats.spot_check_skipped(primary.stage)
            return None
        return self.rng.choice(free)

    def launch(self, primary: WorkerView, checker: WorkerView, output: bytes | memoryview,
               duplicate: Awaitable) -> None:
        """Judge `primary`'s `output` against `checker`'s answer to `duplicate`, in the background."""
        task = asyncio.create_task(self._judge(primary, checker, output, duplicate))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the checks in flight (each bounded by its call's deadline)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _judge(self, primary: WorkerView, checker: WorkerView, output: bytes | memoryview,
                     duplicate: Awaitable) -> None:
        stage = primary.stage
        try:
            answer = await duplicate
        except StageCallError as error:  # the checker's failure, counted by the trainer's bookkeeping
            logger.debug("spot check of stage %d on %s failed: %s", stage, checker.endpoint, error)
            return
        self.stats.spot_check(stage, answer.compute_s)
        mine, theirs = self.codec.decode(output), answer.wire
        if theirs is None or theirs.shape != mine.shape:
            return
        verdict = self.judge.compare(stage, primary.peer_id, checker.peer_id, output_distance(mine, theirs))
        if not verdict.agreed:
            self.stats.spot_check_disagreement(stage)
            logger.info("stage %d spot check: %s and %s disagree (distance %.3g, bar %.3g)", stage, primary.endpoint,
                        checker.endpoint, verdict.distance, verdict.bar,
                        extra={"milestone": "spot_check_disagreement",
                               "fields": {"stage": stage, "primary": primary.peer_id, "checker": checker.peer_id,
                                          "distance": verdict.distance, "bar": verdict.bar}})
        if verdict.flagged is not None:
            self.flag(verdict.flagged)
