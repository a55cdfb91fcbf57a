"""The doctor's verdicts on the stage it would join (node/doctor_stage.py): the links to its members
and the share of its microbatches, without sockets or devices."""

from __future__ import annotations

import json
import random

import pytest

from agora.auth.join_check import sample_members
from agora.node.doctor import OK, UNKNOWN, WARN, as_json, exit_code, format_line
from agora.node.doctor_stage import MemberLink, member_link_checks, predicted_share, share_check
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

