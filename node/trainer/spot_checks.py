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
  rounds (0.2 over the first steps, before averaging pulled them together); a replayed or
  row-shuffled head output stands 0.35 to 1.3 off, x1.2 at 0.18. So the default tolerance of 0.25
  leaves honest drift far below the bar and catches replays and content lies; a small bias (a
  scale of 1.2) is the verifier's, not this check's. Disagreements stay out of the window, so a
  liar in many pairs cannot lift the bar it is held to.
- **Whom to blame.** A disagreement says one of two replicas is wrong, not which. A worker is
  flagged when it disagreed with two partners that agreed with each other on a spot check of
  their own: two witnesses who vouch for each other against it. A lone liar among three or more
  replicas disagrees with every honest partner, and honest ones agree with each other; an honest
  worker disagrees only with liars, which do not agree with each other unless they collude (a
  liar answering checks honestly still disagrees with every partner that checked its training
  replies). With exactly two replicas nobody can be named: their disagreements are counted and
  logged (`spot_check_disagreement`), and a flag waits for a third replica. Colluding liars making
  up half a stage's replicas can name an honest one, as in robust averaging.
- A flagged worker takes the verifier's path (`Blame.suspect`): excluded for the rest of the run,
  counted in `agora_trainer_flagged_workers_total` and logged `worker_flagged` with this module's
  evidence. The primary reply was relayed already (the check is off the critical path); what the
  liar sent before its flag was trained on, as with the verifier's warm-up.
- Cost, per checked Forward: one more forward on another replica (`agora_trainer_spot_checks_total`,
  its compute in `agora_trainer_spot_check_compute_seconds_total`), the input frame sent twice, and
  two decodes here. At `share` s over a pipeline of S stages with replicas, about s * (S - 1) / S of
  one stage's forward compute per microbatch, spread over the replicas: 2% costs well under 1%.

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
from typing import Awaitable, Callable, Iterable

import torch

from agora.dht.records import TRAINING_PHASES
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.stage_client import StageCallError
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.verification import Evidence
from agora.pipeline.codec import WireCodec

__all__ = ["SPREADS", "PARTNERS", "SpotCheckEvidence", "SpotVerdict", "SpotJudge", "SpotChecks", "output_distance"]

logger = logging.getLogger("agora.node.trainer")

# A distance this many spreads above the median of a stage's recent agreeing checks is a disagreement.
SPREADS = 6.0
# Partners, agreeing with each other, a worker must have disagreed with before it is flagged.
PARTNERS = 2
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
    """Why a spot check flagged a worker: the partners it disagreed with (agreeing with each other)."""

    def describe(self) -> str:
        return (f"stage {self.stage} {self.kind}: its Forward disagreed on spot checks with {int(self.cusum)} replicas "
                f"that agree with each other (last distance {self.value:.3g}, its median {self.mean:.3g}; the stage's "
                f"agreeing checks {self.centre:.3g}, bar {self.spread:.3g}, after {self.replies} checks)")


@dataclass(frozen=True)
class SpotVerdict:
    agreed: bool
    distance: float
    bar: float
    flagged: SpotCheckEvidence | None = None  # a worker the checks now name (module docstring)


@dataclass
class _StageRecord:
    window: deque
    agreed_pairs: set[frozenset] = field(default_factory=set)
    disagreed: dict[str, set[str]] = field(default_factory=dict)  # worker -> partners it disagreed with
    distances: dict[str, list[float]] = field(default_factory=dict)  # worker -> its disagreements' distances
    checks: dict[str, int] = field(default_factory=dict)  # worker -> spot checks it took part in
    flagged: set[str] = field(default_factory=set)


class SpotJudge:
    """Per stage: the reference of honest disagreement and who disagreed with whom (module docstring)."""

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
        """One spot check of `primary`'s reply against `checker`'s answer, `distance` apart."""
        record = self._record(stage)
        centre, bar = self.reference(stage)
        for peer in (primary, checker):
            record.checks[peer] = record.checks.get(peer, 0) + 1
        if distance <= bar:
            record.window.append(distance)
            record.agreed_pairs.add(frozenset((primary, checker)))
            return SpotVerdict(True, distance, bar, self._named(stage, record, primary, checker, distance, centre, bar))
        for peer, partner in ((primary, checker), (checker, primary)):
            record.disagreed.setdefault(peer, set()).add(partner)
            record.distances.setdefault(peer, []).append(distance)
        return SpotVerdict(False, distance, bar, self._named(stage, record, primary, checker, distance, centre, bar))

    def _named(self, stage: int, record: _StageRecord, primary: str, checker: str, distance: float, centre: float,
               bar: float) -> SpotCheckEvidence | None:
        """A worker the checks name now: a new agreement can vouch for two witnesses as well as a new
        disagreement add one (the first found, at most one per check)."""
        for peer in self._candidates(record, primary, checker):
            witnesses = vouched_witnesses(record.disagreed.get(peer, set()), record.agreed_pairs)
            if len(witnesses) >= PARTNERS:
                record.flagged.add(peer)
                return SpotCheckEvidence(
                    stage=stage, kind="output", peer=peer, feature="spot_check", direction="high",
                    cusum=float(len(witnesses)), value=distance, mean=statistics.median(record.distances[peer]),
                    centre=centre, spread=bar, replies=record.checks.get(peer, 0))
        return None

    @staticmethod
    def _candidates(record: _StageRecord, primary: str, checker: str) -> Iterable[str]:
        touched = {primary, checker}
        # A new agreement between two witnesses may complete the case against any worker they disagreed with.
        touched |= {peer for peer, partners in record.disagreed.items() if partners & {primary, checker}}
        return sorted(peer for peer in touched if peer not in record.flagged and peer in record.disagreed)


def vouched_witnesses(partners: set[str], agreed_pairs: set[frozenset]) -> set[str]:
    """The partners a worker disagreed with that agreed with another of them on a check of their own."""
    return {partner for partner in partners
            if any(frozenset((partner, other)) in agreed_pairs for other in partners if other != partner)}


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
