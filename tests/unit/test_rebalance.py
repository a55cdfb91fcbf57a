"""Rebalancing decisions (node/membership/rebalance.py), pure: who moves where, and that nothing moves back."""

from __future__ import annotations

import itertools

import pytest

from agora.dht.records import WorkerRecord
from agora.auth.policy import jobs_per_microbatch
from agora.node.membership.rebalance import (Move, RebalancePolicy, moved_argv, plan_move,
                                         stage_coverage)

POLICY = RebalancePolicy()


def _record(peer: str, stage: int, rate: float = 1000.0, phase: str = "member", n_stages: int = 2) -> WorkerRecord:
    """A replica whose compute covers `rate` tokens/s of its stage's pipeline work: it announces that
    times the jobs a token costs its stage (a head or body runs Forward and Backward)."""
    return WorkerRecord(peer_id=peer, run_id="r", endpoint="127.0.0.1:1", stage=stage, n_stages=3,
                        throughput=rate * jobs_per_microbatch(stage, n_stages), queue_depth=0, step=10, phase=phase,
                        version="x", updated_at=0.0, fingerprint="f")


def _by_stage(records):
    by_stage = {}
    for record in records:
        by_stage.setdefault(record.stage, []).append(record)
    return by_stage


def _moves(records, n_stages=2):
    """Every worker's own plan: {peer: Move}."""
    by_stage = _by_stage(records)
    plans = {r.peer_id: plan_move(by_stage, n_stages, r.peer_id, r.phase, POLICY) for r in records}
    return {peer: plan for peer, plan in plans.items() if plan is not None}


def test_three_against_one_moves_exactly_the_slowest_member_to_the_short_stage():
    records = [_record("a", 0, 1000), _record("b", 0, 900), _record("c", 0, 1100), _record("d", 1, 1000)]
    moves = _moves(records)
    assert list(moves) == ["b"] and moves["b"].target == 1 and "slowest" in moves["b"].why


def test_a_stage_with_nobody_gets_one_of_two_and_a_stage_is_never_emptied():
    assert list(_moves([_record("a", 0), _record("b", 0)])) == ["a"]  # ties by peer id
    assert _moves([_record("a", 0)]) == {}  # the last member of a stage stays


def test_two_against_one_does_not_move_it_would_only_flip_the_imbalance():
    assert _moves([_record("a", 0), _record("b", 0), _record("c", 1)]) == {}


def test_after_any_move_nobody_moves_back():
    """Hysteresis: for every layout of up to 5 equal or unequal replicas on 3 stages, apply the planned
    move, then no worker of the swarm may plan the move back to where the mover came from."""
    speeds = (600.0, 1000.0, 1500.0)
    for n in range(2, 6):
        for stages in itertools.product(range(3), repeat=n):
            records = [_record(f"w{i}", s, speeds[i % 3], n_stages=3) for i, s in enumerate(stages)]
            moves = _moves(records, n_stages=3)
            assert len(moves) <= len({r.stage for r in records})  # at most one mover per stage
            for peer, move in moves.items():
                source = next(r.stage for r in records if r.peer_id == peer)
                after = [_record(r.peer_id, move.target if r.peer_id == peer else r.stage,
                                 r.throughput / jobs_per_microbatch(r.stage, 3), n_stages=3) for r in records]
                back = [m for p, m in _moves(after, n_stages=3).items()
                        if next(r.stage for r in after if r.peer_id == p) == move.target and m.target == source]
                assert back == [], (stages, peer, move)


def test_syncing_replicas_count_and_an_unmeasured_one_counts_as_the_median():
    # Stage 1 has a joiner still in weight sync (throughput not measured yet): 2 vs 2, nobody moves.
    records = [_record("a", 0), _record("b", 0), _record("c", 1), _record("d", 1, 0.0, "weight_sync")]
    assert stage_coverage(_by_stage(records), 2) == {0: 2000.0, 1: 2000.0}
    assert _moves(records) == {}
    # Only members move, and leaving or serving replicas cover nothing.
    records = [_record("a", 0, phase="optimizer_sync"), _record("b", 0), _record("c", 0, phase="leaving"),
               _record("s", 1, phase="serving")]
    assert _moves(records) == {}
    assert stage_coverage(_by_stage(records), 2) == {0: 2000.0, 1: 0.0}


def test_stages_are_compared_per_job_a_token_costs_them():
    # A head announces its rate per job, and a token costs it two (Forward, Backward); the tail's
    # Forward does both. Two heads at 2000 and a tail at 1000 cover the same: nobody moves...
    records = [_record("h1", 0, 1000), _record("h2", 0, 1000), _record("t1", 1, 1000)]
    assert [r.throughput for r in records] == [2000.0, 2000.0, 1000.0]
    assert stage_coverage(_by_stage(records), 2) == {0: 2000.0, 1: 1000.0}
    assert _moves(records) == {}
    # ...and a tail that is slower per token than a head gets a replica from three heads.
    records = [_record("h1", 0, 1000), _record("h2", 0, 1000), _record("h3", 0, 1000), _record("t1", 1, 700)]
    assert list(_moves(records)) == ["h1"] and _moves(records)["h1"] == Move(1, _moves(records)["h1"].why)


def test_the_policy_refuses_settings_that_could_oscillate():
    with pytest.raises(ValueError, match="no move back"):
        RebalancePolicy(min_ratio=1.2, slack=0.25)


def test_the_moved_command_line_names_the_new_stage_and_keeps_the_identity():
    argv = ["--log-level", "INFO", "join", "--stage", "0", "--join-file", "j.json", "--resume-step", "40",
            "--ready-file", "r"]
    assert moved_argv(argv, 2, "/state/w") == ["--log-level", "INFO", "join", "--stage", "2", "--state-dir", "/state/w",
                                               "--join-file", "j.json", "--ready-file", "r"]
    assert moved_argv(["join", "--stage=1", "--state-dir", "s", "--insecure"], 0, "s") == \
        ["join", "--stage", "0", "--state-dir", "s", "--insecure"]
    assert moved_argv(["join", "--insecure"], 1, None) == ["join", "--stage", "1", "--insecure"]


def test_nobody_plans_a_move_while_another_is_in_transit():
    from agora.dht.records import MoveRecord

    records = [_record("a", 0), _record("b", 0), _record("c", 0), _record("d", 1)]
    by_stage = _by_stage(records)
    transit = MoveRecord(peer_id="e", run_id="r", from_stage=0, to_stage=1, started_at=0.0)
    assert plan_move(by_stage, 2, "a", "member", POLICY, moving=[transit]) is None
    assert plan_move(by_stage, 2, "a", "member", POLICY, moving=[]) is not None
    # Its own announcement holds it back too: it is the move under way, just arrived.
    own = MoveRecord(peer_id="a", run_id="r", from_stage=1, to_stage=0, started_at=0.0)
    assert plan_move(by_stage, 2, "a", "member", POLICY, moving=[own]) is None


def test_an_unmeasured_replica_counts_as_its_stages_typical_one():
    # A tail joiner not measured yet counts as the tail's median (1000), not the run's (2000 for heads).
    records = [_record("h1", 0, 3000), _record("h2", 0, 3000), _record("t1", 1, 1000),
               _record("t2", 1, 0.0, "weight_sync")]
    assert stage_coverage(_by_stage(records), 2) == {0: 6000.0, 1: 2000.0}
