"""Self checks over real gRPC: tiny in three stages, two replicas each (tests/helpers/attack_swarm.py).

A liar flips the sign of the input gradients it returns, at the tail (in its Forward reply) or at
the body (in its Backward reply), or adds noise at the tail's gradient's own scale: every marginal
statistic of its replies stays an honest one's, and the verifier alone lets it through (and may
name the body it poisoned instead). A head
adding noise to its output, or replaying its last one, mostly goes through too (the verifier caught
a noisy head at the last step of one run, so that case is not asserted either way). With self checks
(node/trainer/gradient_checks.py) the gradients' finite-difference ratios stand at -1 or about 0.5
and the head's replays stand far from its training answers (a persistent bias of a twentieth of
its RMS: far in their offset), and the liar is flagged, the only one.
An honest run at tiny's own learning rate, the replicas averaged every few steps, flags no one; its
ratios stand within a few percent of 1 and its replays within numerics.
"""

from __future__ import annotations

import asyncio

import pytest

from attack_swarm import Plan, run_plan
from lying_workers import LieSchedule

pytestmark = pytest.mark.timeout(300)

# A high share, so a short run checks the liar's gradients several times (the default is 0.05).
SHARE = 0.5
HONEST_STEPS, LIE_STEPS = 4, 12


def _attacked(attack: str, position: str, gradient_share: float, lie_in_checks: bool = False) -> dict:
    # A stale reply is named by its first repeat (node/trainer/repeats.py, on with the verifier): for
    # what the self checks alone make of it, the verifier and its repeat checks are off.
    plan = Plan(seed=0, steps=HONEST_STEPS + LIE_STEPS, attack=attack, position=position,
                schedule=LieSchedule(honest_steps=HONEST_STEPS), lie_in_checks=lie_in_checks, verify=attack != "stale")
    return asyncio.run(run_plan(plan, gradient_share=gradient_share))


@pytest.mark.parametrize("attack, position, lie_in_checks", [
    ("sign-grad", "tail", False), ("noise", "tail", False), ("sign-grad", "body", False),
    ("noise", "head", False),  # the head's replay check
    ("bias", "head", False),  # on the replay distance's tolerance: the replay's offset
    ("stale", "head", True),  # a stale answer stays stale when the replay is lied in too
])
def test_a_liar_is_flagged_by_its_own_held_out_answers(attack, position, lie_in_checks):
    result = _attacked(attack, position, SHARE, lie_in_checks)
    liar = result["liar"]
    assert result["lies"] > 0, result
    assert result["gradient_flagged"] == [liar], result
    assert set(result["caught"]) == {liar}, result


@pytest.mark.parametrize("attack, position", [("sign-grad", "tail"), ("noise", "tail")])
def test_the_verifier_alone_misses_these_lies(attack, position):
    result = _attacked(attack, position, 0.0)
    # Not the liar; its victim may be: a body trained on the flipped gradients drifts from its replica
    # until the verifier names it (it did at the last step of one loaded run), as self checks prevent.
    assert result["lies"] > 0 and result["liar"] not in result["caught"], result


def test_an_honest_run_flags_no_one_and_its_checks_stay_near_one():
    result = asyncio.run(run_plan(Plan(seed=1, steps=30), gradient_share=SHARE))
    assert result["caught"] == {} and result["gradient_flagged"] == [], result
    ratios = result["gradient_ratios"]
    assert {peer[:2] for peer in ratios} == {"s1", "s2"}, ratios  # the bodies and tails were checked
    # Honest checks on the gradient's own weights: within 1.7% of 1 over 414 checks of five runs
    # (node/trainer/gradient_checks.py: the step); the band is 25%.
    assert all(failed == 0 for failed in result["check_failures"].values()), result["check_failures"]
    assert all(0.95 < smallest <= largest < 1.05 for smallest, largest in ratios.values()), ratios
    replays = result["replay_distances"]
    assert {peer[:2] for peer in replays} == {"s0", "s1", "s2"} and max(replays.values()) < 1, replays  # in tolerances
