"""Flow control between trainers and workers: credits (pure), the busy refusal's pushback, and
trainers that keep within them (real workers on loopback gRPC, one event loop)."""

import asyncio
import threading
import time
from dataclasses import replace

import grpc
import pytest

from agora.node.rpc.interceptors import CallHook
from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.stage_client import StageClient, WorkerBusy, pushback_s
from agora.node.trainer.inflight import depth_cap
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.trainer import SwarmTrainer
from agora.node.worker.flow import HEADROOM, MIN_CREDITS, Credits, FlowControl, demand_for, water_fill
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data
from agora.pipeline.fingerprint import run_fingerprint
from fake_clock import FakeClock

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------------------------------------- pure


def test_demand_covers_the_round_trip_in_jobs():
    assert demand_for(0.0, 0.01) == MIN_CREDITS  # no round trip reported yet
    assert demand_for(0.08, None) == MIN_CREDITS  # no job measured yet
    assert HEADROOM == 2.0
    assert demand_for(0.08, 0.01) == MIN_CREDITS + 16  # 80 ms of round trip is 8 jobs of 10 ms, twice
    assert demand_for(0.085, 0.01) == MIN_CREDITS + 17
    assert demand_for(1e9, 0.01) == MIN_CREDITS + 2000  # a huge claim is cut to MAX_ROUND_TRIP_S
    assert demand_for(float("nan"), 0.01) == MIN_CREDITS


def test_water_filling_is_max_min_fair_and_adds_up():
    assert water_fill(22, {"near": 2, "far1": 20, "far2": 20}) == {"near": 2, "far1": 10, "far2": 10}
    assert water_fill(30, {"a": 10}) == {"a": 10}  # nobody gets more than it asks
    assert water_fill(25, {"a": 30}) == {"a": 25}
    assert water_fill(10, {"a": 4, "b": 4, "c": 4}) == {"a": 4, "b": 3, "c": 3}  # the leftover by name
    assert water_fill(2, {"a": 5, "b": 5, "c": 5}) == {"a": 1, "b": 1, "c": 1}  # at least one each
    shares = water_fill(64, {f"t{i}": d for i, d in enumerate([3, 17, 40, 40, 9])})
    assert sum(shares.values()) == 64 and shares["t0"] == 3 and shares["t4"] == 9
    assert abs(shares["t2"] - shares["t3"]) <= 1 and shares["t1"] == 17


def test_one_caller_gets_its_bandwidth_delay_product():
    clock = FakeClock()
    flow = FlowControl(capacity=64, stash_capacity=64, clock=clock)
    assert flow.grant("a") == Credits(calls=MIN_CREDITS, in_flight=64)  # before anything is measured
    flow.observe_compute(0.01)
    flow.heard_from("a", 0.08)
    assert flow.grant("a") == Credits(calls=MIN_CREDITS + 16, in_flight=64)
    flow.heard_from("a", 0.0)  # a call that carries no round trip keeps the one told before
    assert flow.grant("a").calls == MIN_CREDITS + 16
    flow.heard_from("a", 5.0)  # far away: the whole queue, no more
    assert flow.grant("a").calls == 64
    assert flow.queue_target() == 64


def test_several_callers_share_one_queue_sized_for_the_farthest():
    clock = FakeClock()
    flow = FlowControl(capacity=64, stash_capacity=60, clock=clock)
    flow.observe_compute(0.01)
    for owner in ("t0", "t1", "t2", "t3"):
        flow.heard_from(owner, 0.08)
    # The stage needs 20 calls outstanding across its callers to stay busy, not 20 each: 20 + 3.
    demand = demand_for(0.08, 0.01)
    assert flow.queue_target() == demand + 3 == 23
    grants = {owner: flow.grant(owner) for owner in ("t0", "t1", "t2", "t3")}
    assert sum(g.calls for g in grants.values()) == 23
    assert {g.calls for g in grants.values()} <= {5, 6}
    assert {g.in_flight for g in grants.values()} == {15}  # the stash in equal shares
    # A newcomer (its record, or Info before its first call) is counted among them.
    assert flow.grant(None) == Credits(calls=MIN_CREDITS, in_flight=12)  # it asks for the minimum at first
    # A caller not heard from for `active_s` gives its share back.
    clock.now = 3.0
    flow.heard_from("t0", 0.08)
    clock.now = 6.0
    assert flow.active_callers() == 1 and flow.grant("t0") == Credits(calls=demand, in_flight=60)


def test_the_tail_states_no_in_flight_bound_and_bad_reports_are_ignored():
    flow = FlowControl(capacity=8, stash_capacity=None, clock=FakeClock())
    flow.observe_compute(-1.0)
    flow.observe_compute(float("inf"))
    assert flow.compute_s is None
    flow.heard_from("a", float("nan"))
    flow.heard_from("b", -3.0)
    # Both count as callers that reported no round trip: the minimum demand each, one queue for both.
    assert flow.queue_target() == MIN_CREDITS + 1
    assert flow.grant("a").in_flight == 0 and flow.grant("a").calls + flow.grant("b").calls == MIN_CREDITS + 1
    with pytest.raises(ValueError):
        FlowControl(capacity=0, stash_capacity=None)


def test_the_depth_is_the_staleness_cap_within_the_workers_credits():
    # Nothing stated yet: the configured cap.
    assert depth_cap(32, None, [0, 0, 0]) == 32
    # The tightest stage keeps 12 between Forward and Backward for this trainer.
    assert depth_cap(32, 12, [8, 8, 8]) == 12
    # Calls outstanding over all stages bound it too: 2 + 2 + 2 calls hold at most 6 microbatches.
    assert depth_cap(32, 12, [2, 2, 2]) == 6
    # Never below one microbatch.
    assert depth_cap(32, 0, [1, 0, 0]) == 1


def test_pushback_is_the_jobs_ahead_within_bounds():
    flow = FlowControl(capacity=8, stash_capacity=8, clock=FakeClock())
    assert flow.pushback_s(1) == pytest.approx(0.01)  # nothing measured: 10 ms a job
    flow.observe_compute(0.004)
    assert flow.pushback_s(3) == pytest.approx(0.012)
    assert flow.pushback_s(10_000) == 1.0
    flow.observe_compute(0.0)
    flow.compute_s = 0.0
    assert flow.pushback_s(1) == 0.001
    assert pushback_s([("grpc-retry-pushback-ms", "250")]) == 0.25
    assert pushback_s([("grpc-retry-pushback-ms", b"7")]) == 0.007
    assert pushback_s([("grpc-retry-pushback-ms", "-1")]) is None and pushback_s(None) is None
    assert pushback_s([("other", "5")]) is None


# ---------------------------------------------------------------------------------------------- gRPC


def _config(stages=3, batch_size=16, microbatches=16):
    config = PRESETS["tiny"].with_stages(stages)
    return replace(config, train=replace(config.train, batch_size=batch_size, microbatches=microbatches, seq_len=32,
                                         eval_every=0, eval_batches=1))


@pytest.fixture(scope="module")
def data():
    return build_data(_config())


def test_replies_carry_credits_and_a_busy_refusal_its_pushback(data):
    """A worker whose compute thread is held: the first Forward is queued, the second (its queue
    of 1 full) is refused RESOURCE_EXHAUSTED with `grpc-retry-pushback-ms`; once the thread is
    free the first one's reply carries the caller's credits, and so does Info."""
    config = _config()
    micro = data.train.unit(0)[:1]

    async def main():
        worker = StageWorker(config, 0, run_id="test", options=WorkerOptions(max_queue=1))
        await worker.start()
        client = StageClient(worker.address, run_id="test", stage=0, model=config.model,
                             fingerprint=run_fingerprint(config))
        release = threading.Event()
        try:
            held = asyncio.ensure_future(worker.on_compute(lambda compute: release.wait(10)))
            first = asyncio.ensure_future(client.forward("m0", micro[:, :-1], round_trip_s=0.05))
            deadline = time.monotonic() + 20
            while worker.load < 1:  # readiness: the first call holds the worker's one slot
                assert time.monotonic() < deadline, "the first call never reached the worker"
                await asyncio.sleep(0.01)
            with pytest.raises(WorkerBusy) as refused:
                await client.forward("m1", micro[:, :-1])
            release.set()
            await held
            reply = await first
            return refused.value, reply, await client.info()
        finally:
            release.set()
            await client.close()
            await worker.stop(0)

    refused, reply, info = asyncio.run(main())
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and 0 < refused.pushback_s <= 1.0
    assert "is full" in refused.details
    assert reply.credits == 1 and reply.in_flight_credits == 64  # a queue of 1: one call at a time
    assert reply.callers == 1  # the one caller it serves: this client
    assert (info.capacity, info.credits, info.in_flight_credits) == (1, 1, 64)


class SlowCalls(CallHook):
    """Every Forward and Backward of this worker takes `seconds` more: a slow worker, not a dead one."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    async def before(self, call, context):
        if call.method.endswith(("/Forward", "/Backward")):
            await asyncio.sleep(self.seconds)


async def _workers(config, queue: int, slow_stage: int | None = None, slow_s: float = 0.0, stash: int = 64,
                   announce: bool = False, replicas: int = 1):
    """`replicas` workers per stage; `announce`: the discovery carries the credits their records would announce."""
    workers, views = [], []
    for stage in range(len(config.layer_split)):
        for replica in range(replicas):
            hooks = [SlowCalls(slow_s)] if stage == slow_stage else []
            worker = StageWorker(config, stage, run_id="test",
                                 options=WorkerOptions(max_queue=queue, stash_capacity=stash), interceptors=hooks)
            await worker.start()
            workers.append(worker)
            info = worker.info() if announce else None
            views.append(WorkerView(f"s{stage}" + (f"r{replica}" if replicas > 1 else ""), worker.address, stage,
                                    announced_credits=info.credits if info else 0,
                                    announced_in_flight_credits=info.in_flight_credits if info else 0))
    return workers, StaticDiscovery(views)


def test_a_wide_batch_trains_through_small_queues_without_a_busy_answer(data):
    """16 microbatches per global batch, half of them started at once, through workers that hold 2
    calls each: the trainer keeps within its credits, so every batch completes with no busy answer,
    reroute or ban (before flow control this shape ended the trainer after six busy answers)."""
    config = _config()

    async def main():
        workers, discovery = await _workers(config, queue=2)
        try:
            # No gradient checks: their probes are calls too, and this counts the pipeline's own.
            async with SwarmTrainer(config, data, discovery,
                                    TrainerOptions(run_id="test", gradient_check_share=0.0)) as trainer:
                records = await trainer.run(3)
                # Held out of the training calls' split: an evaluation's Forwards.
                await trainer.evaluate(data.heldout_batches(1, config.train.batch_size))
                return records, trainer.stats, trainer.in_flight_summary()
        finally:
            await asyncio.gather(*(w.stop(0) for w in workers))

    records, stats, depth = asyncio.run(main())
    assert [r.step for r in records] == [1, 2, 3]
    assert (stats.busy, stats.reroutes, stats.bans) == (0, 0, 0)
    assert stats.calls == 3 * 16 * 5  # a Forward on each of 3 stages, a Backward on the first 2
    assert depth["stage_credits"] == [2, 2, 2] and depth["credit_cap"] == 64
    assert depth["stage_shares"] == [1.0, 1.0, 1.0]  # each stage's one worker, serving this trainer alone


def test_a_trainer_alone_sizes_its_depth_to_every_replica_of_a_stage(data):
    """Two workers per stage, one trainer: every reply says its worker serves one caller, so the trainer
    counts two replicas' worth of each stage to fill (node/trainer/inflight.py) and routes to both."""
    config = _config()

    async def main():
        workers, discovery = await _workers(config, queue=8, replicas=2)
        try:
            async with SwarmTrainer(config, data, discovery,
                                    TrainerOptions(run_id="test", gradient_check_share=0.0)) as trainer:
                records = await trainer.run(2)
                shares = [trainer.roster.workers[v.peer_id].callers for v in discovery.views]
                return records, trainer.stats, trainer.in_flight_summary(), shares, [w.info().step for w in workers]
        finally:
            await asyncio.gather(*(w.stop(0) for w in workers))

    records, stats, depth, callers, steps = asyncio.run(main())
    assert [r.step for r in records] == [1, 2]
    assert (stats.reroutes, stats.bans) == (0, 0)
    assert callers == [1] * 6 and depth["stage_shares"] == [2.0, 2.0, 2.0]
    assert steps == [2] * 6  # both replicas of every stage stepped on each batch


def test_the_first_depth_keeps_within_what_the_workers_stash(data):
    """16 microbatches per global batch through workers that keep 4 forward inputs for a trainer, as
    their records say: a fixed depth of 8 stays within those 4 from the first microbatch, so no stashed
    input is evicted before its Backward. Deeper, the first batch's Backwards failed (no forward input
    stashed), each a reroute and a ban of its stage's only worker. (An adaptive depth starts at one.)"""
    config = _config()

    async def main():
        workers, discovery = await _workers(config, queue=4, stash=4, announce=True)
        try:
            async with SwarmTrainer(config, data, discovery,
                                    TrainerOptions(run_id="test", gradient_check_share=0.0,
                                                   max_in_flight=8)) as trainer:
                records = await trainer.run(2)
                return records, trainer.stats, trainer.in_flight_summary()
        finally:
            await asyncio.gather(*(w.stop(0) for w in workers))

    records, stats, depth = asyncio.run(main())
    assert [r.step for r in records] == [1, 2]
    assert (stats.reroutes, stats.bans) == (0, 0)
    assert depth["credit_cap"] == 4 and depth["max"] <= 4


def test_three_trainers_share_a_slow_worker_per_stage_and_none_is_banned(data):
    """Three trainers (one caller identity, as --insecure callers on one host are: the worker cannot
    tell them apart, so they exceed its per-caller limit together and meet busy answers) through one
    worker per stage, the middle one 20 ms slower per call: every batch completes, every busy answer
    is waited out, and no worker is banned or routed around."""
    config = _config()

    async def main():
        workers, discovery = await _workers(config, queue=4, slow_stage=1, slow_s=0.02)
        trainers = [SwarmTrainer(config, data, discovery, TrainerOptions(run_id="test", trainer_index=i, trainers=3))
                    for i in range(3)]
        try:
            results = await asyncio.gather(*(t.run(6) for t in trainers))
            return results, [t.stats for t in trainers], [w.info().step for w in workers]
        finally:
            for trainer in trainers:
                await trainer.close()
            await asyncio.gather(*(w.stop(0) for w in workers))

    results, stats, steps = asyncio.run(main())
    assert sorted(r.step for records in results for r in records) == [1, 2, 3, 4, 5, 6]
    assert all((s.reroutes, s.bans, s.batch_reports_failed) == (0, 0, 0) for s in stats)
    assert steps == [6, 6, 6]
