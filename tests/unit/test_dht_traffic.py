"""bench/dht_traffic.py: which requests each role sends and how often, the schedule that plays them,
and the dilation arithmetic that reads a stretched window back in logical minutes."""

import dataclasses
import random

import pytest

from agora.bench.dht_peer import ACTIONS
from agora.bench.dht_traffic import (ROLES, Dilation, Timetable, TrafficModel, check_rows, first_due_s, peer_rates,
                                     role_actions, swarm_rates)
from agora.bench.many_nodes import geometry_for

MODEL = TrafficModel()


def test_each_role_sends_its_families_at_the_codes_rates():
    worker = peer_rates(role_actions("worker", MODEL))
    assert worker["store workers"] == pytest.approx(1 / 5) and worker["call bans"] == pytest.approx(1 / 5)
    assert worker["store rounds"] == pytest.approx(2 * 0.27)
    assert worker["get units"] == pytest.approx(1 / (0.5 + 0.12))
    assert worker["get rounds"] == pytest.approx((1 - 0.27) / (0.75 + 0.12))  # no probes while a round runs
    assert worker["get moves"] == pytest.approx(1 / 30)
    trainer = peer_rates(role_actions("trainer", MODEL))
    assert trainer["store units"] == pytest.approx(2 * 1.05 + 1 / 10)  # claim and commit a batch, renewals
    assert trainer["get units"] == pytest.approx(4 * 1.05)
    assert trainer["get workers"] == pytest.approx(3 / 2)  # every stage, every roster refresh
    assert "store workers" not in trainer and "store trainers" not in worker
    assert peer_rates(role_actions("bootstrap", MODEL)) == {"call bans": pytest.approx(0.2)}


def test_the_reads_all_workers_makes_are_left_out_where_the_nodes_metrics_do_not_time_them():
    assert "get workers" not in peer_rates(role_actions("trainer", MODEL), metered_only=True)
    metered = peer_rates(role_actions("worker", MODEL), metered_only=True)
    assert metered["get workers"] == pytest.approx(1 / MODEL.replicas_period_s)  # the probes' count alone


def test_a_settled_live_count_is_read_every_ten_windows_and_two_replicas_of_a_stage_announce_a_round():
    assert MODEL.replicas_period_s == pytest.approx(30.0 + (0.75 + 0.12) / (1 - 0.27) / 2)
    assert peer_rates(role_actions("worker", MODEL))["store rounds"] == pytest.approx(2 * 0.27)  # R = 2: both
    wide = dataclasses.replace(MODEL, replicas=20)
    assert peer_rates(role_actions("worker", wide))["store rounds"] == pytest.approx(2 * 0.27 * 2 / 20)
    assert swarm_rates(geometry_for(64, 3), MODEL)["store rounds"] < swarm_rates(geometry_for(8, 3), MODEL)["store rounds"] / 5


def test_the_monitor_reads_every_stage_and_the_trainers_each_poll_and_stores_nothing():
    assert peer_rates(role_actions("monitor", MODEL)) == {"get workers": pytest.approx(3 / 2.0),
                                                          "get trainers": pytest.approx(1 / 2.0)}
    assert "get workers" not in peer_rates(role_actions("monitor", MODEL), metered_only=True)  # as `all_workers`


def test_swarm_rates_are_per_dht_peer_over_every_role_and_the_services():
    geometry = geometry_for(8, 3)  # 3x2 + 2t, and the demo's bootstrap and authorizer
    rates = swarm_rates(geometry, MODEL, services=2, metered_only=True)
    assert rates["store workers"] == pytest.approx(6 * 0.2 / 10)
    assert rates["store units"] == pytest.approx(2 * (2 * 1.05 + 0.1) / 10)
    assert rates["call bans"] == pytest.approx(0.2)
    rows = check_rows({"store units": 0.438, "get other": 0.01}, geometry, MODEL, services=2)
    by_name = {name: (modelled, measured) for name, modelled, measured in rows}
    assert by_name["store units"] == (pytest.approx(0.44), 0.438)
    assert by_name["get other"] == (0.0, 0.01) and by_name["get rounds"][1] == 0.0


def test_the_offered_load_per_peer_does_not_grow_with_the_swarm():
    totals = [sum(swarm_rates(geometry_for(n, 3), MODEL).values()) for n in (8, 16, 32, 64)]
    # Past two replicas a stage, two of them announce a round whatever R: the load falls once, then holds.
    assert totals[0] == max(totals) and max(totals[1:]) / min(totals[1:]) < 1.15


def test_a_bad_role_or_model_names_the_field():
    with pytest.raises(ValueError, match="role"):
        role_actions("authorizer", MODEL)
    with pytest.raises(ValueError, match="batches_per_s"):
        TrafficModel(batches_per_s=0)
    with pytest.raises(ValueError, match="rounds_per_s"):
        TrafficModel(rounds_per_s=1.0, round_s=1.0)


def test_every_action_of_the_model_has_a_peer_method():
    names = {action.name for role in ROLES for action in role_actions(role, MODEL)}
    assert names == set(ACTIONS)


def test_dilation_stretches_periods_and_reads_windows_back_per_logical_minute():
    k = Dilation(16)
    assert k.real_s(5.0) == 80.0
    assert k.per_logical_minute(10, real_window_s=160.0) == pytest.approx(60.0)  # 10 in 10 logical s
    # a background of 1/s at rest runs in real time: only the 2/s above it is the (stretched) traffic
    assert k.per_logical_minute(300, 100.0, background_per_s=1.0) == pytest.approx((2 * 16 + 1) * 60)
    assert k.per_logical_minute(50, 100.0, background_per_s=1.0) == pytest.approx(60.0)  # below rest: none
    assert k.ttl_s(15.0, bound_s=240.0) == 240.0 and Dilation(4).ttl_s(15.0, 240.0) == 60.0
    with pytest.raises(ValueError, match="dilation"):
        Dilation(0.5)
    with pytest.raises(ValueError, match="window"):
        k.per_logical_minute(1, 0.0)


def test_a_dilation_is_refused_when_a_stretched_heartbeat_would_outlive_the_records_it_renews():
    assert Dilation(32).problem(MODEL, heartbeat_ttl_bound_s=240.0) is None  # beats 160 s apart
    problem = Dilation(40).problem(MODEL, heartbeat_ttl_bound_s=240.0)
    assert "--dilation" in problem and "at most 38.4" in problem


def test_a_timetable_runs_at_a_fixed_rate_and_a_late_run_restarts_it_from_then():
    table = Timetable(10.0, first_s=3.0)
    assert table.ran(3.5) == 13.0  # a run that takes time does not shift the schedule
    assert table.ran(40.0) == 40.0  # ended long after the next was due: no burst of catch-up runs
    assert table.ran(41.0) == 50.0
    assert Timetable(10.0, 3.0).count_between(0.0, 100.0) == 10
    assert Timetable(10.0, 3.0).count_between(13.0, 34.0) == 3  # 13, 23, 33
    assert Timetable(10.0, 3.0).count_between(14.0, 33.0) == 1  # 23: the end is out
    with pytest.raises(ValueError, match="period"):
        Timetable(0.0, 0.0)


@pytest.mark.parametrize("role", ROLES)
def test_a_dilated_schedule_sends_each_family_at_the_models_rate_over_a_long_run(role):
    dilation, logical_s = Dilation(8), 3600.0
    rng = random.Random(0)
    sent: dict[str, float] = {}
    for action in role_actions(role, MODEL):
        period = dilation.real_s(action.period_s)
        runs = Timetable(period, first_due_s(period, rng)).count_between(0.0, dilation.real_s(logical_s))
        for request in action.requests:
            sent[request.name] = sent.get(request.name, 0.0) + runs * request.count
    for name, rate in peer_rates(role_actions(role, MODEL)).items():
        per_minute = dilation.per_logical_minute(sent[name], dilation.real_s(logical_s))
        assert per_minute == pytest.approx(rate * 60, rel=0.02)


def test_every_action_the_heartbeat_too_first_runs_at_a_random_phase_of_its_period():
    """Peers the harness starts together must not beat in step: a swarm's nodes start apart."""
    rng = random.Random(1)
    phases = [first_due_s(80.0, rng) for _ in range(200)]
    assert 0.0 <= min(phases) and max(phases) <= 80.0 and max(phases) - min(phases) > 40.0
