"""When a liar lies (tests/helpers/lying_workers.py `LieSchedule`): after honest replies and steps,
always or on-off."""

import pytest
import torch

from lying_workers import BEHAVIOURS, BIAS_SIZE, LieSchedule, bias_direction


def test_an_attack_starts_only_past_both_its_honest_replies_and_its_honest_steps():
    schedule = LieSchedule(honest_replies=3, honest_steps=10)
    assert not schedule.started(3, 20) and not schedule.started(9, 9)
    assert schedule.started(4, 10)


def test_on_off_lies_period_replies_then_stays_honest_as_many():
    assert [LieSchedule(period=2).lies(n) for n in range(8)] == [True, True, False, False] * 2
    assert all(LieSchedule().lies(n) for n in range(8))


@pytest.mark.parametrize("name", sorted(BEHAVIOURS))
def test_every_behaviour_keeps_the_frame_shape_and_changes_it(name):
    torch.manual_seed(0)
    honest, previous = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    lie = BEHAVIOURS[name](honest, previous)
    assert lie.shape == honest.shape and not torch.equal(lie, honest)


def test_the_bias_is_a_fixed_direction_at_its_share_of_the_frame_rms():
    honest = torch.randn(4, 8, 32)
    shift = BEHAVIOURS["bias"](honest, None) - honest
    assert torch.allclose(shift[0, 0], shift[3, 7], atol=1e-5)
    assert torch.allclose(shift.square().mean().sqrt(), BIAS_SIZE * honest.square().mean().sqrt(), rtol=1e-4)
    assert torch.equal(bias_direction(32), bias_direction(32))
