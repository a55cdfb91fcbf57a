"""Gradient checks: a share of the input gradients workers return, checked by finite differences.

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
  gradient upstream: nothing to check there.
- **The step.** eps = `RELATIVE_STEP` |x| (a share of the frame's norm, not its RMS: d is a unit
  vector over the whole frame, so each element moves by eps / sqrt(n), and a step in RMS units
  would shrink relative to the frame as frames grow). The central difference's error grows as
  eps^2: on tiny's real traffic at 1e-2 |x| honest self-probed ratios strayed to 0.83 and 1.34
  (a trained stage bends within 1% of its input), at 1e-3 |x| they stand within 0.977..1.011,
  and the tail's loss difference is still far above float32's resolution (at 1e-2 of the RMS on a
  1024-element frame it is not: r off by 1e-3). The probes are encoded in fp32 whatever the
  trainer's wire dtype: x is the decoded frame the worker itself received, exact in fp32, and a
  bf16 probe would round eps d (under 2^-8 of an element) away. For the same reason the probes
  ask for full precision (`ForwardRequest.full_precision`): computed in float32 without autocast,
  the body's reply in fp32. A worker computing in bf16 answered an honest tail's probes at r =
  0.52 under its autocast (tiny, CPU bf16), 1.000 in float32 for the same bf16-computed gradient:
  the gradient's own bf16 rounding moves r by far less than the band. A worker keeping its weights
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
  the worker probes its own gradient, when it has two credits free (the two probes go at once);
  else the check is skipped and counted. Every reply names the version of the weights it ran on
  (bumped by each optimizer step, averaging round or restore); a probe answered on other weights
  than the gradient's is not judged (counted skipped): across a step r moved tenfold on tiny's first
  steps, and across an averaging round an honest tail's r reached 1.32. Probes run as background tasks off the critical path, as spot checks do: they never
  wait for, nor take, a credit the pipeline waits on. Sampling is per tail Forward and per body
  Backward of a training microbatch, with probability `share`, from a private generator.
- **The decision.** A check is out of band when r <= 0, r is not finite, or |log r| exceeds
  log `BAND` (1.25). A worker is flagged when `FAILURES` (2) of its last `RECENT` (6) checks were out of
  band: one stray check (a loss spike) never flags, a lie that
  shows in every check is named on its second, and failures older than six checks age out. With
  honest self-probes within 1% of 1 and the weakest lie here (noise at the gradient's scale) at
  0.5, the band has room on both sides. A flag takes the verifier's path (`Blame.suspect`):
  excluded for the rest of the run, counted, logged `worker_flagged` with feature
  `gradient_check`, reported to the run's authorizer.
- **What it costs, what it misses.** Per check two held-out forwards (each a third of a training
  microbatch's compute or less) and two input frames sent: at 0.05 some 3% of the tail's and
  bodies' compute (`agora_trainer_gradient_check_compute_seconds_total`). The gradient checked
  was relayed already when its check completes (off the critical path): what a liar sent before
  its flag was trained on, as with the verifier's warm-up. A worker that recognises its own
  probes (held-out Forwards near a recent training input) could answer them consistently with
  its lie: no other replica's weights stand near enough to the worker's to witness instead (spot
  checks compare held-out answers across replicas at a coarser bar). Under full load a worker
  seldom has two credits free and its checks are skipped (`..._skipped_total` says how many).
  A lie that keeps the gradient's
  component along itself (|g_in|^2 = <g_in, J^T g_out>) is invisible along d by construction.

`gradient_ratio`, `tail_ratio`, `probe_inputs` and `GradientJudge` are pure (no socket, no clock);
`GradientChecks` samples, sends and judges on the trainer's event loop.
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
from agora.node.trainer.stage_client import StageCallError
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.verification import Evidence
from agora.pipeline.codec import WireCodec

__all__ = ["BAND", "FAILURES", "RECENT", "RELATIVE_STEP", "GradientCheckEvidence", "GradientJudge", "GradientChecks", "checkable",
           "Probe", "gradient_ratio", "in_band", "probe_inputs", "tail_ratio"]

logger = logging.getLogger("agora.node.trainer")

# eps as a share of the input frame's norm (module docstring: the step).
RELATIVE_STEP = 1e-3
# A check is in band when 1/BAND <= r <= BAND; a worker is flagged at FAILURES out of band among its last RECENT.
BAND = 1.25
FAILURES = 2
RECENT = 6
_EPSILON = 1e-30


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


def checkable(step: float, input_grad_norm: float) -> bool:
    """Whether a gradient has a direction to probe along and its input a size to step by: a zero
    gradient or input (a worker sending zeros) has neither, and leaves its judgement to the verifier."""
    return step > 0 and input_grad_norm > 0 and math.isfinite(step) and math.isfinite(input_grad_norm)


def in_band(ratio: float) -> bool:
    """1/BAND <= r <= BAND (a ratio of the wrong sign, zero or not finite never is)."""
    return ratio > 0 and math.isfinite(ratio) and abs(math.log(ratio)) <= math.log(BAND)


class GradientCheckEvidence(Evidence):
    """Why gradient checks flagged a worker: `value` the last ratio, `mean` the median of its recent
    ones, `cusum` its checks out of band among the recent, `replies` its gradients checked."""

    def describe(self) -> str:
        return (f"stage {self.stage} {self.kind}: its input gradients failed {int(self.cusum)} of its last "
                f"{RECENT} finite-difference checks (last ratio {self.value:.3g}, recent median {self.mean:.3g}; "
                f"honest 1, band {1 / BAND:.2f}..{BAND:.2f}; {self.replies} of its gradients checked)")


@dataclass(frozen=True)
class GradientVerdict:
    ratio: float
    in_band: bool
    flagged: GradientCheckEvidence | None = None


@dataclass
class _WorkerRecord:
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # (ratio, in band)
    checked: int = 0
    smallest: float = math.inf
    largest: float = -math.inf


class GradientJudge:
    """Per worker: its recent checks' ratios, and whether they name it (module docstring)."""

    def __init__(self) -> None:
        self._workers: dict[str, _WorkerRecord] = {}
        self.flagged: set[str] = set()

    def extremes(self) -> dict[str, tuple[float, float]]:
        """Per worker checked, its smallest and largest ratio (how close honest traffic comes to the band)."""
        return {peer: (record.smallest, record.largest) for peer, record in sorted(self._workers.items())}

    def judge(self, stage: int, peer: str, ratio: float) -> GradientVerdict:
        """One check of `peer`'s gradient, its ratio `ratio`."""
        record = self._workers.setdefault(peer, _WorkerRecord())
        good = in_band(ratio)
        record.recent.append((ratio, good))
        record.checked += 1
        record.smallest, record.largest = min(record.smallest, ratio), max(record.largest, ratio)
        failures = sum(1 for _, ok in record.recent if not ok)
        if failures < FAILURES or peer in self.flagged:
            return GradientVerdict(ratio, good)
        self.flagged.add(peer)
        ratios = sorted(value for value, _ in record.recent)
        evidence = GradientCheckEvidence(
            stage=stage, kind="input_grad", peer=peer, feature="gradient_check",
            direction="low" if ratio < 1 else "high", cusum=float(failures), value=ratio,
            mean=ratios[len(ratios) // 2], centre=1.0, spread=math.log(BAND), replies=record.checked)
        return GradientVerdict(ratio, good, evidence)


@dataclass(frozen=True)
class Probe:
    """What one check needs: the stage's input wire x (decoded), the gradient returned for it, the
    output gradient it answered (None: the tail), the call's tokens and labels, and the version of the
    worker's weights the gradient was computed on (the probes must answer on the same weights)."""

    wire: torch.Tensor
    input_grad: torch.Tensor
    output_grad: torch.Tensor | None
    tokens: torch.Tensor
    targets: torch.Tensor | None
    weights_version: int


# (checker, microbatch id, tokens, encoded probe wire, targets) -> the held-out Forward's result
ProbeCall = Callable[[WorkerView, str, torch.Tensor, bytes, torch.Tensor | None], Awaitable]


class GradientChecks:
    """Samples gradients to check, probes and judges them in the background (module docstring).

    `flag(evidence)` takes the worker it names out of the run."""

    def __init__(self, share: float, stats: TrainerStats, flag: Callable[[GradientCheckEvidence], None],
                 rng: random.Random | None = None):
        self.share, self.stats, self.flag = share, stats, flag
        self.judge = GradientJudge()
        self.rng = rng if rng is not None else random.Random()
        self.probe_codec = WireCodec("fp32")  # module docstring: the step
        self._tasks: set[asyncio.Task] = set()

    def sampled(self) -> bool:
        return self.share > 0 and self.rng.random() < self.share

    def checker(self, worker: WorkerView, candidates: list[WorkerView], now: float) -> WorkerView | None:
        """Who probes (module docstring): the worker itself when it has two credits free, else None (counted)."""
        own = [v for v in candidates if v.peer_id == worker.peer_id and v.phase in TRAINING_PHASES
               and v.banned_until <= now and v.paused_until <= now and v.in_flight + 2 <= v.credits]
        if not own:
            self.stats.gradient_check_skipped(worker.stage)
            return None
        return own[0]

    def launch(self, worker: WorkerView, checker: WorkerView, microbatch_id: str, probe: Probe,
               call: ProbeCall) -> None:
        """Probe `worker`'s gradient on `checker` and judge it, in the background."""
        task = asyncio.create_task(self._check(worker, checker, microbatch_id, probe, call))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the checks in flight (each bounded by its calls' deadline)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _check(self, worker: WorkerView, checker: WorkerView, microbatch_id: str, probe: Probe,
                     call: ProbeCall) -> None:
        stage = worker.stage
        plus, minus, step = probe_inputs(probe.wire, probe.input_grad)
        if not checkable(step, float(probe.input_grad.to(torch.float32).norm())):
            self.stats.gradient_check_skipped(stage)  # no direction to probe along: the verifier judges zeros
            return
        frames = (self.probe_codec.encode(plus), self.probe_codec.encode(minus))
        answers = await asyncio.gather(
            *(call(checker, f"{microbatch_id}.grad-{sign}", probe.tokens, frame, probe.targets)
              for sign, frame in zip(("plus", "minus"), frames)), return_exceptions=True)
        failed = [answer for answer in answers if isinstance(answer, BaseException)]
        if failed:
            if not all(isinstance(error, StageCallError) for error in failed):
                raise failed[0]
            logger.debug("gradient check of stage %d on %s failed: %s", stage, checker.endpoint, failed[0])
            return
        self.stats.gradient_check(stage, sum(answer.compute_s for answer in answers))
        if any(answer.weights_version != probe.weights_version or not answer.full_precision for answer in answers):
            self.stats.gradient_check_skipped(stage)  # module docstring: the same weights, in full precision
            return
        ratio = self._ratio(probe, answers, step)
        if ratio is None:
            return
        verdict = self.judge.judge(stage, worker.peer_id, ratio)
        if not verdict.in_band:
            self.stats.gradient_check_failed(stage)
            logger.info("stage %d gradient check of %s on %s: ratio %.3g out of band", stage, worker.endpoint,
                        checker.endpoint, ratio,
                        extra={"milestone": "gradient_check_failed",
                               "fields": {"stage": stage, "peer": worker.peer_id, "checker": checker.peer_id,
                                          "ratio": ratio}})
        if verdict.flagged is not None:
            self.flag(verdict.flagged)

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
