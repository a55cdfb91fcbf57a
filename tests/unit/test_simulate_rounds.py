"""The simulator's averaging matchmaking and a newcomer's first reads and record, against closed forms."""

import pytest

from agora.node.simulate.scenario import scenario_from_dict
from agora.node.simulate.swarm import SimSwarm, simulate
from agora.pipeline.schema import ConfigError

OP_CPU_S, OP_LATENCY_S = 0.010, 0.001


def _stage_alone(replicas: int, window_s: float = 3.0, **averaging):
    """One stage's replicas stepping every second, a round every step, each matchmaking DHT operation
    10 ms of CPU on 2 shared cores and 1 ms of latency; returns the swarm after 3.5 s (rounds 1-3)."""
    swarm = SimSwarm(scenario_from_dict({
        "run": {"seconds": 3.5, "stages": 1, "batch_s": 1.0},
        "compute": {"ms": [1.0], "shared_cores": 2},
        "workers": {"replicas": replicas},
        "dht": {"base_ms": OP_LATENCY_S * 1000, "cpu_ms_at": [[4.0, OP_CPU_S * 1000]]},
        "averaging": {"method": "sparta", "every_steps": 1, "fraction": 0.5, "vector_bytes": 0,
                      "matchmaking_dht_ops": 4, "matchmaking_s": window_s, **averaging},
    }))
    swarm.run()
    return swarm


def test_a_full_group_forms_when_the_last_replica_has_made_its_matchmaking_operations():
    """4 replicas start together: 8 operations at once share 2 cores (40 ms each, then 1 ms of
    latency), twice (two at a time): every member's group forms 82 ms after its start, all 4 in it."""
    rounds = _stage_alone(4).rounds.log
    assert [r.number for r in rounds] == [1, 2, 3]
    for r in rounds:
        assert r.committed and r.group == 4
        assert r.formations == pytest.approx([2 * (8 * OP_CPU_S / 2 + OP_LATENCY_S)] * 4)


def test_the_all_reduce_takes_every_members_cpu_on_the_shared_cores_after_the_group_forms():
    """4 members, each 2 ms per other member and 10 ns per byte it sends (2 x 100 kB x 3/4 = 150 kB:
    1.5 ms): 7.5 ms each, 30 ms on 2 cores = 15 ms after the group formed, then the 150 kB over the
    default link (no round trip)."""
    swarm = _stage_alone(4, vector_bytes=100_000, allreduce_cpu_ms_per_peer=2.0, allreduce_cpu_ns_per_byte=10.0)
    assert swarm.rounds.allreduce_cpu_s(4) == pytest.approx(0.0075)
    assert swarm.rounds.allreduce_cpu_s(1) == 0.0
    link = next(iter(swarm.workers.values())).link.kind
    transfer = 150_000 * 8 / (min(link.up_mbit, link.down_mbit) * 1e6)
    assert link.rtt_ms == 0.0
    for r in swarm.rounds.log:
        assert [d - f for d, f in zip(r.durations, r.formations)] == pytest.approx([4 * 0.0075 / 2 + transfer] * 4)


def test_hivemind_s_measured_matchmaking_cpu_comes_after_the_dht_operations_with_one_reads_latency():
    """4 replicas, 2 DHT operations each (8 x 10 ms on 2 cores: 40 ms, then 1 ms), then 30 ms of matchmaking CPU
    at 4 live replicas each (4 x 30 ms on 2 cores: 60 ms) and one read's 1 ms: 102 ms."""
    rounds = _stage_alone(4, matchmaking_dht_ops=2, matchmaking_cpu_ms_at=[[2.0, 10.0], [4.0, 30.0]]).rounds.log
    assert [r.group for r in rounds] == [4, 4, 4]
    for r in rounds:
        assert r.formations == pytest.approx([8 * OP_CPU_S / 2 + OP_LATENCY_S + 4 * 0.030 / 2 + OP_LATENCY_S] * 4)


def test_a_matchmaking_cpu_table_must_grow_in_replicas():
    with pytest.raises(ConfigError, match="matchmaking_cpu_ms_at: node counts must be >= 1 and increasing"):
        _stage_alone(2, matchmaking_cpu_ms_at=[[4.0, 30.0], [2.0, 10.0]])


def test_a_window_shorter_than_the_matchmaking_leaves_every_replica_alone():
    rounds = _stage_alone(4, window_s=0.05).rounds.log
    assert len(rounds) == 12 and not any(r.committed for r in rounds)
    assert {r.group for r in rounds} == {1}


def test_a_replica_that_counts_itself_alone_makes_no_matchmaking():
    rounds = _stage_alone(1).rounds.log
    assert [(r.group, r.committed, r.seconds) for r in rounds] == [(1, False, 0.0)] * 3


def test_one_stage_alone_needs_a_batch_clock():
    with pytest.raises(ConfigError, match="run.stages: a pipeline needs 2"):
        scenario_from_dict({"run": {"stages": 1}, "compute": {"ms": [1.0]}})


def _newcomer(get_ms: float, store_ms: float, rtt_ms: float, **churn):
    """Admission 1.5 s, one read of every stage's records and `plan_donors` names one of its stage's
    two members, then its record's store."""
    result = simulate(scenario_from_dict({
        "run": {"seconds": 10.0, "stages": 3, "batch_s": 1.0},
        "compute": {"ms": [1.0, 1.0, 1.0]},
        "links": [{"name": "wan", "up_mbit": 100.0, "down_mbit": 100.0, "rtt_ms": rtt_ms}],
        "workers": {"replicas": 2},
        "dht": {"get_ms_at": [[8.0, get_ms]], "store_ms_at": [[8.0, store_ms]]},
        "averaging": {"method": "none"},
        "churn": {"admission_s": 1.5, "join_dht_ops": 1, "join_at_s": [5.0], "state_bytes": 0, **churn},
    }))
    newcomer, = result.newcomers
    return newcomer


def test_a_newcomer_names_a_donor_after_its_reads_and_is_visible_once_a_holder_has_its_record():
    """The store's lookup is a read's (200 ms), then half a round trip (50 ms) to the holders: others
    can read the record then, though the slowest holder keeps the store from returning for 9 s."""
    newcomer = _newcomer(200.0, 9000.0, 100.0)
    assert newcomer.stage == 0 and newcomer.started_s == 5.0
    assert newcomer.to_donor_s == pytest.approx(1.7)
    assert newcomer.to_visible_s == pytest.approx(1.7 + 0.25)


def test_a_store_that_returns_before_its_lookup_and_trip_would_is_visible_when_it_returns():
    assert _newcomer(200.0, 220.0, 100.0).to_visible_s == pytest.approx(1.7 + 0.22)


def test_a_newcomers_first_reads_each_open_their_connections_first():
    """Two reads one after the other, each after 4 round trips of 100 ms opening its connections: the
    donor is named 2 x (0.4 + 0.2) s after admission, and the record's store follows."""
    newcomer = _newcomer(200.0, 9000.0, 100.0, join_dht_ops=2, dial_rtts=4)
    assert newcomer.to_donor_s == pytest.approx(1.5 + 2 * (0.4 + 0.2))
    assert newcomer.to_visible_s == pytest.approx(newcomer.to_donor_s + 0.25)


def test_measured_start_offsets_set_the_replicas_starts_apart_and_the_first_waits_for_the_last():
    """Each replica's start of a round is delayed by one of the measured offsets, drawn: with no
    matchmaking operations a group forms as its last member starts, so a member's formation is how
    far it started before the last one (0 for the last)."""
    rounds = _stage_alone(2, matchmaking_dht_ops=0, start_offsets_s=[0.0, 0.3]).rounds.log
    assert [r.group for r in rounds] == [2, 2, 2]
    for r in rounds:
        assert sorted(r.formations) in ([0.0, 0.0], pytest.approx([0.0, 0.3]))
    assert any(max(r.formations) == pytest.approx(0.3) for r in rounds)  # this seed draws apart at least once
    together = _stage_alone(2, matchmaking_dht_ops=0).rounds.log
    assert all(r.formations == (0.0, 0.0) for r in together)


def test_a_start_offset_must_be_a_finite_number_of_seconds_at_least_0():
    with pytest.raises(ConfigError, match="start_offsets_s"):
        _stage_alone(2, start_offsets_s=[0.1, -0.2])
