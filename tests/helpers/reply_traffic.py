"""What a trainer's `ReplyVerifier` sees in a real run, without a network: tiny's three stages trained
in-process, two replicas of the body (peers "b0", "b1", averaged every `AVERAGE_EVERY` steps, so they
drift apart and back as replicas under averaging do), one head ("h") and one tail ("t").

Each microbatch goes head -> body replica -> tail -> body -> head as the trainer relays it; every
reply passes the verifier before it is relayed, as in the trainer, and a refused reply abandons
the microbatch's route (its gradients are added to nothing) and reruns it on the other body
replica. A liar is played by rewriting one peer's replies of one kind (`Attack`) in a fork of an
honest run (`WatchedTraining.fork`); what it sends flows on to the next stages, so the workers
downstream compute on the lie until the liar is flagged (the right peer must be the one blamed).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from agora.node.trainer.verification import Evidence, ReplyVerifier, VerifierSettings
from agora.pipeline.config import PRESETS
from agora.pipeline.stages import build_stage

AVERAGE_EVERY = 3
MICROBATCHES = 4

Rewrite = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]  # (reply, the liar's previous) -> lie


def _config():
    config = PRESETS["tiny"].with_stages(3)
    return replace(config, train=replace(config.train, batch_size=2 * MICROBATCHES, microbatches=MICROBATCHES,
                                         seq_len=32))


CONFIG = _config()


@dataclass(frozen=True)
class Attack:
    peer: str
    kind: str  # "output" or "input_grad"
    rewrite: Rewrite


@dataclass
class Outcome:
    flagged: dict[str, Evidence]
    lies: int = 0  # replies the liar rewrote (the one that got it flagged included)
    reroutes: int = 0
    losses: list[float] = field(default_factory=list)
    peaks: dict = field(default_factory=dict)  # the largest CUSUM of each (stage, kind, peer)


def scaled(factor: float) -> Rewrite:
    return lambda reply, previous: reply * factor


def noisy(reply: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(int(reply.numel()))
    return reply + torch.randn(reply.shape, generator=generator) * reply.square().mean().sqrt()


def constant(reply: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """Every token's vector the same: the reply's mean vector (a plausible magnitude, no content)."""
    return reply.mean(dim=(0, 1), keepdim=True).expand_as(reply).clone()


def stale(reply: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """The liar's reply to its previous microbatch, sent again."""
    return reply if previous is None else previous


def flipped(reply: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    return -reply


class _Pipeline:
    def __init__(self, seed: int):
        torch.manual_seed(seed)
        model = CONFIG.model
        self.stages = {"h": build_stage(model, 0), "b0": build_stage(model, 1), "b1": build_stage(model, 1),
                       "t": build_stage(model, 2)}
        self.optimizers = {peer: torch.optim.AdamW(stage.parameters(), lr=CONFIG.optim.lr)
                           for peer, stage in self.stages.items()}

    def average_bodies(self) -> None:
        with torch.no_grad():
            for left, right in zip(self.stages["b0"].parameters(), self.stages["b1"].parameters()):
                mean = (left + right) / 2
                left.copy_(mean)
                right.copy_(mean)

    def step(self) -> None:
        for optimizer in self.optimizers.values():
            optimizer.step()
            optimizer.zero_grad()


class WatchedTraining:
    """The pipeline under a verifier, trained a few global batches at a time; `fork` gives a copy (weights,
    optimizers, the verifier's state) in which a liar starts lying at once."""

    def __init__(self, seed: int = 0, settings: VerifierSettings = VerifierSettings()):
        self.verifier, self.pipeline, self.seed = ReplyVerifier(settings), _Pipeline(seed), seed
        self.steps_done = 0
        self.attack: Attack | None = None
        self.previous: torch.Tensor | None = None
        self.upstream: list = []  # the microbatch's replies so far (what the next ones are computed from)
        self.outcome = Outcome({})

    def fork(self, attack: Attack) -> "WatchedTraining":
        twin = copy.deepcopy(self)
        twin.attack, twin.previous, twin.outcome = attack, None, Outcome({})
        return twin

    def reply(self, stage: int, peer: str, kind: str, frame: torch.Tensor, request: torch.Tensor | None):
        """The frame as the worker sends it (a liar's rewritten), or None when the verifier refuses it."""
        frame = frame.detach()
        attack = self.attack
        if attack is not None and (attack.peer, attack.kind) == (peer, kind):
            honest, frame = frame, attack.rewrite(frame, self.previous)
            self.outcome.lies += 1
            self.previous = honest
        features = self.verifier.features(frame, None if request is None else request.detach())
        if self.verifier.observe(stage, kind, peer, features, self.upstream) is not None:
            return None
        self.upstream.append((stage, kind, peer))
        return frame

    def microbatch(self, tokens: torch.Tensor, targets: torch.Tensor, body: str) -> tuple[float, list] | None:
        """One route; its loss and gradients per peer, or None when a reply was refused."""
        stages = self.pipeline.stages
        self.upstream = []
        head_out = stages["h"](tokens)
        wire0 = self.reply(0, "h", "output", head_out, None)
        if wire0 is None:
            return None
        wire0 = wire0.clone().requires_grad_()
        body_out = stages[body](tokens, wire0)
        wire1 = self.reply(1, body, "output", body_out, wire0)
        if wire1 is None:
            return None
        wire1 = wire1.clone().requires_grad_()
        loss = stages["t"](tokens, wire1, targets)
        tail_grads = torch.autograd.grad(loss, [wire1, *stages["t"].parameters()])
        grad1 = self.reply(2, "t", "input_grad", tail_grads[0], wire1)
        if grad1 is None:
            return None
        body_grads = torch.autograd.grad(body_out, [wire0, *stages[body].parameters()], grad1)
        grad0 = self.reply(1, body, "input_grad", body_grads[0], grad1)
        if grad0 is None:
            return None
        head_grads = torch.autograd.grad(head_out, list(stages["h"].parameters()), grad0)
        return loss.item(), [("t", tail_grads[1:]), (body, body_grads[1:]), ("h", head_grads)]

    def train(self, steps: int, data) -> Outcome:
        """`steps` more global batches of `data` (`build_data(CONFIG)`); what the verifier did so far."""
        for _ in range(steps):
            unit = data.train.unit(self.steps_done + 1000 * self.seed)
            for index, micro in enumerate(unit.chunk(MICROBATCHES)):
                self._train(micro[:, :-1], micro[:, 1:], preferred=f"b{index % 2}")
            self.pipeline.step()
            self.steps_done += 1
            if self.steps_done % AVERAGE_EVERY == 0:
                self.pipeline.average_bodies()
        self.outcome.flagged = self.verifier.flagged()
        self.outcome.peaks = self.verifier.peaks()
        return self.outcome

    def _train(self, tokens: torch.Tensor, targets: torch.Tensor, preferred: str) -> None:
        flagged = self.verifier.flagged()
        for body in (preferred, "b1" if preferred == "b0" else "b0"):
            if body in flagged or "h" in flagged or "t" in flagged:
                continue
            done = self.microbatch(tokens, targets, body)
            if done is None:
                self.outcome.reroutes += 1
                continue
            loss, grads = done
            self.outcome.losses.append(loss)
            for peer, peer_grads in grads:
                for parameter, grad in zip(self.pipeline.stages[peer].parameters(), peer_grads):
                    parameter.grad = grad.detach() / MICROBATCHES if parameter.grad is None \
                        else parameter.grad + grad.detach() / MICROBATCHES
            return
