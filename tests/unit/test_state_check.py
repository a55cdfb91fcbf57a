"""The checks a downloaded stage state passes before it is applied (node/membership/state_check.py), on
a real stage's tensors without sockets: honest replicas that drift apart pass; a tensor scaled x10,
a flipped sign, random values, a zeroed tensor, NaN, and Adam moments no Adam run reaches fail."""

import math

import pytest
import torch

from agora.node.membership.check_options import StateCheckOptions
from agora.node.membership.state_check import (
    adam_moment_bound,
    judge,
    judge_alone,
    local_refusal,
    norms_of,
    param_group_refusal,
    sketch_state,
)
from agora.pipeline.config import PRESETS
from agora.pipeline.optim import StageOptimizer
from agora.pipeline.stages import build_stage

CONFIG = PRESETS["tiny"].with_stages(2)
OPTIONS = StateCheckOptions()
SEED = 1234567


def _stage_state() -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in build_stage(CONFIG.model, 1).state_dict().items()}


def _moved(state: dict, share: float, seed: int) -> dict:
    """Every tensor moved by random noise of `share` of its own RMS (a floor for the norms' ones)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state.items():
        scale = share * max(float(tensor.pow(2).mean().sqrt()), 0.02)
        out[name] = tensor + torch.randn(tensor.shape, generator=generator) * scale
    return out


def _replicas(drift: float = 0.15, count: int = 3) -> list[dict]:
    """A trained stage (its initialisation moved by as much again, the same for all) and `count`
    replicas of it that drifted apart by `drift` of each tensor's size."""
    trained = _moved(_stage_state(), 1.0, seed=0)
    return [_moved(trained, drift, seed=1 + index) for index in range(count)]


def _verdict(state: dict, seconds: list[dict], seed: int = SEED):
    return judge(sketch_state(state, seed, OPTIONS.sketch_size),
                 [sketch_state(second, seed, OPTIONS.sketch_size) for second in seconds], OPTIONS)


def _poisoned(state: dict, how: str) -> dict:
    name = "layers.4.attn.q.weight"
    tensor = state[name]
    poison = {"x10": tensor * 10, "flipped": -tensor, "zeroed": torch.zeros_like(tensor),
              "random": torch.randn(tensor.shape, generator=torch.Generator().manual_seed(9)) * tensor.pow(2).mean().sqrt()}
    return dict(state, **{name: poison[how]})


def test_honest_replicas_that_drift_apart_agree_with_one_or_two_second_members():
    donor, first, second = _replicas()
    for seconds in ([first], [first, second]):
        verdict = _verdict(donor, seconds)
        assert verdict.refusal is None and 0 < verdict.ratio <= 1, verdict
        assert verdict.agreeing == tuple(range(len(seconds)))


@pytest.mark.parametrize("how, reason", [("x10", "scale"), ("zeroed", "scale"), ("flipped", "sketch"),
                                         ("random", "sketch")])
def test_one_poisoned_tensor_is_refused_by_one_or_two_second_members(how, reason):
    donor, first, second = _replicas()
    for seconds in ([first], [first, second]):
        verdict = _verdict(_poisoned(donor, how), seconds)
        assert verdict.refusal == reason and "layers.4.attn.q.weight" in verdict.detail, verdict


def test_two_second_members_bound_the_distance_by_the_drift_they_show():
    """Replicas 2% apart: a tensor 40% off (what one second member's ceiling lets through) is 5x the
    stage's drift times the factor, refused once a second pair shows how close replicas are now."""
    donor, first, second = _replicas(drift=0.02)
    name = "layers.4.mlp.up.weight"
    off = dict(donor, **{name: donor[name] + torch.randn(donor[name].shape) * 0.4 * donor[name].pow(2).mean().sqrt()})
    assert _verdict(off, [first]).refusal is None
    verdict = _verdict(off, [first, second])
    assert verdict.refusal == "sketch" and name in verdict.detail


def test_one_lying_second_member_refuses_nothing_and_cannot_vouch_for_a_poisoned_state():
    donor, honest, other = _replicas()
    liar = _poisoned(other, "random")  # a replica of its own, one tensor of it random
    assert _verdict(donor, [liar, honest]).agreeing == (1,)
    assert _verdict(_poisoned(donor, "flipped"), [liar, honest]).refusal is not None


def _sign(name: str, numel: int, index: int, seed: int) -> float:
    """The sign element `index` of a tensor `name` of `numel` elements gets in the sketch of `seed`."""
    one_hot = torch.zeros(numel)
    one_hot[index] = 1.0
    return float(sketch_state({name: one_hot}, seed, OPTIONS.sketch_size).vectors[name][index % OPTIONS.sketch_size])


def test_a_lie_fitted_to_one_seed_is_seen_under_the_seed_the_joiner_draws():
    """Element j and element j + k share bucket j: moved by +a and -a times their signs, they cancel
    in that seed's sketch. A donor that knew the seed could hide any change there; under a seed it
    does not know, the same change shows its full size."""
    (donor,) = _replicas(count=1)
    name, k = "layers.4.attn.q.weight", OPTIONS.sketch_size
    flat = donor[name].reshape(-1)
    lie, a = flat.clone(), 3 * float(flat.abs().max())
    for j in range(k):
        lie[j] += a * _sign(name, flat.numel(), j, SEED)
        lie[j + k] -= a * _sign(name, flat.numel(), j + k, SEED)
    poisoned = dict(donor, **{name: lie.reshape(donor[name].shape)})

    def seen(seed: int) -> float:
        change = sketch_state(poisoned, seed, k).vectors[name] - sketch_state(donor, seed, k).vectors[name]
        return float(change.norm()) / float((lie - flat).norm())

    assert seen(SEED) < 1e-4  # invisible under the seed it was fitted to
    assert seen(SEED + 1) > 0.5  # about 1 under any other
    assert _verdict(poisoned, [donor], seed=SEED).refusal is None
    assert _verdict(poisoned, [donor], seed=SEED + 1).refusal == "sketch"


def test_the_sketch_is_linear_measures_distances_and_depends_on_the_seed():
    a, b = _replicas(count=2)
    name = "layers.4.mlp.up.weight"
    difference = {name: a[name] - b[name]}
    sa, sb, sd = (sketch_state(x, SEED, 256).vectors[name] for x in (a, b, difference))
    assert torch.allclose(sa - sb, sd, atol=1e-5)
    estimate = float(sd.norm()) / float(difference[name].norm())
    assert 0.7 < estimate < 1.3
    assert not torch.allclose(sa, sketch_state(a, SEED + 1, 256).vectors[name])
    assert sa.shape == (256,) and sketch_state({"tiny": torch.ones(5)}, SEED, 256).vectors["tiny"].shape == (5,)


def test_alone_only_the_scale_against_its_own_tensors_is_checked():
    own = norms_of(_stage_state())
    (trained,) = _replicas(count=1)
    verdict = judge_alone(norms_of(trained), own, OPTIONS)
    assert verdict.refusal is None and "no second member" in verdict.detail
    bad = dict(trained, **{"lm_head.weight": trained["lm_head.weight"] * 100})
    assert judge_alone(norms_of(bad), own, OPTIONS).refusal == "scale"


def _tree(model: dict, optimizer: dict) -> dict:
    return {"stage": 1, "step": optimizer["steps"], "model": model, "optimizer": optimizer, "averaging": None}


def _trained_optimizer(steps: int = 5):
    stage = build_stage(CONFIG.model, 1)
    optimizer = StageOptimizer(stage, CONFIG.optim, 1, 2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for p in optimizer.parameters:
            p.grad = torch.randn(p.shape, generator=generator) * 10 ** float(torch.randint(-6, 2, (1,), generator=generator))
        optimizer.step(1)
    return stage, optimizer


def test_honest_adam_moments_pass_and_moments_no_adam_reaches_fail():
    stage, optimizer = _trained_optimizer()
    betas, eps = CONFIG.optim.betas, CONFIG.optim.eps

    def refusal(state):
        return local_refusal(_tree(stage.state_dict(), state), stage=1, far_from_agreement=lambda step: step > 100,
                             betas=betas, eps=eps)

    honest = optimizer.state_dict()
    assert refusal(honest) is None
    assert math.isclose(adam_moment_bound((0.9, 0.95)), 1.165, rel_tol=1e-3)
    entry = honest["optimizer"]["state"][0]
    for change, reason in ((dict(exp_avg=torch.full_like(entry["exp_avg"], 1e6), exp_avg_sq=torch.zeros_like(entry["exp_avg_sq"])), "moments"),
                           (dict(exp_avg_sq=-entry["exp_avg_sq"] - 1), "moments"),
                           (dict(step=torch.tensor(-1.0)), "moments"),
                           (dict(exp_avg=entry["exp_avg"] * math.nan), "nonfinite")):
        state = {"optimizer": {"state": {**honest["optimizer"]["state"], 0: dict(entry, **change)},
                               "param_groups": honest["optimizer"]["param_groups"]}, "steps": honest["steps"]}
        assert refusal(state)[0] == reason, change
    assert refusal(dict(honest, steps=10**9))[0] == "step"
    nan_model = dict(stage.state_dict(), **{"final_norm.weight": torch.full((128,), math.nan)})
    assert local_refusal(_tree(nan_model, honest), stage=1, far_from_agreement=lambda step: False, betas=betas,
                         eps=eps) == ("nonfinite", "model.final_norm.weight holds a value that is not finite")
    assert local_refusal(_tree(stage.state_dict(), honest), stage=0, far_from_agreement=lambda step: False,
                         betas=betas, eps=eps)[0] == "state"


def test_a_state_may_not_choose_how_this_replica_steps():
    _, optimizer = _trained_optimizer(1)
    own = optimizer.optimizer.state_dict()["param_groups"]
    honest = optimizer.state_dict()
    assert param_group_refusal(dict(honest), own) is None
    groups = [dict(group) for group in own]
    groups[0]["lr"] = 123.0  # the schedule sets it at every step: not the state's to say, not refused
    assert param_group_refusal({"optimizer": {"param_groups": groups}}, own) is None
    groups[1]["maximize"] = True
    assert "maximize" in param_group_refusal({"optimizer": {"param_groups": groups}}, own)
    assert param_group_refusal({"optimizer": {"param_groups": own[:1]}}, own) is not None


def test_the_check_options_are_one_schema_section_with_named_errors():
    from agora.pipeline.schema import explain
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as raised:
        StateCheckOptions(min_drift=0.9, max_drift=0.5)
    assert "min_drift" in str(explain(raised.value, StateCheckOptions))
    with pytest.raises(ValidationError):
        StateCheckOptions(max_drift=1.5)  # random values of the same size lie at 1.41: it would pass them
