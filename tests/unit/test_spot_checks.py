"""Spot checks' pure parts (node/trainer/spot_checks.py): the distance, the bar, whom a disagreement names.

The honest reference is measured on what tiny's two body replicas really compute while they train
in-process and are averaged every third step (tests/helpers/reply_traffic.py): their outputs for the
same input must never count as a disagreement, while a replayed or row-shuffled output must.
"""

from __future__ import annotations

import random

import pytest
import torch

from agora.monitor.metrics import sample_value
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.spot_checks import MIN_CHECKED, MIN_OTHERS, PARTNERS, SpotChecks, SpotJudge, output_distance
from agora.node.trainer.stats import TrainerStats
from agora.pipeline.codec import WireCodec
from agora.pipeline.data import build_data
from reply_traffic import CONFIG, MICROBATCHES, WatchedTraining

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 0.25


def _honest(judge: SpotJudge, peers: list[str], checks: int, rng: random.Random, stage: int = 0) -> None:
    for _ in range(checks):
        primary, checker = rng.sample(peers, 2)
        assert judge.compare(stage, primary, checker, rng.uniform(0.0, 0.06)).agreed


def test_the_distance_is_zero_for_equal_outputs_two_for_opposite_ones_and_symmetric():
    generator = torch.Generator().manual_seed(0)
    first, second = torch.randn(2, 8, 16, generator=generator), torch.randn(2, 8, 16, generator=generator)
    assert output_distance(first, first) == 0.0
    assert output_distance(first, -first) == pytest.approx(2.0)
    assert output_distance(first, second) == pytest.approx(output_distance(second, first))
    assert output_distance(3 * first, 3 * second) == pytest.approx(output_distance(first, second), rel=1e-5)


def test_the_bar_is_the_tolerance_until_honest_drift_reaches_it_then_follows_the_drift():
    judge = SpotJudge(TOLERANCE)
    assert judge.reference(0) == (0.0, TOLERANCE)
    for distance in (0.01, 0.02, 0.03, 0.02):
        judge.compare(0, "a", "b", distance)
    assert judge.reference(0)[1] == TOLERANCE
    wide = SpotJudge(TOLERANCE)
    for index in range(200):  # replicas drifting apart, never averaged: from 0.02 to 0.6, a tenth up and down
        assert wide.compare(0, "a", "b", (0.02 + 0.58 * index / 199) * (1 + 0.1 * (index % 3 - 1))).agreed
    centre, bar = wide.reference(0)
    assert centre > 0.4 and bar > 0.6
    assert not wide.compare(0, "a", "b", 2 * bar).agreed


def test_disagreements_stay_out_of_the_reference_so_a_liar_cannot_lift_its_bar():
    judge, rng = SpotJudge(TOLERANCE), random.Random(1)
    _honest(judge, ["h1", "h2"], 16, rng)
    before = judge.reference(0)
    for index in range(64):
        assert not judge.compare(0, "liar", f"h{1 + index % 2}", 1.0).agreed
    assert judge.reference(0) == before


def test_a_liar_among_three_replicas_is_named_once_the_others_checks_agree_and_two_checkers_vouched():
    judge, rng = SpotJudge(TOLERANCE), random.Random(2)
    for index in range(MIN_CHECKED):  # the liar's replies refuted; nothing known of the others yet
        assert judge.compare(0, "liar", f"h{1 + index % 2}", 1.1).flagged is None
    assert judge.compare(0, "h2", "liar", 0.9).flagged is None  # a lying witness accuses no one it must
    verdicts = [judge.compare(0, *(("h1", "h2") if index % 2 else ("h2", "h1")), 0.03) for index in range(MIN_OTHERS)]
    assert [v.flagged is not None for v in verdicts] == [False] * (MIN_OTHERS - 1) + [True]
    evidence = verdicts[-1].flagged  # the others' agreements complete the case
    assert evidence.peer == "liar" and evidence.cusum == PARTNERS and evidence.replies == MIN_CHECKED
    assert "disagreed on spot checks with 2 replicas" in evidence.describe()
    _honest(judge, ["h1", "h2"], 32, rng)
    for index in range(8):  # flagged once; the honest ones never (h2 was accused by the liar alone)
        assert judge.compare(0, "liar", f"h{1 + index % 2}", 1.0).flagged is None
        assert judge.compare(0, f"h{1 + index % 2}", "liar", 1.0).flagged is None


def test_a_worker_is_named_only_after_enough_of_its_replies_were_checked():
    judge, rng = SpotJudge(TOLERANCE), random.Random(7)
    _honest(judge, ["h1", "h2"], MIN_OTHERS, rng)
    verdicts = [judge.compare(0, "liar", f"h{1 + index % 2}", 1.0) for index in range(MIN_CHECKED)]
    assert [v.flagged is not None for v in verdicts] == [False] * (MIN_CHECKED - 1) + [True]


def test_an_honest_replica_disagreeing_now_and_then_while_drift_jumps_is_not_named():
    judge, rng = SpotJudge(TOLERANCE), random.Random(5)
    _honest(judge, ["a", "b", "c"], 30, rng)
    for _ in range(3):  # a burst right after a step: a's replies past the bar, with both vouched witnesses
        assert not judge.compare(0, "a", "b", 0.45).agreed
        assert judge.compare(0, "a", "c", 0.45).flagged is None  # its replies mostly agreed before
    burst = SpotJudge(TOLERANCE)  # the stage's first steps: a burst before anything agreed much
    burst.compare(0, "b", "c", 0.0)
    burst.compare(0, "c", "b", 0.0)
    for _ in range(3):
        assert burst.compare(0, "a", "b", 0.4).flagged is None and burst.compare(0, "a", "c", 0.4).flagged is None


def test_with_two_replicas_disagreements_are_counted_and_no_one_is_named():
    judge = SpotJudge(TOLERANCE)
    for index in range(50):
        verdict = judge.compare(0, "a" if index % 2 else "b", "b" if index % 2 else "a", 1.0)
        assert not verdict.agreed and verdict.flagged is None


@pytest.mark.parametrize("lie_in_checks", [False, True])
@pytest.mark.parametrize("peers,liars", [(["h1", "h2", "l1"], {"l1"}), (["h1", "h2", "h3", "l1"], {"l1"}),
                                         (["h1", "h2", "l1", "l2"], {"l1", "l2"})])
def test_liars_are_named_and_never_an_honest_replica_whatever_the_order_of_checks(peers, liars, lie_in_checks):
    """Liars lie in every training Forward, and in their held-out answers or not. Two liars of four
    that lie in their checks too make the stage's other checks disagree often: they may hide each
    other then; otherwise every liar is named. Never an honest replica."""
    judge, rng, named = SpotJudge(TOLERANCE), random.Random(3), set()
    for _ in range(400):
        primary, checker = rng.sample(peers, 2)
        if primary in named or checker in named:
            continue  # excluded from the run
        lying = primary in liars or (lie_in_checks and checker in liars)
        verdict = judge.compare(0, primary, checker, rng.uniform(0.8, 1.2) if lying else rng.uniform(0.0, 0.06))
        if verdict.flagged is not None:
            named.add(verdict.flagged.peer)
    assert named <= liars and (named == liars or (lie_in_checks and len(liars) == 2)), named


def test_a_stage_drifting_as_a_whole_names_no_one():
    """Every pair of honest replicas stands past the bar half the time, at random (a stage's first
    steps; real drift moves the pairs together, which is kinder): runs of bad luck name no one."""
    for seed in range(50):
        judge, rng = SpotJudge(TOLERANCE), random.Random(seed)
        for _ in range(400):
            primary, checker = rng.sample(["a", "b", "c"], 2)
            verdict = judge.compare(0, primary, checker, rng.choice([0.0, 0.4]) + rng.uniform(0.0, 0.05))
            assert verdict.flagged is None, seed


def test_honest_replicas_under_real_averaging_drift_never_disagree_and_a_replayed_or_shuffled_output_does():
    torch.set_num_threads(1)
    data, training, judge = build_data(CONFIG), WatchedTraining(), SpotJudge(TOLERANCE)
    previous, honest, lies = None, [], []
    for _ in range(90):
        training.train(1, data)
        stages = training.pipeline.stages
        for micro in data.train.unit(5000 + training.steps_done).chunk(MICROBATCHES)[:2]:
            tokens = micro[:, :-1]
            with torch.no_grad():
                wire = stages["h"](tokens)
                first, second = stages["b0"](tokens, wire), stages["b1"](tokens, wire)
            verdict = judge.compare(1, "b0", "b1", output_distance(first, second))
            honest.append(verdict)
            if training.steps_done > 40:  # the first steps' fast drift out of the window
                for lie in (previous, second.roll(1, dims=0)):
                    if lie is not None and lie.shape == first.shape:
                        lies.append((training.steps_done, round(output_distance(first, lie), 3), round(judge.reference(1)[1], 3)))
            previous = second
    assert all(verdict.agreed for verdict in honest), max(verdict.distance for verdict in honest)
    assert lies and all(d > bar for _, d, bar in lies), [x for x in lies if x[1] <= x[2]]


def _view(peer: str, *, in_flight: int = 0) -> WorkerView:
    return WorkerView(peer, f"127.0.0.1:{len(peer)}", 0, announced_credits=2, in_flight=in_flight)


def test_a_check_goes_to_another_replica_with_a_credit_free_and_is_skipped_and_counted_when_none_has_one():
    stats = TrainerStats()
    checks = SpotChecks(1.0, SpotJudge(TOLERANCE), WireCodec(), stats, flag=lambda evidence: None,
                        rng=random.Random(4))
    primary = _view("a")
    assert checks.checker(primary, [primary], 0.0) is None  # alone: nothing to compare with, nothing skipped
    chosen = {checks.checker(primary, [primary, _view("b"), _view("c"), _view("d", in_flight=2)], 0.0).peer_id
              for _ in range(40)}
    assert chosen == {"b", "c"}
    assert checks.checker(primary, [primary, _view("d", in_flight=2)], 0.0) is None
    assert sample_value(stats.registry, "agora_trainer_spot_checks_skipped_total", {"stage": "0"}) == 1
    off = SpotChecks(0.0, SpotJudge(TOLERANCE), WireCodec(), stats, flag=lambda evidence: None)
    assert off.checker(primary, [primary, _view("b")], 0.0) is None
