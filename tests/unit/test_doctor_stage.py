"""The doctor's verdicts on the stage it would join (node/doctor_stage.py): the links to its members
and the share of its microbatches; and on the pipeline (node/doctor_pipeline.py): each stage's
capacity and the bottleneck with this machine on its stage; without sockets or devices."""

from __future__ import annotations

import json
import random

import pytest

from agora.auth.join_check import sample_members, stage_capacity
from agora.node.doctor import OK, UNKNOWN, WARN, as_json, exit_code, format_line
from agora.node.doctor_pipeline import (bottleneck, bottleneck_check, capacity_with, pipeline_checks, stage_rates)
from agora.node.doctor_stage import MemberLink, ProbedLink, member_link_checks, predicted_share, share_check
from agora.node.trainer import routing
from agora.protos import authorizer_adapter as adapter


def test_equal_members_share_the_stage_equally_whatever_the_batch_divides():
    assert predicted_share(10.0, [10.0, 10.0], 6, 2) == pytest.approx(1 / 3)
    assert predicted_share(10.0, [10.0] * 5, 4, 2) == pytest.approx(1 / 6)  # ties fall on each replica in turn
    assert predicted_share(10.0, [10.0], 1, 2) == pytest.approx(1 / 2)


def test_the_share_is_the_routings_own_rule(monkeypatch):
    """A machine 1.8x slower than its members shares equally within the routing's slack; with a
    slack of 1 the same routing gives it only what it finishes first."""
    assert predicted_share(5.5, [10.0, 10.0], 6, 2) == pytest.approx(1 / 3)
    monkeypatch.setattr(routing, "BALANCE_SLACK", 1.0)
    assert predicted_share(5.5, [10.0, 10.0], 6, 2) == pytest.approx(1 / 6)


def test_a_machine_over_the_slack_slower_gets_less_and_a_faster_one_more():
    assert predicted_share(4.0, [10.0, 10.0], 4, 2) < 1 / 3
    assert predicted_share(30.0, [10.0, 10.0], 8, 2) > 1 / 3


def test_the_share_line_names_the_members_and_this_machines_compute():
    check = share_check(1, 10.0, [10.0, 12.0], 6, 2)
    assert check.verdict == OK and check.name == "share stage 1" and check.unit == "%"
    assert "would take about 33% of stage 1's microbatches (2 members at 10-12 samples/s; this machine 10 " \
           "samples/s)" in check.detail
    assert format_line(check).startswith("ok      share stage 1    33.3 % - would take about 33%")


def test_the_stages_slowest_by_more_than_the_slack_is_warned_and_does_not_fail():
    slow = share_check(0, 4.0, [10.0, 10.0], 4, 2)
    assert slow.verdict == WARN and "the stage's slowest, over 2x slower" in slow.detail and slow.fix
    assert exit_code([slow]) == 0
    assert share_check(0, 6.0, [10.0, 10.0], 4, 2).verdict == OK  # slowest, within the slack
    assert share_check(0, 4.0, [3.0, 10.0], 4, 2).verdict == OK  # over 2x slower than the fastest, not the slowest


def test_no_members_means_all_of_the_stage_and_unknown_compute_is_said():
    alone = share_check(2, 10.0, [], 4, 2)
    assert alone.verdict == OK and alone.value == 100.0 and "no current members" in alone.detail
    blind = share_check(2, 10.0, [0.0, 0.0], 4, 2)
    assert blind.verdict == UNKNOWN and "does not know" in blind.detail


def test_member_links_are_judged_against_the_runs_rtt_floor_and_warn_with_a_fix():
    links = [MemberLink("10.0.0.1:7100", 12.34), MemberLink("10.0.0.2:7100", 95.0),
             MemberLink("10.0.0.3:7100", None, "no answer within 3 s")]
    near, far, gone = member_link_checks(1, links, 80.0)
    assert (near.name, near.verdict, near.value, near.floor, near.unit) == ("member 1", OK, 12.3, 80.0, "ms")
    assert "stage 1's member 10.0.0.1:7100" in near.detail and not near.fix
    assert far.verdict == WARN and "nearer the swarm" in far.fix
    assert gone.verdict == WARN and gone.value == "10.0.0.3:7100" and "no answer within 3 s" in gone.detail
    assert "outbound TCP" in gone.fix
    assert exit_code([near, far, gone]) == 0
    report = json.loads(as_json([near, far, gone]))
    assert [row["verdict"] for row in report["checks"]] == ["ok", "WARN", "WARN"] and report["exit_code"] == 0


def test_a_probed_member_shows_the_probes_round_trip_and_its_rates_against_the_floors():
    """With a probe credential each member has an upload and a download line beside its round trip,
    which is the probe's (a gRPC message each way); below a floor is a WARN with the fix; a probe
    that measured nothing leaves the rates unknown with its reason, and the connect's round trip."""
    links = [MemberLink("10.0.0.1:7100", 12.0, probe=ProbedLink(10.04, 250.0, 80.0)),
             MemberLink("10.0.0.2:7100", 30.0, probe=ProbedLink(error="RESOURCE_EXHAUSTED: busy"))]
    checks = member_link_checks(1, links, 80.0, min_upload_mbit=100.0, min_download_mbit=100.0)
    assert [check.name for check in checks] == ["member 1", "member 1 upload", "member 1 download",
                                                "member 2", "member 2 upload", "member 2 download"]
    rtt, up, down, busy_rtt, busy_up, busy_down = checks
    assert (rtt.verdict, rtt.value, rtt.unit) == (OK, 10.0, "ms") and "a gRPC message each way" in rtt.detail
    assert (up.verdict, up.value, up.floor, up.unit) == (OK, 250.0, 100.0, "Mbit/s")
    assert "upload rate to stage 1's member 10.0.0.1:7100" in up.detail
    assert down.verdict == WARN and down.value == 80.0 and "faster downlink" in down.fix
    assert "under the run's floor" in down.detail
    assert busy_rtt.verdict == OK and busy_rtt.value == 30.0 and "TCP connect" in busy_rtt.detail
    assert busy_up.verdict == busy_down.verdict == UNKNOWN and "RESOURCE_EXHAUSTED: busy" in busy_up.detail
    assert exit_code(checks) == 0
    (unfloored,) = [c for c in member_link_checks(0, links[:1], float("inf")) if c.name == "member 1 download"]
    assert unfloored.verdict == OK and unfloored.floor is None  # a run without a download floor
    assert [c.name for c in member_link_checks(0, [MemberLink("h:1", 5.0)], 80.0)] == ["member 1"]  # no probe


def test_without_an_rtt_floor_every_answering_member_is_ok():
    (check,) = member_link_checks(0, [MemberLink("h:1", 500.0)], float("inf"))
    assert check.verdict == OK and check.floor is None


def test_the_authorizer_shows_at_most_a_sample_of_the_members():
    members = [adapter.StageMember(f"10.0.0.{i}:7100", float(i)) for i in range(9)]
    shown = sample_members(members, 5, random.Random(0))
    assert len(shown) == 5 and len(set(shown)) == 5 and set(shown) <= set(members)
    assert sample_members(members[:3], 5, random.Random(0)) == tuple(members[:3])


def test_a_dry_runs_members_survive_the_wire():
    check = adapter.JoinCheck(stage=1, members=(adapter.StageMember("10.0.0.1:7100", 4.5),),
                              member_samples_per_s=(4.5, 0.0))
    assert adapter.from_message(adapter.to_message(check)) == check



def test_a_precomputed_share_is_the_one_shown():
    assert share_check(1, 10.0, [10.0, 12.0], 6, 2, share=0.25).value == 25.0


def test_the_authorizer_sums_up_a_stage_its_members_and_their_compute():
    members = [adapter.StageMember("a:1", 10.0), adapter.StageMember("b:1", 0.0), adapter.StageMember("c:1", 5.0)]
    assert stage_capacity(2, members) == adapter.StageCapacity(2, members=3, unknown_members=1, samples_per_s=15.0)
    assert stage_capacity(0, []) == adapter.StageCapacity(0, members=0, unknown_members=0, samples_per_s=0.0)


def test_a_stages_capacity_is_its_members_microbatches_per_s_two_jobs_each_but_the_last():
    stages = [adapter.StageCapacity(0, 2, 0, 40.0), adapter.StageCapacity(1, 1, 0, 10.0),
              adapter.StageCapacity(2, 2, 1, 7.0)]
    assert stage_rates(stages, 2) == [10.0, 2.5, None]  # 40/(2*2), 10/(2*2), a member of unknown compute
    assert stage_rates(stages[:2], 2) == [10.0, 5.0]  # stage 1 is the last: one job per microbatch


def test_the_bottleneck_is_the_stage_of_least_capacity_and_a_stage_without_members_whatever_the_unknowns():
    assert bottleneck([3.0, 1.0, 1.0]) == 1
    assert bottleneck([None, 2.0]) is None
    assert bottleneck([None, 0.0, 2.0]) == 1


def test_a_stages_capacity_with_this_machine_follows_the_routings_share():
    assert capacity_with(10.0, 5.0, 1 / 3) == pytest.approx(15.0)  # each finishes its part together
    assert capacity_with(20.0, 6.0, 1 / 3) == pytest.approx(18.0)  # an equal share it finishes late: slower
    assert capacity_with(20.0, 6.0, 0.0) == 20.0 and capacity_with(0.0, 6.0, 1.0) == 6.0


def test_a_stage_that_is_not_the_bottleneck_names_the_one_that_needs_this_machine_more():
    check = bottleneck_check(0, [10.0, 4.0], 15.0)
    assert (check.name, check.verdict, check.value, check.floor) == ("bottleneck", OK, 15.0, 4.0)
    assert "the pipeline's bottleneck is stage 1 (4 microbatches/s); stage 0 would go from 10 to 15 " \
           "microbatches/s with this machine" in check.detail
    assert "stage 1 needs this machine more (--stage 1)" in check.detail and not check.fix
    assert format_line(check).startswith("ok      bottleneck       15 microbatches/s (bottleneck 4 microbatches/s)")


def test_the_bottleneck_stage_says_whether_it_remains_the_bottleneck_with_this_machine():
    remains = bottleneck_check(1, [10.0, 4.0], 6.0)
    assert remains.verdict == OK and "it is the pipeline's bottleneck and would remain it" in remains.detail
    moves = bottleneck_check(1, [10.0, 4.0], 12.0)
    assert moves.verdict == OK and "stage 0 (10 microbatches/s) would be then" in moves.detail
    assert "needs this machine more" not in remains.detail + moves.detail


def test_a_machine_that_would_slow_the_pipeline_is_warned_and_does_not_fail():
    becomes = bottleneck_check(0, [5.0, 4.0], 3.0)
    assert becomes.verdict == WARN and "it would become the bottleneck, slower" in becomes.detail and becomes.fix
    remains = bottleneck_check(1, [10.0, 4.0], 3.0)
    assert remains.verdict == WARN and "it would remain the bottleneck, slower" in remains.detail
    assert bottleneck_check(0, [20.0, 4.0], 18.0).verdict == OK  # slower, still above the bottleneck
    assert exit_code([becomes, remains]) == 0


def test_unknown_capacities_or_compute_leave_the_bottleneck_unknown():
    blind = bottleneck_check(0, [None, 4.0], 5.0)
    assert blind.verdict == UNKNOWN and "stage 0's capacity is unknown" in blind.detail
    untimed = bottleneck_check(0, [10.0, 0.0], None)
    assert untimed.verdict == UNKNOWN and "bottleneck is stage 1 (0 microbatches/s)" in untimed.detail
    assert "not timed" in untimed.detail
    assert bottleneck_check(0, [10.0, None], 12.0).verdict == UNKNOWN


def test_the_pipeline_lines_from_a_dry_runs_capacities():
    """Stage 0: two members at 10 samples/s each; stage 1, the last: one at 4; microbatches of 2:
    stage 0 at 5 microbatches/s, stage 1 the bottleneck at 2. This machine on stage 0 at 10
    samples/s takes a third: 7.5 microbatches/s, and stage 1 needs it more."""
    stages = (adapter.StageCapacity(0, 2, 0, 20.0), adapter.StageCapacity(1, 1, 0, 4.0))
    share = predicted_share(10.0, [10.0, 10.0], 6, 2)
    checks = pipeline_checks(0, stages, 2, 2, own_samples_per_s=10.0, share=share)
    assert [check.name for check in checks] == ["capacity stage 0", "capacity stage 1", "bottleneck"]
    first, second, verdict = checks
    assert (first.verdict, first.value, first.unit) == (OK, 5.0, "microbatches/s")
    assert "2 members at 20 samples/s in all" in first.detail and "bottleneck" not in first.detail
    assert second.value == 2.0 and second.detail.endswith("the pipeline's bottleneck")
    assert (verdict.verdict, verdict.value, verdict.floor) == (OK, 7.5, 2.0) and "--stage 1" in verdict.detail
    report = json.loads(as_json(checks))
    assert [row["value"] for row in report["checks"]] == [5.0, 2.0, 7.5] and report["exit_code"] == 0


def test_a_stage_without_members_or_of_unknown_compute_is_said():
    stages = (adapter.StageCapacity(0, 2, 2, 0.0), adapter.StageCapacity(1, 0, 0, 0.0))
    blind, empty, verdict = pipeline_checks(0, stages, 2, 2, own_samples_per_s=10.0, share=0.5)
    assert blind.verdict == UNKNOWN and "2 members, 2 of unknown compute" in blind.detail
    assert empty.value == 0.0 and "no members" in empty.detail and "the pipeline's bottleneck" in empty.detail
    assert verdict.verdict == UNKNOWN and "bottleneck is stage 1" in verdict.detail


def test_an_authorizer_without_capacities_or_with_other_stages_leaves_them_unknown():
    (old,) = pipeline_checks(0, (), 2, 2, own_samples_per_s=10.0, share=0.5)
    assert old.verdict == UNKNOWN and "reports no stage capacities" in old.detail
    (other,) = pipeline_checks(0, (adapter.StageCapacity(1),), 2, 2, own_samples_per_s=10.0, share=0.5)
    assert other.verdict == UNKNOWN and "capacities of stages [1], the run has 2" in other.detail


def test_a_dry_runs_capacities_survive_the_wire():
    check = adapter.JoinCheck(stage=0, stage_capacities=(adapter.StageCapacity(0, 2, 1, 4.5),
                                                         adapter.StageCapacity(1)))
    assert adapter.from_message(adapter.to_message(check)) == check
