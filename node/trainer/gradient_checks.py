"""Self checks: a share of each worker's replies checked against its own held-out answers on the same weights.

Two checks, one mechanism: a worker's input gradients by finite differences along their own
direction (the gradient check), and its outputs by replaying their input (the replay check).

The verifier (node/trainer/verification.py) sees a gradient's marginal statistics and the spot
checks (node/trainer/spot_checks.py) compare activations only; a worker that flips the sign of the
input gradient it returns, scales it or adds noise at its scale keeps every one of them. A gradient
is checkable by its directional derivative, and the trainer holds everything needed: it relayed the
stage's input wire x, the output gradient g_out it sent, and the input gradient g_in the worker
returned. Design choices:

- **The identity.** For a body, g_in = J^T g_out with J the stage's Jacobian at x, so for the unit
  direction d = g_in / |g_in|: <g_out, J d> = <g_in, d> = |g_in|. J d comes from two held-out
  Forwards (`evaluate`: nothing stashed, no gradient) of x + eps d and x - eps d, a central
  difference: J d ~= (f(x + eps d) - f(x - eps d)) / (2 eps), and the ratio
  r = <g_out, J d> / |g_in| is 1 for an honest worker (up to the difference's error and the
  checker's weights drifting from the worker's), -1 for a sign flip, 0.1 for a gradient scaled by
  ten, 10 for one scaled by a tenth, about 0.5 for noise at the gradient's own scale (r =
  <g, g + n> / |g + n|^2). The tail computes its loss and its input gradient g in one Forward and
  reports the very loss it differentiated (a mean cross-entropy, pipeline/stages.py; the replica
  takes `autograd.grad` of it unscaled, node/replica/compute.py), so its held-out Forward with
  labels answers L and r = (L(x + eps d) - L(x - eps d)) / (2 eps |g|), honest value exactly 1: no
  constant to learn. This is the gradient check of numerical optimisation (central differences
  along one direction, Nocedal & Wright, "Numerical Optimization", 2nd ed., section 8.1, "gradient
  checking"), along the one direction a liar cannot hide from: its own answer. The head sends no
  gradient upstream: its outputs are replayed instead (below).
- **The step.** eps = `RELATIVE_STEP` |x| (a share of the frame's norm, not its RMS: d is a unit
  vector over the whole frame, so each element moves by eps / sqrt(n), and a step in RMS units
  would shrink relative to the frame as frames grow). The central difference's error grows as
  eps^2 and its resolution shrinks as eps: on tiny's real traffic, every reply of an honest run
  checked (tests/helpers/attack_swarm.py, share 1), at 1e-3 |x| bodies' ratios stood within 1.2%
  of 1 but tails' strayed now and then (4 of 147 checks beyond 2%, up to 0.71), at 3e-4 |x| one of
  153 tail checks stood 10.6% off, and at 1e-4 |x| all 414 checks of five runs stood within 1.7%
  (tails' median 0.16%, the loss difference against float32's resolution; bodies' within 0.1%). The probes are encoded in fp32 whatever the
  trainer's wire dtype: x is the decoded frame the worker itself received, exact in fp32, and a
  bf16 probe would round eps d (under 2^-8 of an element) away. For the same reason the probes
  ask for full precision (`ForwardRequest.full_precision`): computed in float32 without autocast,
  the body's reply in fp32. A worker computing in bf16 answered an honest tail's probes at r =
  -0.14 under its autocast (tiny, CPU bf16), 0.993 in float32 for the same bf16-computed gradient:
  the gradient's own bf16 rounding moves r by far less than the band. (Full precision means
  float32 matmuls too: the runtime leaves torch's default "highest" float32 matmul precision; at
  TF32's 10-bit mantissa the probes' difference would drown as it does under autocast.) A worker keeping its weights
  in bf16 cannot compute them in float32 without a float32 copy of the stage; its probes come back
  not in full precision and are not judged (counted skipped): such a worker's gradients are the
  verifier's alone.
- **Who probes, and at which weights.** The identity holds at the weights that computed the
  gradient, and the worker itself holds them: its probes are ordinary held-out Forwards to it (it
  cannot tell them from an evaluation, and its training answer is what is compared), and honest
  ratios then stand within 1% of 1 on the same weights. Another replica of the stage would be an independent
  witness, but its weights drifted from the worker's: on tiny at its own learning rate, replicas
  averaged every third step, honest witnessed ratios spread over -0.07..1.42 (a wrong sign
  included), so a witness tells neither noise nor a scale nor even a sign flip from drift. So
  the worker probes its own gradient, when it has two credits free (the two probes go at once).
  Every reply names the version of the weights it ran on (bumped by each optimizer step, averaging
  round or restore); a probe answered on other weights than the gradient's is not judged (counted
  skipped): across a step r moved tenfold on tiny's first steps, and across an averaging round an
  honest tail's r reached 1.32. Probes run as background tasks off the critical path, as spot
  checks do: they never wait for, nor take, a credit the pipeline waits on. A tail is checked at
  its training Forward, a body at its Backward, the head at its Forward.
- **The replay check.** A worker's training answer and its held-out answer to the same input on
  the same weights are the same computation: the trainer holds the training answer (the output it
  relayed, the tail's loss), and the probes answer the rest. A body's two probes average to
  f(x) + O(eps^2) and a tail's to L(x) + O(eps^2), so its gradient check replays its output for
  free; the head has no input wire to move, and its check is one held-out Forward of the same
  tokens. Compared as `output_distance` (the L2 distance over the mean RMS, as spot checks do) or,
  for a loss, |L - L'| / |L|: honest answers stand within numerics (0 in float32 on CPU; a bf16
  training answer against a float32 replay within 1%); noise at the signal's scale stands 1 off, a
  stale reply (the previous microbatch's) further. This is what catches a head that adds noise or
  replays its last answer, which neither the statistics nor, with two replicas, the spot checks
  can name. An output also has its offset measured (`replay_offset`): the difference's mean over
  the frame's tokens, per coordinate, as an RMS over the answer's. Rounding differs from token to
  token and averages away (by the square root of the tokens), while a vector added to every token
  stays whole: a persistent bias of a twentieth of the output's RMS stands on `TOLERANCE` as a
  distance (0.05, passing or failing by rounding) and at 0.05 as an offset, where an honest bf16
  answer's stands near 0.001 (tiny's head and body against float32; 0.003-0.004 as a distance). A replay's measure is the larger of the two in units of its tolerance
  (`OFFSET_TOLERANCE` for the offset); in band at 1 or under. Judged only when the replay ran on
  the weights of the training answer.
- **When.** Not a coin per reply but a countdown per worker: the next check of a worker falls a
  uniformly drawn 1 .. 2/share - 1 of its replies after the last (mean 1/share, drawn from a private
  generator the workers cannot predict), and a check due while its worker has no credit free stays
  due until one is, for as many replies again at most: then it is sent without free credits (a
  worker stating none at every reply, busy or dodging, is still checked; its probes queue behind
  its work, or are refused as any call over its credits is, and the check waits again). A check
  that decides nothing (its probes refused or failed, or answered on weights a step or an
  averaging round after the reply's) is due again at the worker's next reply: on tiny's busy
  two-replica attack runs more than half of the checks sent came back on other weights, and a
  lie of 32 replies went unjudged when each of them counted as done. So a lie told for n replies
  is checked at least once within some 4/share of them where independent coins miss it with
  probability (1 - share)^n. A worker the verifier's statistics put half-way to a flag gets its
  next reply checked at once (`suspicion`, once per rise), as one another check points at does, and
  a reply standing six spreads off its stage's on some statistic is checked itself
  (`ReplyVerifier.outlying`): a liar lying in bursts of four x10 replies kept its CUSUMs under half
  the bar and, in one run of three, every check it got fell on its honest replies.
- **The decision.** A gradient check is out of band when r <= 0, r is not finite, or |log r|
  exceeds log `BAND` (1.25); a replay past its tolerance. A worker is flagged when `FAILURES`
  (2) of its last `RECENT` (6) checks were out of band, and a check out of band puts the worker on
  probation: its next `RECENT` replies that can be judged are all checked, each due at once, credits
  free or not (probes refused, or answered on other weights, decide nothing and leave the reply
  after due). A steady lie fails every check, so it is named on its second reply checked; a lie
  told in bursts (K replies lied, K honest) is named once any check lands in a burst and K < `RECENT`
  (the probation reaches the next burst): with only the next reply checked, a check on a burst's
  last lie was cleared by the honest reply after it, and the on-off liars of the attack table went
  free in two runs of three. One stray failure never flags, and failures older than six checks age
  out. Honest checks on the same
  weights stand within 1% (gradients, replays), but not always: an honest tail checked on every
  reply once measured r = -0.205 beside a 1000-fold input gradient (a spike the trainer's scale
  bound refused), and flagging on one failure, however far, named it. A
  flag takes the verifier's path (`Blame.suspect`): excluded for the rest of the run, counted,
  logged `worker_flagged` with feature `gradient_check` or `replay_check`, reported to the run's
  authorizer.
- **What it costs, what it misses.** Per check two held-out forwards (one at the head; each a
  third of a training microbatch's compute or less) and two input frames sent: at 0.05 some 3% of
  the tail's and bodies' compute, 2% of the head's
  (`agora_trainer_gradient_check_compute_seconds_total`); on tiny with every process on one
  machine's cores, tokens/s at share 0.05 stood within noise of none, at 0.2 at 0.91x, at 1 at
  0.73x (bench/spot_checks.py --check self). The reply checked was relayed already
  when its check completes (off the critical path): what a liar sent before its flag was trained
  on, as with the verifier's warm-up. A worker that recognises its own
  probes (held-out Forwards near a recent training input) could answer them consistently with
  its lie: no other replica's weights stand near enough to the worker's to witness instead (spot
  checks compare held-out answers across replicas at a coarser bar). Under full load a worker
  seldom has two credits free and its checks wait (`..._skipped_total` counts each reply a due
  check waited). A lie that keeps the gradient's component along itself (|g_in|^2 =
  <g_in, J^T g_out>) is invisible along d by construction; a deterministic lie (a scale, a sign, a
  fixed bias), or one remembered per input, told in replays too passes the replay check and is
  the statistics' to catch; fresh noise and a replay of the previous answer fail it even then.

`gradient_ratio`, `tail_ratio`, `probe_inputs`, `replay_measure` and `GradientJudge` are pure (no
socket, no clock); `GradientChecks` schedules, sends and judges on the trainer's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import torch

from agora.dht.records import TRAINING_PHASES
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.spot_checks import output_distance
from agora.node.trainer.stage_client import StageCallError
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.verification import Evidence
from agora.pipeline.codec import WireCodec

__all__ = ["BAND", "FAILURES", "OFFSET_TOLERANCE", "RECENT", "RELATIVE_STEP", "TOLERANCE",
           "GradientCheckEvidence", "GradientJudge", "GradientChecks", "checkable", "Probe", "gradient_ratio",
           "in_band", "probe_inputs", "replay_distance", "replay_measure", "replay_offset", "tail_ratio"]

logger = logging.getLogger("agora.node.trainer")

# eps as a share of the input frame's norm (module docstring: the step).
RELATIVE_STEP = 1e-4
# A gradient check is in band when 1/BAND <= r <= BAND; a replay within TOLERANCE of the training
# answer, its offset within OFFSET_TOLERANCE.
BAND = 1.25
TOLERANCE = 0.05
OFFSET_TOLERANCE = 0.02
# A worker is flagged at FAILURES out of band among its last RECENT checks.
FAILURES = 2
RECENT = 6
# Per check, the honest value and the band's half-width its evidence states.
_HONEST = {"gradient_check": (1.0, math.log(BAND)), "replay_check": (0.0, 1.0)}
_EPSILON = 1e-30
# What a check came to: a verdict, nothing this time (due again at the next reply), nothing to judge.
_JUDGED, _AGAIN, _NEVER = "judged", "again", "never"


def probe_inputs(wire: torch.Tensor, gradient: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """x + eps d, x - eps d and eps, for d the unit direction of `gradient` (module docstring)."""
    wire, gradient = wire.to(torch.float32), gradient.to(torch.float32)
    step = RELATIVE_STEP * float(wire.norm())
    direction = gradient / (gradient.norm() + _EPSILON)
    return wire + step * direction, wire - step * direction, step


def gradient_ratio(output_grad: torch.Tensor, output_plus: torch.Tensor, output_minus: torch.Tensor, step: float,
                   input_grad_norm: float) -> float:
    """A body's r = <g_out, J d> / |g_in|, J d by central difference (module docstring)."""
    difference = output_plus.to(torch.float32) - output_minus.to(torch.float32)
    directional = float((output_grad.to(torch.float32) * difference).sum()) / (2 * step)
    return directional / (input_grad_norm + _EPSILON)


def tail_ratio(loss_plus: float, loss_minus: float, step: float, input_grad_norm: float) -> float:
    """The tail's r = (L(x + eps d) - L(x - eps d)) / (2 eps |g|) (module docstring)."""
    return (loss_plus - loss_minus) / (2 * step * (input_grad_norm + _EPSILON))


def replay_distance(trained: torch.Tensor | float, replayed: torch.Tensor | float) -> float:
    """How far a training answer stands from its replay: `output_distance` for outputs, the relative
    difference for losses (module docstring: the replay check)."""
    if isinstance(trained, torch.Tensor):
        return output_distance(trained, replayed)
    return abs(trained - replayed) / (abs(trained) + _EPSILON)


def replay_offset(trained: torch.Tensor, replayed: torch.Tensor) -> float:
    """The systematic part of an output's replay difference: the RMS over the wire's coordinates of the
    difference's mean over tokens, over the training answer's RMS (module docstring: the replay check)."""
    trained = trained.to(torch.float32)
    mean = (trained - replayed.to(torch.float32)).reshape(-1, trained.shape[-1]).mean(dim=0)
    return float(mean.square().mean().sqrt()) / (float(trained.square().mean().sqrt()) + _EPSILON)


def replay_measure(trained: torch.Tensor | float, replayed: torch.Tensor | float) -> float:
    """A replay's measure in units of its tolerance (in band at 1 or under): the distance, and for an
    output its offset too, whichever stands further."""
    measure = replay_distance(trained, replayed) / TOLERANCE
    if isinstance(trained, torch.Tensor):
        measure = max(measure, replay_offset(trained, replayed) / OFFSET_TOLERANCE)
    return measure if math.isfinite(measure) else math.inf


def checkable(step: float, input_grad_norm: float) -> bool:
    """Whether a gradient has a direction to probe along and its input a size to step by: a zero
    gradient or input (a worker sending zeros) has neither, and leaves its judgement to the verifier."""
    return step > 0 and input_grad_norm > 0 and math.isfinite(step) and math.isfinite(input_grad_norm)


def in_band(ratio: float) -> bool:
    """1/BAND <= r <= BAND (a ratio of the wrong sign, zero or not finite never is)."""
    return ratio > 0 and math.isfinite(ratio) and abs(math.log(ratio)) <= math.log(BAND)


class GradientCheckEvidence(Evidence):
    """Why self checks flagged a worker: `value` the last measure (a ratio, or a replay measure in tolerances),
    `mean` the median of its recent ones, `cusum` its checks out of band among the recent,
    `replies` its replies checked."""

    def describe(self) -> str:
        if self.feature == "replay_check":
            return (f"stage {self.stage} {self.kind}: its training answers failed {int(self.cusum)} of its last "
                    f"{RECENT} replays on the same weights (last at {self.value:.3g} of the tolerance, recent median "
                    f"{self.mean:.3g}; honest within 1: distance {TOLERANCE:g}, offset {OFFSET_TOLERANCE:g}; "
                    f"{self.replies} of its replies checked)")
        return (f"stage {self.stage} {self.kind}: its input gradients failed {int(self.cusum)} of its last "
                f"{RECENT} finite-difference checks (last ratio {self.value:.3g}, recent median {self.mean:.3g}; "
                f"honest 1, band {1 / BAND:.2f}..{BAND:.2f}; "
                f"{self.replies} of its replies checked)")


@dataclass(frozen=True)
class GradientVerdict:
    measure: float  # the ratio, or the replay's measure (in tolerances)
    in_band: bool
    flagged: GradientCheckEvidence | None = None


@dataclass
class _WorkerRecord:
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # (feature, measure, in band)
    checked: int = 0
    smallest: float = math.inf  # gradient ratios' extremes
    largest: float = -math.inf
    farthest: float = -1.0  # the largest replay measure (-1: none replayed)
    failed: int = 0  # checks out of band, in all


class GradientJudge:
    """Per worker: its recent checks, and whether they name it (module docstring: the decision)."""

    def __init__(self) -> None:
        self._workers: dict[str, _WorkerRecord] = {}
        self.flagged: set[str] = set()

    def extremes(self) -> dict[str, tuple[float, float]]:
        """Per worker whose gradients were checked, its smallest and largest ratio (how close honest traffic
        comes to the band)."""
        return {peer: (record.smallest, record.largest) for peer, record in sorted(self._workers.items())
                if record.smallest <= record.largest}

    def passes(self, peer: str) -> int:
        """`peer`'s checks in band, in all (one since a lone worker's excused trip vouches for it:
        node/trainer/lone_worker.py)."""
        record = self._workers.get(peer)
        return 0 if record is None else record.checked - record.failed

    def failures(self) -> dict[str, int]:
        """Per worker checked, its checks out of band in all."""
        return {peer: record.failed for peer, record in sorted(self._workers.items())}

    def farthest_replays(self) -> dict[str, float]:
        """Per worker replayed, the largest measure of a training answer against its replay (in tolerances)."""
        return {peer: record.farthest for peer, record in sorted(self._workers.items()) if record.farthest >= 0}

    def judge(self, stage: int, peer: str, ratio: float) -> GradientVerdict:
        """One gradient check of `peer`, its ratio `ratio`."""
        record = self._workers.setdefault(peer, _WorkerRecord())
        record.smallest, record.largest = min(record.smallest, ratio), max(record.largest, ratio)
        return self._judged(stage, peer, record, ratio, in_band(ratio), "input_grad", "gradient_check")

    def replayed(self, stage: int, peer: str, measure: float, kind: str) -> GradientVerdict:
        """One replay check of `peer`'s `kind` ("output" or "loss"), its `replay_measure`."""
        record = self._workers.setdefault(peer, _WorkerRecord())
        record.farthest = max(record.farthest, measure)
        good = math.isfinite(measure) and measure <= 1.0
        return self._judged(stage, peer, record, measure, good, kind, "replay_check")

    def _judged(self, stage: int, peer: str, record: _WorkerRecord, measure: float, good: bool, kind: str,
                feature: str) -> GradientVerdict:
        record.recent.append((feature, measure, good))
        record.checked += 1
        record.failed += not good
        failures = sum(1 for _, _, ok in record.recent if not ok)
        if failures < FAILURES or peer in self.flagged:
            return GradientVerdict(measure, good)
        self.flagged.add(peer)
        measures = sorted(value for named, value, _ in record.recent if named == feature)
        centre, spread = _HONEST[feature]
        evidence = GradientCheckEvidence(
            stage=stage, kind=kind, peer=peer, feature=feature, direction="high" if measure > centre else "low",
            cusum=float(failures), value=measure, mean=measures[len(measures) // 2], centre=centre, spread=spread,
            replies=record.checked)
        return GradientVerdict(measure, good, evidence)


@dataclass(frozen=True)
class Probe:
    """What one check needs: the stage's input wire x (decoded; None at the head), the gradient returned
    for it (None at the head: a replay only), the output gradient it answered (None: the tail, the head),
    the call's tokens and labels, the version of the worker's weights the gradient was computed on (the
    probes must answer on the same weights), and the training answer to replay (the decoded output, the
    tail's loss; None: none held) with the version of the weights it was computed on."""

    wire: torch.Tensor | None
    input_grad: torch.Tensor | None
    output_grad: torch.Tensor | None
    tokens: torch.Tensor
    targets: torch.Tensor | None
    weights_version: int
    trained: torch.Tensor | float | None = None
    trained_version: int = -1


# (checker, probe id, tokens, encoded probe wire or None, targets) -> the held-out Forward's result
ProbeCall = Callable[[WorkerView, str, torch.Tensor, bytes | None, torch.Tensor | None], Awaitable]


class GradientChecks:
    """Schedules checks of each worker's replies, probes and judges them in the background (module
    docstring). `flag(evidence)` takes the worker it names out of the run."""

    def __init__(self, share: float, stats: TrainerStats, flag: Callable[[GradientCheckEvidence], None],
                 rng: random.Random | None = None):
        self.share, self.stats, self.flag = share, stats, flag
        self.judge = GradientJudge()
        self.rng = rng if rng is not None else random.Random()
        self.probe_codec = WireCodec("fp32")  # module docstring: the step
        self._countdown: dict[str, int] = {}  # per worker: its replies until its next check (0: due)
        self._waited: dict[str, int] = {}  # per worker: replies its due check has waited for free credits
        self._probation: dict[str, int] = {}  # per worker on probation: its replies still to be judged at once
        self._raised: set[str] = set()  # workers another check suspects, already checked at its rise
        self._tasks: set[asyncio.Task] = set()

    def suspected(self, peer: str) -> bool:
        """Whether `peer` failed a check not yet cleared, or was flagged (what its replies fed others is
        then not held against them: node/trainer/verification.py, node/trainer/blame.py)."""
        return peer in self._probation or peer in self.judge.flagged

    def check_now(self, peer: str) -> None:
        """Another check points at `peer` (node/trainer/verification.py: a trip laid on the producer of a
        worker's inputs): it is on probation until its next reply judged, checked credits free or not
        (and suspected meanwhile: what it fed others is not held against them)."""
        if self.share > 0:
            self._probation[peer] = max(1, self._probation.get(peer, 0))
            self._probe_next(peer)

    def suspicion(self, peer: str, raised: bool) -> None:
        """Another check's suspicion of `peer` (the verifier's statistics half-way to a flag) rose or fell:
        on its rise, `peer`'s next reply is checked at once (`check_now`) instead of up to 2/share replies
        later. The verifier needs many replies to name a liar and can be wrong about a stage's outlier;
        a self check settles it on one reply, and honest statistics seldom get half-way, so it costs
        little. Once per rise: a worker that stays suspected is the probation's and the verifier's."""
        if not raised:
            self._raised.discard(peer)
        elif peer not in self._raised:
            self._raised.add(peer)
            self.check_now(peer)

    def probeable(self, probe: "Probe") -> bool:
        """Whether `probe` has anything to send: a replay (the head), or a gradient with a direction to
        step along and an input to step from (`checkable`). Asked before the probes' credits are
        reserved: they are released only by the probes' calls."""
        if probe.input_grad is None:
            return True
        step = RELATIVE_STEP * float(probe.wire.to(torch.float32).norm()) if probe.wire is not None else 0.0
        return checkable(step, float(probe.input_grad.to(torch.float32).norm()))

    def _gap(self) -> int:
        return self.rng.randint(1, max(1, round(2 / self.share) - 1))

    def due(self, peer: str) -> bool:
        """Count one reply of `peer`'s; whether a check of it is due (module docstring: when)."""
        if self.share <= 0:
            return False
        left = self._countdown.get(peer)
        left = (self._gap() if left is None else left) - 1
        self._countdown[peer] = max(0, left)
        return left <= 0

    def checker(self, worker: WorkerView, candidates: list[WorkerView], now: float,
                probes: int = 2) -> WorkerView | None:
        """Who probes (module docstring): the worker itself when it has `probes` credits free, or when
        its check has waited `_overdue()` of its replies already (its next check is then drawn); else
        None (this one stays due, and the wait is counted)."""
        own = [v for v in candidates if v.peer_id == worker.peer_id and v.phase in TRAINING_PHASES
               and v.banned_until <= now and v.paused_until <= now]
        waited = self._waited.get(worker.peer_id, 0)
        if not own or (own[0].in_flight + probes > own[0].credits and waited < self._overdue()):
            self._waited[worker.peer_id] = waited + 1
            self.stats.gradient_check_skipped(worker.stage)
            return None
        self._countdown[worker.peer_id], self._waited[worker.peer_id] = self._gap(), 0
        return own[0]

    def _probe_next(self, peer: str) -> None:
        """`peer` is on probation: its next reply is checked, credits free or not (module docstring)."""
        self._countdown[peer], self._waited[peer] = 0, self._overdue()

    def _judged(self, peer: str, failed: bool) -> None:
        """A check of `peer` reached a verdict: a failure starts its probation over, a pass counts it down."""
        left = RECENT if failed else self._probation.get(peer, 0) - 1
        if left > 0:
            self._probation[peer] = left
            self._probe_next(peer)
        else:
            self._probation.pop(peer, None)

    def _overdue(self) -> int:
        """Replies a due check waits for free credits before it is sent without them: a worker that
        states no free credit at every reply (busy, or dodging) is still checked, its probes queued
        behind its work or refused as any call over its credits would be."""
        return max(1, round(2 / self.share) - 1)

    def launch(self, worker: WorkerView, checker: WorkerView, microbatch_id: str, probe: Probe,
               call: ProbeCall) -> None:
        """Probe `worker`'s reply on `checker` and judge it, in the background."""
        task = asyncio.create_task(self._check(worker, checker, microbatch_id, probe, call))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the checks in flight (each bounded by its calls' deadline)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _check(self, worker: WorkerView, checker: WorkerView, microbatch_id: str, probe: Probe,
                     call: ProbeCall) -> None:
        outcome = await self._probe_and_judge(worker, checker, microbatch_id, probe, call)
        if outcome != _JUDGED and worker.peer_id in self._probation:
            self._probe_next(worker.peer_id)  # refused, or on other weights: the probation's check stays due
        elif outcome == _AGAIN:
            self._countdown[worker.peer_id] = 0  # module docstring: when (a check that decided nothing)

    async def _probe_and_judge(self, worker: WorkerView, checker: WorkerView, microbatch_id: str, probe: Probe,
                               call: ProbeCall) -> str:
        """Probe `worker`'s reply and judge it: `_JUDGED` (a verdict), `_AGAIN` (the probes failed or ran
        on other weights: the next reply may be judged) or `_NEVER` (nothing to judge in this reply, nor
        likely in the next: a zero gradient, probes not in full precision, answers of the wrong kind)."""
        stage = worker.stage
        if probe.input_grad is None:  # the head: its output replayed
            frames, names, step = (None,), ("replay",), 0.0
        else:
            plus, minus, step = probe_inputs(probe.wire, probe.input_grad)
            if not checkable(step, float(probe.input_grad.to(torch.float32).norm())):
                self.stats.gradient_check_skipped(stage)  # no direction to probe along: the verifier judges zeros
                return _NEVER
            frames, names = (self.probe_codec.encode(plus), self.probe_codec.encode(minus)), ("grad-plus", "grad-minus")
        answers = await asyncio.gather(
            *(call(checker, f"{microbatch_id}.{name}", probe.tokens, frame, probe.targets)
              for name, frame in zip(names, frames)), return_exceptions=True)
        failed = [answer for answer in answers if isinstance(answer, BaseException)]
        if failed:
            if not all(isinstance(error, StageCallError) for error in failed):
                raise failed[0]
            logger.debug("check of stage %d on %s failed: %s", stage, checker.endpoint, failed[0])
            return _AGAIN
        self.stats.gradient_check(stage, sum(answer.compute_s for answer in answers))
        if not all(answer.full_precision for answer in answers):
            self.stats.gradient_check_skipped(stage)  # module docstring: the step (full precision)
            return _NEVER
        verdicts = []
        moved = any(a.weights_version not in (probe.weights_version, probe.trained_version) for a in answers)
        if probe.input_grad is not None and all(a.weights_version == probe.weights_version for a in answers):
            ratio = self._ratio(probe, answers, step)
            if ratio is not None:
                verdicts.append(("ratio", self.judge.judge(stage, worker.peer_id, ratio)))
        if probe.trained is not None and all(a.weights_version == probe.trained_version for a in answers):
            measure = self._replay(probe, answers)
            if measure is not None:
                kind = "output" if isinstance(probe.trained, torch.Tensor) else "loss"
                verdicts.append(("replay measure", self.judge.replayed(stage, worker.peer_id, measure, kind)))
        if not verdicts:
            self.stats.gradient_check_skipped(stage)  # module docstring: the same weights
            return _AGAIN if moved else _NEVER
        self._judged(worker.peer_id, failed=not all(verdict.in_band for _, verdict in verdicts))
        for measure, verdict in verdicts:
            if not verdict.in_band:
                self.stats.gradient_check_failed(stage)
                logger.info("stage %d check of %s on %s: %s %.3g out of band", stage, worker.endpoint,
                            checker.endpoint, measure, verdict.measure,
                            extra={"milestone": "gradient_check_failed",
                                   "fields": {"stage": stage, "peer": worker.peer_id, "checker": checker.peer_id,
                                              measure.replace(" ", "_"): verdict.measure}})
            if verdict.flagged is not None:
                self.flag(verdict.flagged)
        return _JUDGED

    def _ratio(self, probe: Probe, answers: list, step: float) -> float | None:
        """r from the two held-out answers (None: an answer of the wrong kind or shape, nothing judged)."""
        norm = float(probe.input_grad.to(torch.float32).norm())
        if probe.output_grad is None:
            if any(answer.loss is None for answer in answers):
                return None
            return tail_ratio(float(answers[0].loss), float(answers[1].loss), step, norm)
        outputs = [answer.wire for answer in answers]
        if any(output is None or output.shape != probe.output_grad.shape for output in outputs):
            return None
        return gradient_ratio(probe.output_grad, outputs[0], outputs[1], step, norm)

    def _replay(self, probe: Probe, answers: list) -> float | None:
        """The training answer's `replay_measure` against the probes' mean (the replay itself at the head;
        None: an answer of the wrong kind or shape)."""
        if not isinstance(probe.trained, torch.Tensor):
            if any(answer.loss is None for answer in answers):
                return None
            return replay_measure(float(probe.trained), sum(float(a.loss) for a in answers) / len(answers))
        outputs = [answer.wire for answer in answers]
        if any(output is None or output.shape != probe.trained.shape for output in outputs):
            return None
        return replay_measure(probe.trained, sum(o.to(torch.float32) for o in outputs) / len(outputs))
