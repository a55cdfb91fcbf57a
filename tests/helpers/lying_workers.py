"""Honest stage workers made liars: their replies rewritten on their compute thread.

A liar is an honest `StageWorker` whose compute is wrapped: each training reply is computed
honestly, then, when its `LieSchedule` says so, one frame of it goes through a `transform(honest,
previous honest frame or None)` before it leaves. Which frame is a worker's to lie in:

- "output": a Forward's output wire (a head's or a body's activations; the tail has none);
- "input_grad": the gradient a worker sends back upstream: a body's (or head's, empty) Backward
  reply, or the tail's Forward reply, which carries its input gradient.

The behaviours (`BEHAVIOURS`) are those of a hostile worker within every format check: scaled
(x10, x1e4), noise at the frame's own RMS, sign-flipped, zeros, a constant (the frame's mean
token everywhere), stale (the previous microbatch's frame replayed), and a small persistent bias
(a fixed direction, `BIAS_SIZE` of the frame's RMS). A schedule adds when: after some honest
replies or honest steps of the worker's stage, always or on-off (lie K replies, honest K).
Everything is counted by step of the worker's stage, never by time, so tests stay deterministic.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from agora.node.worker.worker import StageWorker
from agora.pipeline.codec import WireCodec

__all__ = ["BEHAVIOURS", "BIAS_SIZE", "FRAMES", "LieSchedule", "Liar", "make_liar", "rewrite_replies",
           "scaled_output", "bias_direction"]

CODEC = WireCodec("fp32")
FRAMES = ("output", "input_grad")
# The persistent bias's size: its vector's RMS against the frame's (a twentieth).
BIAS_SIZE = 0.05


def _rms(frame: torch.Tensor) -> torch.Tensor:
    return frame.square().mean().sqrt()


def bias_direction(width: int) -> torch.Tensor:
    """A fixed unit-RMS direction of the wire's width (the same on every run: the bias persists)."""
    direction = torch.randn(width, generator=torch.Generator().manual_seed(7919 + width))
    return direction / _rms(direction)


def _noise(honest, previous):
    return honest + torch.randn_like(honest) * _rms(honest)


def _constant(honest, previous):
    return honest.mean(dim=tuple(range(honest.dim() - 1)), keepdim=True).expand_as(honest).contiguous()


def _stale(honest, previous):
    return honest if previous is None or previous.shape != honest.shape else previous


def _bias(honest, previous):
    return honest + BIAS_SIZE * _rms(honest) * bias_direction(honest.shape[-1]).to(honest.dtype)


# name -> transform(honest frame, previous honest frame or None) -> the lie
BEHAVIOURS = {
    "x10": lambda honest, previous: honest * 10,
    "x1e4": lambda honest, previous: honest * 1e4,
    "noise": _noise,
    "sign": lambda honest, previous: -honest,
    "zeros": lambda honest, previous: torch.zeros_like(honest),
    "constant": _constant,
    "stale": _stale,
    "bias": _bias,
}


@dataclass(frozen=True)
class LieSchedule:
    """When a liar lies: not before `honest_replies` training replies of its frame's kind nor before its
    stage has taken `honest_steps` optimizer steps; from then on every reply, or with `period` K > 0,
    K replies lied, K honest, and so on (on-off)."""

    honest_replies: int = 0
    honest_steps: int = 0
    period: int = 0

    def started(self, replies: int, step: int) -> bool:
        return replies > self.honest_replies and step >= self.honest_steps

    def lies(self, since_start: int) -> bool:
        """`since_start`: replies since the attack started, 0 for its first."""
        return self.period <= 0 or (since_start // self.period) % 2 == 0


@dataclass
class Liar:
    """What a liar did: training replies of its kind, lies told, and the stage's step at each lie."""

    frame: str
    replies: int = 0
    lies: int = 0
    check_lies: int = 0  # held-out replies lied in (`in_checks`)
    started_at: int | None = None  # the reply count at the attack's start
    lie_steps: list[int] = field(default_factory=list)


def make_liar(worker: StageWorker, transform, *, frame: str = "output",
              schedule: LieSchedule = LieSchedule(), in_checks: bool = False) -> Liar:
    """Wrap `worker`'s compute so its `frame` (`FRAMES`) goes through `transform` when `schedule` says;
    returns the liar's record. A tail's "input_grad" is in its Forward reply, anyone else's in Backward.
    Held-out Forwards (evaluations, the trainer's checks) are answered honestly unless `in_checks`: a
    liar that also lies in them once its attack started (counted apart, never as training lies)."""
    if frame not in FRAMES:
        raise ValueError(f"frame must be one of {FRAMES}, got {frame!r}")
    compute, liar, previous = worker.compute, Liar(frame), [None]
    if frame == "output" and compute.stage.is_tail:
        raise ValueError("a tail replies a loss, not an output frame: lie in its input_grad")
    method = "forward" if frame == "output" or compute.stage.is_tail else "backward"
    field_name = "wire" if frame == "output" else "input_grad"
    honest_call = getattr(compute, method)

    def lying(request, **caller):
        reply = honest_call(request, **caller)
        if not getattr(reply, field_name):
            return reply
        if getattr(request, "evaluate", False):
            if not in_checks or liar.started_at is None:
                return reply
            liar.check_lies += 1
            honest = CODEC.decode(getattr(reply, field_name))
            return dataclasses.replace(reply, **{field_name: CODEC.encode(transform(honest, previous[0]).contiguous())})
        liar.replies += 1
        honest = CODEC.decode(getattr(reply, field_name))
        last, previous[0] = previous[0], honest
        if liar.started_at is None and schedule.started(liar.replies, compute.optimizer.steps):
            liar.started_at = liar.replies
        if liar.started_at is None or not schedule.lies(liar.replies - liar.started_at):
            return reply
        liar.lies += 1
        liar.lie_steps.append(compute.optimizer.steps)
        return dataclasses.replace(reply, **{field_name: CODEC.encode(transform(honest, last).contiguous())})
    setattr(compute, method, lying)
    return liar


def rewrite_replies(worker: StageWorker, rewrite, *, after: int = 0) -> None:
    """From its `after`-th Forward on, the worker's replies go through `rewrite` (a liar)."""
    forward, served = worker.compute.forward, [0]

    def lying(request, **caller):
        reply = forward(request, **caller)
        served[0] += 1
        return rewrite(reply) if served[0] > after and not request.evaluate else reply
    worker.compute.forward = lying


def scaled_output(factor: float):
    return lambda reply: dataclasses.replace(reply, wire=CODEC.encode(CODEC.decode(reply.wire) * factor))
