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
  a tail could lie about is its input gradient, which the verifier aligns with its input.
- **What counts as a disagreement.** `output_distance`: the two outputs' L2 distance over their
  mean RMS (0 equal, 2 opposite; symmetric). Replicas of a stage differ honestly because
  asynchronous averaging leaves their weights apart, so each stage keeps the distances of its
  recent agreeing checks (`window`), and a distance is a disagreement when it passes
  `median + SPREADS * spread` of them, the spread 1.4826 MAD floored at half the median (the
  drift of a scale is relative), and never below `tolerance`. On tiny with two body replicas
  averaged every third step, honest distances are 0 just after a round and 0.02 to 0.07 between
  rounds (0.2 over the first steps, before averaging pulled them together); head replicas (an
  embedding, which each replica's Adam moves on its own tokens) averaged every other step stand up
  to 0.5 apart over the first steps and 0.15 to 0.25 later. A replayed or row-shuffled head output
  stands 0.35 to 1.3 off, a x1.2 scale 0.18. So the default tolerance of 0.25 keeps settled honest
  drift below the bar and catches replays and content lies; a small bias is the verifier's, not
  this check's, and the bursts of early drift past the bar are left to the blame rule. Replicas
  never averaged drift as far apart as a lie within a dozen of tiny's steps: then no comparison
  tells them apart. Disagreements stay out of the window, so a liar in many pairs cannot lift the
  bar it is held to.
- **Whom to blame.** A disagreement says one of two answers is wrong, not which. What a check
  judges is the primary's training reply; the checker's held-out answer is the witness. A witness
  counts against a worker once its own answers agreed with another worker's training reply. A
  worker is flagged when its replies disagreed with `PARTNERS` (2) such witnesses, its
  disagreements number at least `MAJORITY` (2) times its agreements, and `MIN_CHECKED` (8) of its
  replies were checked. A lone liar among three or more replicas disagrees with every honest checker, and honest checkers agree with each other's
  replies; an honest worker's replies disagree only with lying witnesses, which vouch for no one
  unless liars collude, and, while honest drift jumps past the bar (a stage's first steps, the
  steps between averaging rounds), only now and then, far from a majority. A liar answering checks honestly gains
  nothing: its training replies are what is judged. With exactly two replicas nobody can be
  named (a witness needs a third worker to vouch for it): disagreements are counted and logged
  (`spot_check_disagreement`) and a flag waits for a third replica. Colluding liars making up
  half a stage's replicas can name an honest one, as in robust averaging.
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

__all__ = ["SPREADS", "PARTNERS", "MAJORITY", "MIN_CHECKED", "SpotCheckEvidence", "SpotVerdict", "SpotJudge", "SpotChecks", "output_distance", "valid_witnesses"]

logger = logging.getLogger("agora.node.trainer")

# A distance this many spreads above the median of a stage's recent agreeing checks is a disagreement.
SPREADS = 6.0
# Checkers, each vouched for by an agreement with another worker, a worker's replies must have
# disagreed with before it is flagged; and its disagreements must be at least MAJORITY times its
# agreements (an honest replica's rare disagreement, while the stage's drift jumps, names no one).
PARTNERS = 2
MAJORITY = 2
# Replies of a worker checked before it can be named: honest drift jumps in bursts (a stage's first
# steps, the steps between averaging rounds), and a handful of checks can all fall in one.
MIN_CHECKED = 8
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


@dataclass
class _StageRecord:
    window: deque
    # Per primary: the checkers its training replies disagreed with, its agreements and disagreements,
    # and the distances of the latter; per checker: the primaries its held-out answers agreed with.
    accusers: dict[str, set[str]] = field(default_factory=dict)
    agreed: dict[str, int] = field(default_factory=dict)
    disagreed: dict[str, list[float]] = field(default_factory=dict)
    vouched: dict[str, set[str]] = field(default_factory=dict)
    flagged: set[str] = field(default_factory=set)


class SpotJudge:
    """Per stage: the reference of honest disagreement and whose replies disagreed with whose answers
    (module docstring)."""

    def __init__(self, tolerance: float, window: int = 64):
        if not 0 < tolerance <= 2:
            raise ValueError(f"tolerance must lie in (0, 2], got {tolerance}")
        self.tolerance = tolerance
        self._window = window
        self._stages: dict[int, _StageRecord] = {}

    def _record(self, stage: int) -> _StageRecord:
        if stage not in self._stages:
            self._stages[stage] = _StageRecord(deque(maxlen=self._window))
        return self._stages[stage]

    def reference(self, stage: int) -> tuple[float, float]:
        """The median of the stage's recent agreeing distances (0 before any) and the bar above it."""
        values = list(self._record(stage).window)
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
            record.window.append(distance)
            record.agreed[primary] = record.agreed.get(primary, 0) + 1
            record.vouched.setdefault(checker, set()).add(primary)
        else:
            record.accusers.setdefault(primary, set()).add(checker)
            record.disagreed.setdefault(primary, []).append(distance)
        return SpotVerdict(agreed, distance, bar, self._named(stage, record, distance, centre, bar))

    def _named(self, stage: int, record: _StageRecord, distance: float, centre: float,
               bar: float) -> SpotCheckEvidence | None:
        """A worker the checks name now (a new agreement can complete a case as well as a new
        disagreement: every accused worker is looked at; at most one named per check)."""
        for peer in sorted(set(record.accusers) - record.flagged):
            witnesses = valid_witnesses(peer, record.accusers[peer], record.vouched)
            disagreements, agreements = record.disagreed[peer], record.agreed.get(peer, 0)
            if (len(witnesses) >= PARTNERS and len(disagreements) >= MAJORITY * agreements
                    and len(disagreements) + agreements >= MIN_CHECKED):
                record.flagged.add(peer)
                return SpotCheckEvidence(
                    stage=stage, kind="output", peer=peer, feature="spot_check", direction="high",
                    cusum=float(len(witnesses)), value=distance, mean=statistics.median(disagreements),
                    centre=centre, spread=bar, replies=len(disagreements) + record.agreed.get(peer, 0))
        return None


def valid_witnesses(accused: str, accusers: set[str], vouched: dict[str, set[str]]) -> set[str]:
    """The checkers whose answers disagreed with `accused`'s replies and agreed with another worker's."""
    return {checker for checker in accusers if vouched.get(checker, set()) - {accused}}


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
