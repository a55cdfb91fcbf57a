"""The per-stage optimizer: schedule, clip budgets, and accumulation equal to one big batch."""

import math
from dataclasses import replace

import pytest
import torch

from agora.pipeline.config import OptimConfig, PRESETS
from agora.pipeline.optim import StageOptimizer, lr_at, stage_clip_norm
from agora.pipeline.stages import build_stage


def test_warmup_then_cosine_to_floor():
    config = OptimConfig(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, config) == pytest.approx(0.1)
    assert lr_at(9, config) == pytest.approx(1.0)
    assert lr_at(60, config) == pytest.approx(0.55)
    assert lr_at(110, config) == pytest.approx(0.1)
    assert lr_at(10_000, config) == pytest.approx(0.1)


def test_clip_budget_matches_the_report():
    config = OptimConfig(clip_norm=1.0)
    assert stage_clip_norm(0, 7, config) == pytest.approx(1 / math.sqrt(7))
    assert stage_clip_norm(3, 7, config) == pytest.approx(0.3779, abs=1e-4)
    assert stage_clip_norm(6, 7, config) == pytest.approx(0.7559, abs=1e-4)
    assert stage_clip_norm(0, 1, config) == 1.0


def test_accumulated_microbatches_step_like_one_batch():
    config = replace(PRESETS["tiny"].model, layer_split=(6,))
    # A large eps makes Adam's first step ~linear in the gradient, so float noise is not amplified.
    optim = replace(PRESETS["tiny"].optim, clip_norm=1e9, eps=1.0)
    data = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    whole, parts = build_stage(config, 0), build_stage(config, 0)
    opt_whole, opt_parts = StageOptimizer(whole, optim, 0, 1), StageOptimizer(parts, optim, 0, 1)
    whole(data[:, :-1], targets=data[:, 1:]).backward()
    opt_whole.step(1)
    for chunk in data.chunk(2):
        parts(chunk[:, :-1], targets=chunk[:, 1:]).backward()
    opt_parts.step(2)
    for (name, a), b in zip(whole.named_parameters(), parts.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_non_finite_gradient_skips_the_update():
    stage = build_stage(replace(PRESETS["tiny"].model, layer_split=(6,)), 0)
    opt = StageOptimizer(stage, PRESETS["tiny"].optim, 0, 1)
    before = [p.detach().clone() for p in stage.parameters()]
    for p in stage.parameters():
        p.grad = torch.full_like(p, float("nan"))
    result = opt.step(1)
    assert result["skipped"]
    assert all(torch.equal(a, b) for a, b in zip(before, stage.parameters()))
