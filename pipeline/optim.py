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
- Precision (pipeline/runtime.py): fp32 weights (fp32 and bf16-autocast runs alike: the master
  weights) step with torch's AdamW. Weights stored in bf16 (`runtime.weights = "bf16"`) step with
  `RoundedAdamW`: fp32 moments, the update computed in fp32 from the bf16 value and rounded back
  into it, so no fp32 copy of the weights exists; the variant the master weights are measured
  against (bench/precision.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from agora.pipeline.config import OptimConfig

__all__ = ["lr_at", "stage_clip_norm", "StageOptimizer", "RoundedAdamW"]


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


class RoundedAdamW(torch.optim.Optimizer):
    """AdamW for weights stored in bf16 with its moments in fp32 (see the module docstring). Its state
    has torch AdamW's keys (`step`, `exp_avg`, `exp_avg_sq`), so checkpoints and the averaging of
    Adam moments read it alike."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch casts loaded moments to the parameter's dtype (bf16 here): take them again in fp32.
        saved = state_dict["state"]
        for index, param in enumerate(p for group in self.param_groups for p in group["params"]):
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved.get(index, {}):
                    self.state[param][key] = saved[index][key].to(device=param.device, dtype=torch.float32,
                                                                   copy=True)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
                state["step"] += 1
                step = float(state["step"])
                grad = param.grad.float()
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                weight = param.float()
                weight.mul_(1 - lr * decay)
                denominator = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
                weight.addcdiv_(state["exp_avg"], denominator, value=-lr / (1 - beta1 ** step))
                param.copy_(weight)
        return None


class StageOptimizer:
    def __init__(self, stage: nn.Module, config: OptimConfig, index: int, n_stages: int):
        self.config = config
        self.clip = stage_clip_norm(index, n_stages, config)
        self.parameters = [p for p in stage.parameters() if p.requires_grad]
        decay = [p for p in self.parameters if p.dim() >= 2]
        no_decay = [p for p in self.parameters if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if any(p.dtype == torch.bfloat16 for p in self.parameters):
            self.optimizer = RoundedAdamW(groups, lr=lr_at(0, config), betas=config.betas, eps=config.eps)
        else:
            self.optimizer = torch.optim.AdamW(groups, lr=lr_at(0, config), betas=config.betas, eps=config.eps,
                                               foreach=False)
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
