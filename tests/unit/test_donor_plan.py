"""Whom a joiner (or an export) downloads a stage's state from: the step the members agree on, not
the highest step one member says about itself (node/membership/state_download.py's `plan_donors`)."""

import random

from agora.dht.records import WorkerRecord
from agora.node.membership.state_download import plan_donors

GAP = 256


def _record(peer: str, step: int, stage: int = 1, phase: str = "member", queue: int = 0) -> WorkerRecord:
    return WorkerRecord(peer_id=peer, run_id="run", endpoint=f"127.0.0.1:{1000 + len(peer)}", stage=stage,
                        n_stages=2, throughput=1.0, queue_depth=queue, step=step, phase=phase, version="x",
                        updated_at=0.0, fingerprint="f")


def _plan(by_stage, stage=1, seed=0):
    return plan_donors(by_stage, stage, "me", random.Random(seed), max_gap=GAP)


def test_a_member_announcing_step_10_9_is_never_asked_and_the_closest_to_the_median_come_first():
    stage = [_record("me", 500), _record("liar", 10**9), _record("a", 498), _record("b", 501, queue=3),
             _record("c", 501), _record("syncing", 520, phase="weight_sync")]
    for seed in range(20):
        plan = _plan({1: stage}, seed=seed)
        assert plan.agreed_step == 501  # the median of liar, a, b, c (the lower of the two middle ones)
        assert [d.peer_id for d in plan.donors] == ["c", "b", "a"]  # distance 0 (least queued first), then 3
        assert [d.peer_id for d in plan.outliers] == ["liar"]
        assert plan.far_from_agreement(10**9) and not plan.far_from_agreement(501 + GAP)


def test_a_stage_of_two_members_takes_the_step_the_run_agrees_on():
    """Two members have no majority between them: a liar announcing a step far below or above the
    honest one would otherwise win the median; every stage's members count the same batches."""
    head = [_record(f"h{i}", 5000 + i, stage=0) for i in range(3)]
    for lie in (0, 10**9):
        plan = _plan({0: head, 1: [_record("honest", 5001), _record("liar", lie)]})
        assert [d.peer_id for d in plan.donors] == ["honest"] and [d.peer_id for d in plan.outliers] == ["liar"]
        assert plan.agreed_step == 5001


def test_three_members_of_the_stage_outvote_the_other_stages():
    plan = _plan({0: [_record("h", 90_000, stage=0)], 1: [_record("a", 10), _record("b", 11), _record("c", 12)]})
    assert plan.agreed_step == 11 and [d.peer_id for d in plan.donors][0] == "b" and not plan.outliers


def test_an_empty_stage_has_no_donor_and_ties_spread_joiners_over_the_donors():
    assert _plan({0: [_record("h", 7, stage=0)], 1: []}).donors == ()
    assert _plan({}).agreed_step is None
    stage = [_record(name, 40) for name in "abcd"]
    firsts = {_plan({1: stage}, seed=seed).donors[0].peer_id for seed in range(40)}
    assert firsts == set("abcd")
