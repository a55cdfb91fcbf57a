"""The simulator against closed forms, under a seed, and calling the project's own routing.

Each simulation is small (a few simulated seconds of a 3-stage pipeline) so the file runs in seconds."""

import math

import pytest

from agora.node.simulate.scenario import scenario_from_dict
from agora.node.simulate.swarm import SimSwarm, simulate
from agora.node.trainer.inflight import HEADROOM
from agora.node.trainer.routing import BALANCE_SLACK

TOKENS = 256


def _scenario(**sections):
    base = {
        "run": {"seconds": 6.0, "warmup_s": 1.0, "stages": 3, "tokens_per_microbatch": TOKENS, "microbatches": 64},
        "compute": {"ms": [30.0, 30.0, 30.0]},
        "trainers": {"max_in_flight": 32},
        "dht": {"base_ms": 0.0},
        "averaging": {"method": "none"},
    }
    for name, values in sections.items():
        base[name] = values if isinstance(values, list) else {**base.get(name, {}), **values}
    return scenario_from_dict(base)


def test_one_replica_per_stage_runs_at_the_busiest_stages_rate():
    result = simulate(_scenario(compute={"ms": [20.0, 40.0, 30.0]}))
    bound = TOKENS / 0.040  # the pipeline's bound: one microbatch per 40 ms of stage 1
    assert result.tokens_per_s == pytest.approx(bound, rel=0.05)
    assert result.bottleneck.startswith("compute: stage 1")


def test_one_in_flight_runs_at_one_microbatchs_latency():
    """Depth 1: every microbatch alone through 5 calls over 50 ms links, plus its compute."""
    result = simulate(_scenario(trainers={"max_in_flight": 1, "link": "wan"},
                                links=[{"name": "wan", "up_mbit": 1000.0, "down_mbit": 1000.0, "rtt_ms": 50.0}],
                                wire={"forward_bytes_per_token": 0.0, "backward_bytes_per_token": 0.0}))
    latency = 5 * 0.050 + 3 * 0.030 + 2 * 4 * TOKENS * 8 / 1e9  # round trips, compute, the head's token ids
    assert result.tokens_per_s == pytest.approx(TOKENS / latency, rel=0.05)
    assert result.latency_s == pytest.approx(latency, rel=0.01)


def test_the_trainers_uplink_bounds_a_pipeline_whose_frames_outgrow_it():
    """Every frame goes through the trainer: 4 frames of 1,000 bytes per token leave its uplink per
    microbatch (Forward wire to stages 1 and 2, Backward gradients to 1 and 0)."""
    result = simulate(_scenario(trainers={"link": "thin"},
                                links=[{"name": "thin", "up_mbit": 100.0, "down_mbit": 10_000.0, "share": 0.0},
                                       {"name": "fast", "up_mbit": 10_000.0, "down_mbit": 10_000.0}],
                                wire={"forward_bytes_per_token": 1000.0, "backward_bytes_per_token": 1000.0}))
    sent_bits = (4 * 1000.0 * TOKENS + 4 * TOKENS) * 8  # the head's token ids besides
    assert result.tokens_per_s == pytest.approx(TOKENS / (sent_bits / 100e6), rel=0.05)
    assert result.bottleneck.startswith("the trainers' uplinks: 1 busy"), result.bottleneck


def test_an_uplink_bound_trainers_depth_fills_its_pipeline_not_its_own_send_queue():
    """The same thin uplink, the depth adaptive under a cap of 2 global batches (128): a frame's wait
    behind the trainer's other frames is queueing (node/trainer/inflight.py, `WireFloor`), so the
    depth is the unqueued latency over the busiest stage's compute (with its headroom), not what the
    send queue grows to. Counted as latency, the queue fed the depth to the cap (64) and the latency
    to 4 s."""
    result = simulate(_scenario(run={"seconds": 12.0},
                                trainers={"link": "thin", "max_in_flight": None, "max_staleness": 2.0},
                                links=[{"name": "thin", "up_mbit": 100.0, "down_mbit": 10_000.0, "share": 0.0},
                                       {"name": "fast", "up_mbit": 10_000.0, "down_mbit": 10_000.0}],
                                wire={"forward_bytes_per_token": 1000.0, "backward_bytes_per_token": 1000.0}))
    frame_s = 1000.0 * TOKENS * 8 / 100e6  # one activation or gradient frame on the uplink
    alone = 3 * 0.030 + 4 * frame_s  # compute and the four frames it sends: its latency alone
    assert result.latency_s == pytest.approx(alone, rel=0.05)
    assert result.depth_last == [math.ceil(HEADROOM * result.latency_s / 0.030)]
    sent_bits = (4 * 1000.0 * TOKENS + 4 * TOKENS) * 8
    assert result.tokens_per_s == pytest.approx(TOKENS / (sent_bits / 100e6), rel=0.05)


def test_a_seed_gives_the_same_run_and_another_seed_another():
    mixed = {"links": [{"name": "a", "up_mbit": 100.0, "down_mbit": 100.0, "rtt_ms": 40.0, "share": 1.0},
                       {"name": "b", "up_mbit": 1000.0, "down_mbit": 1000.0, "rtt_ms": 5.0, "share": 1.0}],
             "workers": {"replicas": 2, "speed_spread": 0.3}}
    first = simulate(_scenario(run={"seed": 3}, **mixed))
    again = simulate(_scenario(run={"seed": 3}, **mixed))
    other = simulate(_scenario(run={"seed": 4}, **mixed))
    assert first.as_dict() == again.as_dict()
    assert other.tokens_per_s != first.tokens_per_s


def _two_replicas(slowdown: float):
    return simulate(_scenario(workers={"replicas": 2, "slowdown": [1.0, slowdown]}))


def test_routing_gives_a_replica_over_twice_as_slow_only_what_it_finishes_in_time():
    """Beyond BALANCE_SLACK routing.pick_worker takes the earliest finish: the slow replica adds its
    rate to the fast one's. Equal shares would run at twice the slow replica's rate instead."""
    slow = 3.0
    assert slow > BALANCE_SLACK
    result = _two_replicas(slow)
    earliest_finish = TOKENS * (1 / 0.030 + 1 / (0.030 * slow))
    equal_shares = 2 * TOKENS / (0.030 * slow)
    assert result.tokens_per_s == pytest.approx(earliest_finish, rel=0.08)
    assert result.tokens_per_s > 1.5 * equal_shares


def test_routing_balances_shares_between_replicas_within_the_slack():
    """Within BALANCE_SLACK pick_worker gives both replicas equal shares of every global batch, so
    the slower one paces the stage: twice its rate, below what earliest-finish would reach."""
    slow = 1.5
    assert slow < BALANCE_SLACK
    result = _two_replicas(slow)
    equal_shares = 2 * TOKENS / (0.030 * slow)
    assert result.tokens_per_s == pytest.approx(equal_shares, rel=0.08)
    assert result.tokens_per_s < 0.9 * TOKENS * (1 / 0.030 + 1 / (0.030 * slow))


def _killed_at(at: float):
    """3 stages x 2 replicas, a global batch every second, 2 slices every 2 steps, 3 optimizer-sync
    steps; the oldest replica of stage 0 killed at `at` and a newcomer started for it."""
    return simulate(_scenario(run={"seconds": 30.0, "warmup_s": 0.0, "batch_s": 1.0},
                              workers={"replicas": 2},
                              averaging={"method": "sparta", "every_steps": 2, "fraction": 0.5, "vector_bytes": 0,
                                         "optimizer_sync_steps": 3},
                              churn={"admission_s": 0.5, "join_dht_ops": 0, "state_bytes": 0,
                                     "kill_at_s": [at]}))


def test_a_newcomer_behind_the_run_syncs_every_slice_then_warms_then_is_a_member():
    """Killed at 10.2 s, it starts at 10.7 s ten steps behind (past lag_tolerance): weight sync, the
    download, rounds 6 and 7 at steps 12 and 14 bring slices 0 and 1 (14 s), then three steps with
    updates in optimizer sync (17 s): a member 6.8 s after its start."""
    newcomer, = _killed_at(10.2).newcomers
    assert newcomer.to_state_s == pytest.approx(0.5)
    assert newcomer.to_member_s == pytest.approx(17.0 - 10.2)


def test_a_newcomer_within_the_lag_tolerance_is_a_member_at_once():
    newcomer, = _killed_at(1.2).newcomers  # the run is at step 1: entry_phase's lag tolerance (3)
    assert newcomer.to_member_s == pytest.approx(0.5)


def test_shared_cores_share_time_as_an_operating_system_does():
    """Processor sharing: a 0.1 s job beside a 1 s one on one core ends at 0.2 s, not after the long
    one (FIFO) nor at 0.1 s (a core each); the long one at 1.1 s."""
    import simpy

    from agora.node.simulate.host import SharedCores

    env = simpy.Environment()
    cores = SharedCores(env, 1)
    ended = {}

    def job(name, seconds, at=0.0):
        yield env.timeout(at)
        yield from cores.run(seconds)
        ended[name] = env.now

    env.process(job("long", 1.0))
    env.process(job("short", 0.1))
    env.run()
    assert ended == pytest.approx({"long": 1.1, "short": 0.2})
    assert cores.cpu_s == pytest.approx(1.1)  # what the host burned: the jobs' CPU, however shared


@pytest.mark.parametrize("max_in_flight, first", [(None, 1), (128, 16)])
def test_the_first_depth_is_the_trainers(max_in_flight, first):
    """256 microbatches a batch: adaptive, the first microbatch goes alone, as the trainer's does; a
    fixed depth of 128 starts within the 16 credits the workers announce (`initial_depth`)."""
    swarm = SimSwarm(_scenario(run={"microbatches": 256}, trainers={"max_in_flight": max_in_flight},
                               workers={"credits": 16}))
    trainer = swarm.trainers[0]
    swarm.env.process(trainer.run())
    swarm.env.run(until=0.1)  # the unit claimed, its first microbatches started, none finished yet
    assert trainer.limit.limit == first and trainer.limit.active == first and not trainer.tokens_done


def test_trainers_started_one_after_another_start_their_work_in_turn():
    """`start_every_s`: the second trainer's first microbatch ends no sooner than it started, and before
    that the first trainer had the stages to itself."""
    swarm = SimSwarm(_scenario(trainers={"count": 2, "max_in_flight": 4, "start_every_s": 2.0}))
    swarm.run()
    first, second = ([t for t, _ in trainer.tokens_done] for trainer in swarm.trainers)
    assert min(second) >= 2.0 and min(first) < 1.0
    together = SimSwarm(_scenario(trainers={"count": 2, "max_in_flight": 4}))
    together.run()
    assert min(t for t, _ in together.trainers[1].tokens_done) < 1.0


def _adaptive(replicas: int, trainers: int):
    """Over 40 ms links, where the adaptive depth decides: the depth, cap and credits out of its way."""
    return simulate(_scenario(run={"seconds": 12.0, "warmup_s": 4.0},
                              trainers={"count": trainers, "max_in_flight": None, "link": "wan"},
                              links=[{"name": "wan", "up_mbit": 10_000.0, "down_mbit": 10_000.0, "rtt_ms": 40.0}],
                              workers={"replicas": replicas, "credits": 256}))


def test_one_trainer_keeps_every_replica_of_a_stage_busy_and_several_share_them():
    """The trainer sizes its depth to its share of each stage (Roster.share_of_stage: the replicas over
    the callers each serves, as the simulated workers count them with the worker's own FlowControl).
    Sized to one replica, one trainer on 4 replicas ran at one replica's rate and kept them a quarter busy."""
    one, four = _adaptive(1, 1), _adaptive(4, 1)
    assert one.tokens_per_s == pytest.approx(TOKENS / 0.030, rel=0.1) and one.bottleneck.startswith("compute")
    assert four.tokens_per_s >= 3.5 * one.tokens_per_s and four.bottleneck.startswith("compute")
    assert four.depth_last[0] >= 3.5 * one.depth_last[0]
    # Four trainers on those 4 replicas: each fills its quarter, so together about what one trainer does.
    shared = _adaptive(4, 4)
    assert shared.tokens_per_s >= 3.5 * one.tokens_per_s
    assert sum(shared.depth_last) <= 1.25 * four.depth_last[0] + 4


def test_a_commit_is_a_store_then_its_block_read_back():
    """As dht/leases.py's `commit`: the store, then a full read of the block (a duplicate's check);
    the unit is committed for every reader once the store has taken its time."""
    import simpy

    from agora.node.simulate.units import SimLeaseBoard

    env = simpy.Environment()
    ops: list[tuple[float, str]] = []

    def dht_op(kind: str):
        ops.append((round(env.now, 3), kind))
        yield env.timeout(0.1)

    board = SimLeaseBoard(env, total=10, lease_s=30.0, dht_op=dht_op)
    claim = env.process(board.claim("a", None, 1))
    env.run(claim)
    (unit,) = claim.value
    began, ops[:] = env.now, []
    env.run(env.process(board.commit("a", unit)))
    assert ops == [(round(began, 3), "store"), (round(began + 0.1, 3), "get")]
    assert unit in board.committed and env.now == pytest.approx(began + 0.2)


@pytest.mark.parametrize("extra, cpu_per_microbatch_s", [({}, 0.060),
                                                          ({"background_cpu_ms_per_s": 1000.0}, 0.120),
                                                          ({"call_cpu_ms": [10.0, 10.0, 10.0]}, 0.110)])
def test_a_shared_host_runs_at_what_its_cores_give_every_cpu_the_run_burns(extra, cpu_per_microbatch_s):
    """Three 20 ms stages on 2 shared cores are bound by the host (60 ms of CPU a microbatch over 2
    cores), not by a stage (20 ms). A background of one core leaves one: 60 ms a microbatch on it, as
    120 over two. 10 ms
    of a worker's CPU per call besides compute (two calls on a head and a body, one on the tail) makes it
    110 ms over 2 cores."""
    result = simulate(_scenario(run={"seconds": 12.0, "warmup_s": 2.0},
                                compute={"ms": [20.0, 20.0, 20.0], "shared_cores": 2, **extra}))
    assert result.tokens_per_s == pytest.approx(TOKENS * 2 / cpu_per_microbatch_s, rel=0.08)  # 2 cores' worth


def test_cpu_beside_the_jobs_needs_shared_cores_and_one_figure_per_stage():
    with pytest.raises(Exception, match="shared_cores"):
        _scenario(compute={"call_cpu_ms": [1.0, 1.0, 1.0]})
    with pytest.raises(Exception, match="call_cpu_ms"):
        _scenario(compute={"call_cpu_ms": [1.0], "shared_cores": 2})
