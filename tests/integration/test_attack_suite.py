"""The attack suite's quick form (bench/attacks.py runs it in full): hostile workers in a real swarm.

Six StageWorkers on loopback (head, body, tail, two replicas each) and one SwarmTrainer
(tests/helpers/attack_swarm.py). A replica turns liar after 12 honest steps of a 24-step run; the
trainer must catch it (the verifier's flag, the scale bound's refusal, or blame) and no honest
worker, and finish the run. A stage's replicas are averaged every few steps, as in a real run.
Three lies cover the three positions and both frames: x1e4 outputs at the head (beyond the scale
bound), sign-flipped gradients in a body's Backward replies, and a constant input gradient from
the tail. A stale tail (replaying its previous reply) is named on its first replay. A clean run
must catch no one. The schedules of the liars
(late, on-off) are checked on the lies they told.
"""

from __future__ import annotations

import asyncio

import pytest

from attack_swarm import AVERAGE_EVERY, Plan, run_plan
from lying_workers import LieSchedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

STEPS = 24
HONEST_STEPS = 12


@pytest.mark.parametrize("attack, position", [("x1e4", "head"), ("sign-grad", "body"), ("constant", "tail")])
def test_a_liar_is_caught_and_no_honest_worker(attack, position):
    result = asyncio.run(run_plan(Plan(0, STEPS, attack=attack, position=position,
                                       schedule=LieSchedule(honest_steps=HONEST_STEPS))))
    liar = result["liar"]
    assert liar in result["caught"], result
    assert set(result["caught"]) == {liar}, result
    assert result["first_lie_step"] >= HONEST_STEPS
    assert 1 <= result["caught"][liar]["lies"] <= result["lies"]


def test_a_stale_liar_is_named_by_its_first_repeated_reply():
    # Self checks off: what names it is its repeat, not a check that happens to fall on a lie.
    result = asyncio.run(run_plan(Plan(0, HONEST_STEPS + 4, attack="stale", position="tail",
                                       schedule=LieSchedule(honest_steps=HONEST_STEPS)), gradient_share=0.0))
    liar = result["liar"]
    assert set(result["caught"]) == {liar}, result
    assert result["caught"][liar]["how"] == "repeat check" and result["caught"][liar]["lies"] == 1, result


def test_a_clean_run_catches_no_one():
    result = asyncio.run(run_plan(Plan(1, STEPS)))
    assert result["caught"] == {} and result["liar"] is None, result
    # Every stage's replicas were averaged every AVERAGE_EVERY steps (each round once both reached it).
    rounds = result["averaging_rounds"]
    assert len(rounds) == 3 and all(count >= STEPS // AVERAGE_EVERY - 1 for count in rounds), result


def test_an_on_off_liar_tells_lies_in_periods_and_a_late_one_only_after_its_honest_steps():
    # The verifier and self checks off, so each liar keeps its schedule the whole run (a caught one is
    # called no more).
    on_off = asyncio.run(run_plan(Plan(0, 12, verify=False, attack="on-off", position="body",
                                       schedule=LieSchedule(honest_steps=4, period=4)), gradient_share=0.0))
    late = asyncio.run(run_plan(Plan(0, 12, verify=False, attack="late", position="tail",
                                     schedule=LieSchedule(honest_steps=8)), gradient_share=0.0))
    # On-off: since its first lie, lies and honest replies alternate in runs of 4 (half of them lies).
    since_start = on_off["replies"] - on_off["started_at"] + 1
    assert on_off["first_lie_step"] >= 4 and since_start >= 8, on_off
    assert abs(2 * on_off["lies"] - since_start) <= 4, on_off
    assert late["lies"] > 0 and late["first_lie_step"] >= 8 and late["lies"] == late["replies"] - late["started_at"] + 1
