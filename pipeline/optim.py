"""One stage's optimizer: gradient accumulation, per-stage clipping, AdamW, warmup + cosine.

The centralized trainer and every swarm worker step through this same class, which is what lets
the swarm's synchronous mode reproduce the centralized run exactly.

- Gradients of the microbatches of one global batch are summed by autograd; `step` divides them
  by the number of microbatches (each microbatch loss is a token mean), so the update equals one
  step on the mean loss of the batch.
- Clipping is per stage: a global budget `clip_norm` becomes `clip_norm / sqrt(S)` per stage and
  twice that on the tail (the Agora report's 1/sqrt(7) and 2/sqrt(7) for S = 7).
- Weight decay applies to matrices (including the subspace factors Z); norm gains and biases are
  not decayed; the fixed basis U and embedding T are buffers and never reach the optimizer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from agora.pipeline.config import OptimConfig

__all__ = ["lr_at", "stage_clip_norm", "StageOptimizer"]


def lr_at(step: int, config: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to min_lr_ratio."""
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def stage_clip_norm(index: int, n_stages: int, config: OptimConfig) -> float:
    budget = config.clip_norm / math.sqrt(n_stages)
    return budget * config.tail_clip_multiplier if index == n_stages - 1 and n_stages > 1 else budget


class StageOptimizer:
    def __init__(self, stage: nn.Module, config: OptimConfig, index: int, n_stages: int):
        self.config = config
        self.clip = stage_clip_norm(index, n_stages, config)
        self.parameters = [p for p in stage.parameters() if p.requires_grad]
        decay = [p for p in self.parameters if p.dim() >= 2]
        no_decay = [p for p in self.parameters if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr_at(0, config), betas=config.betas, eps=config.eps, foreach=False,
        )
        self.steps = 0

    def zero_grad(self) -> None:
        for p in self.parameters:
            p.grad = None

    def step(self, n_microbatches: float) -> dict[str, float]:
        """Divide the accumulated gradients by `n_microbatches`, clip, step; returns the pre-clip norm
        and the lr used. A replica of a stage passes its expected share of the batch, which need not
        be a whole number."""
        if not n_microbatches > 0:
            raise ValueError("step needs at least one accumulated microbatch")
        if n_microbatches != 1:
            for p in self.parameters:
                if p.grad is not None:
                    p.grad.div_(n_microbatches)
        norm = float(torch.nn.utils.clip_grad_norm_(self.parameters, self.clip, foreach=False))
        lr = lr_at(self.steps, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if math.isfinite(norm):
            self.optimizer.step()
        self.zero_grad()
        self.steps += 1
        return {"grad_norm": norm, "lr": lr, "skipped": not math.isfinite(norm)}

    def advance(self) -> float:
        """Count a step without an update (a replica that got none of a global batch); its lr."""
        lr = lr_at(self.steps, self.config)
        self.steps += 1
        return lr

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
