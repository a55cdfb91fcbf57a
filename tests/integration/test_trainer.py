"""SwarmTrainer against real StageWorkers on loopback gRPC (in one process, no DHT)."""

import asyncio
from collections import Counter
from dataclasses import replace

import grpc
import pytest

from agora.node.rpc.interceptors import CallHook
from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.trainer import SwarmTrainer
from agora.node.trainer.units import assigned_units
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.centralized import CentralizedTrainer
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data

pytestmark = pytest.mark.timeout(180)


def _config(stages=3):
    config = PRESETS["tiny"].with_stages(stages)
    return replace(config, train=replace(config.train, batch_size=4, microbatches=2, seq_len=32,
                                         eval_every=0, eval_batches=2))


@pytest.fixture(scope="module")
def data():
    return build_data(_config())


async def _swarm(config, replicas, synchronous, announced: float = 0.0, keep_graphs: int = 0):
    """Workers on loopback and a fixed discovery of them; `announced`: the compute throughput their
    records would carry (0: none, so routing goes by the trainer's own round trips)."""
    workers = []
    for stage in range(len(config.layer_split)):
        for replica in range(replicas):
            worker = StageWorker(config, stage, run_id="test",
                                 options=WorkerOptions(synchronous=synchronous, keep_graphs=keep_graphs))
            await worker.start()
            workers.append((f"s{stage}r{replica}", stage, worker))
    views = [WorkerView(peer, w.address, stage, announced_samples_per_s=announced) for peer, stage, w in workers]
    return [w for _, _, w in workers], StaticDiscovery(views)


@pytest.mark.parametrize("keep_graphs", [0, 4], ids=["recompute", "kept-graphs"])
def test_synchronous_swarm_reproduces_the_centralized_run(data, keep_graphs):
    config = _config()
    steps = 4
    reference = CentralizedTrainer(config, data)
    reference_records = reference.run(steps)
    expected = [r.loss for r in reference_records]
    expected_eval = reference.evaluate()

    async def main():
        workers, discovery = await _swarm(config, 1, synchronous=True, keep_graphs=keep_graphs)
        try:
            async with SwarmTrainer(config, data, discovery, TrainerOptions(run_id="test", synchronous=True)) as t:
                records = await t.run(steps)
                held_out = await t.evaluate(data.heldout_batches(config.train.eval_batches, config.train.batch_size))
            used = [await w.on_compute(lambda compute: compute.kept.used) for w in workers]
            return records, held_out, used
        finally:
            await asyncio.gather(*(w.stop(0) for w in workers))

    records, held_out, used = asyncio.run(main())
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert [r.loss for r in records] == expected  # bit for bit (one microbatch in flight: a fixed order)
    assert used == ([0, 0, 0] if keep_graphs == 0 else [8, 8, 0])  # every head/body backward used its graph
    assert held_out == pytest.approx(expected_eval, abs=1e-4)
    for got, want in zip(records, reference_records):
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-3)


def test_asynchronous_swarm_with_one_microbatch_in_flight_is_the_centralized_run(data):
    """Each stage steps when told its share of a global batch is done, before the next microbatch
    reaches it: with nothing overlapping, asynchronous mode is train-local step for step."""
    config = _config()
    steps = 4
    expected = [r.loss for r in CentralizedTrainer(config, data).run(steps)]

    async def main():
        workers, discovery = await _swarm(config, 1, synchronous=False)
        try:
            async with SwarmTrainer(config, data, discovery, TrainerOptions(run_id="test", max_in_flight=1)) as t:
                return await t.run(steps), [w.info().step for w in workers]
        finally:
            await asyncio.gather(*(w.stop(0) for w in workers))

    records, steps_taken = asyncio.run(main())
    assert [r.loss for r in records] == pytest.approx(expected, abs=1e-4)
    assert steps_taken == [steps] * 3


def test_asynchronous_swarm_with_two_replicas_and_two_trainers_runs(data):
    config = _config(stages=2)

    async def main():
        workers, discovery = await _swarm(config, 2, synchronous=False)
        try:
            trainers = [SwarmTrainer(config, data, discovery,
                                     TrainerOptions(run_id="test", trainer_index=i, trainers=2, max_in_flight=3))
                        for i in range(2)]
            results = await asyncio.gather(*(t.run(6) for t in trainers))
            for t in trainers:
                await t.close()
            served = [w.info().step for w in workers]
            return results, served, [t.stats for t in trainers]
        finally:
            await asyncio.gather(*(w.stop(0) for w in workers))

    results, steps_taken, stats = asyncio.run(main())
    records = [r for records in results for r in records]
    assert sorted(r.step for r in records) == [1, 2, 3, 4, 5, 6]
    # The stage's shared epoch: every replica stepped once per global batch, whichever trainer ran it.
    assert steps_taken == [6] * 4
    assert all(s.batch_reports_failed == 0 for s in stats)


def test_equally_fast_replicas_get_equal_shares_of_every_batch(data):
    """Each replica steps on its share divided by the expected share (microbatches / replicas):
    balanced routing makes the share it gets the one it divides by, batch after batch."""
    config = _config(stages=2)
    config = replace(config, train=replace(config.train, batch_size=8, microbatches=4))
    data8 = build_data(config)
    forwarded: list[Counter] = []  # per worker: forwards per global batch

    def recording(compute, seen: Counter):
        forward = compute.forward

        def wrapped(request, **caller):
            seen[request.microbatch_id.split("m")[0]] += 1  # "u{unit}m{i}.a{attempt}.{128 random bits}"
            return forward(request, **caller)
        return wrapped

    async def main():
        # Equally fast as the replicas' records say (what balancing compares: node/trainer/routing.py);
        # the trainer's own round trips would vary with the machine's load.
        workers, discovery = await _swarm(config, 2, synchronous=False, announced=100.0)
        for worker in workers:
            forwarded.append(Counter())
            worker.compute.forward = recording(worker.compute, forwarded[-1])
        try:
            # No gradient checks: their probes are Forwards too, and this counts the routes' own.
            options = TrainerOptions(run_id="test", max_in_flight=4, gradient_check_share=0.0)
            async with SwarmTrainer(config, data8, discovery, options) as t:
                await t.run(5)
        finally:
            await asyncio.gather(*(w.stop(0) for w in workers))

    asyncio.run(main())
    assert forwarded == [Counter({f"u{unit}": 2 for unit in range(5)})] * 4


def test_units_are_striped_over_trainers():
    assert assigned_units(7, 0, 2) == [0, 2, 4, 6]
    assert assigned_units(7, 1, 2) == [1, 3, 5]
    assert assigned_units(3, 0, 1) == [0, 1, 2]


class FailFirstCall(CallHook):
    """A fault injected at one method: the worker answers UNAVAILABLE to its first call."""

    def __init__(self, method_suffix):
        super().__init__()
        self.method_suffix = method_suffix
        self.fired = False

    async def before(self, call, context):
        if call.method.endswith(self.method_suffix) and not self.fired:
            self.fired = True
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected fault")


def test_abandoned_route_is_taken_back_and_sync_mode_still_matches(data):
    """The body fails one Backward after the tail already accumulated: the trainer aborts the
    route (the tail reverts its gradient), reruns the microbatch, and the trace stays exact."""
    config = _config()
    steps = 3
    expected = [r.loss for r in CentralizedTrainer(config, data).run(steps)]

    async def main():
        workers = []
        for stage in range(3):
            hooks = [FailFirstCall("/Backward")] if stage == 1 else []
            worker = StageWorker(config, stage, run_id="test", options=WorkerOptions(synchronous=True),
                                 interceptors=hooks)
            await worker.start()
            workers.append(worker)
        discovery = StaticDiscovery([WorkerView(f"s{i}", w.address, i) for i, w in enumerate(workers)])
        try:
            async with SwarmTrainer(config, data, discovery,
                                    TrainerOptions(run_id="test", synchronous=True, max_in_flight=1)) as trainer:
                trainer.roster.ban_base_s = 0.0  # one replica per stage: retry the same worker at once
                records = await trainer.run(steps)
                return records, trainer.stats
        finally:
            await asyncio.gather(*(w.stop(0) for w in workers))

    records, stats = asyncio.run(main())
    assert stats.reroutes == 1
    assert stats.aborts.get("reverted", 0) == 1  # the tail took its gradient back
    assert [r.loss for r in records] == pytest.approx(expected, abs=1e-4)


def test_workers_stepping_on_their_own_count_are_told_once_and_then_left_alone(data):
    config = _config(stages=2)

    async def main():
        workers = []
        for stage in range(2):
            worker = StageWorker(config, stage, run_id="test",
                                 options=WorkerOptions(local_batch=config.train.batch_size))
            await worker.start()
            workers.append(worker)
        discovery = StaticDiscovery([WorkerView(f"s{i}", w.address, i) for i, w in enumerate(workers)])
        try:
            async with SwarmTrainer(config, data, discovery, TrainerOptions(run_id="test", max_in_flight=1)) as t:
                records = await t.run(3)
                return records, t, [w.info().step for w in workers]
        finally:
            await asyncio.gather(*(w.stop(0) for w in workers))

    records, trainer, steps_taken = asyncio.run(main())
    assert len(records) == 3 and steps_taken == [3, 3]  # a full local batch per global batch
    assert trainer.batch_reports.unreported == {"s0", "s1"} and trainer.stats.batch_reports_failed == 0


def test_a_completed_batch_report_the_worker_did_not_answer_is_sent_again_and_every_replica_steps_once_a_batch(data):
    """The tail answers its first completed-batch report UNAVAILABLE (as a worker whose lease read
    went unanswered does): the report is sent again, so it steps once per global batch, as the head
    does, rather than lagging its stage by a step for the rest of the run."""
    config = _config(stages=2)
    steps = 3

    async def main():
        workers = []
        for stage in range(2):
            hooks = [FailFirstCall("/Step")] if stage == 1 else []
            worker = StageWorker(config, stage, run_id="test", interceptors=hooks)
            await worker.start()
            workers.append(worker)
        discovery = StaticDiscovery([WorkerView(f"s{i}", w.address, i) for i, w in enumerate(workers)])
        try:
            async with SwarmTrainer(config, data, discovery, TrainerOptions(run_id="test", max_in_flight=1)) as t:
                records = await t.run(steps)
                return records, t.stats, [w.info().step for w in workers], hooks[0].fired
        finally:
            await asyncio.gather(*(w.stop(0) for w in workers))

    records, stats, steps_taken, fired = asyncio.run(main())
    assert fired and len(records) == steps
    assert steps_taken == [steps, steps]
    assert (stats.batch_reports_retried, stats.batch_reports_failed) == (1, 0)


def test_a_time_budget_stops_starting_global_batches(data):
    """The clock jumps past the budget once the first global batch is recorded: no batch starts
    after it, the run ends, and the held-out evaluation still runs."""
    import time

    config = _config()
    offset = [0.0]

    def clock() -> float:
        return time.monotonic() + offset[0]

    def on_record(record) -> None:
        offset[0] += 100.0

    async def main():
        workers, discovery = await _swarm(config, 1, synchronous=True)
        try:
            options = TrainerOptions(run_id="test", synchronous=True, time_budget_s=50.0)
            async with SwarmTrainer(config, data, discovery, options, clock=clock, on_record=on_record) as t:
                records = await t.run(6)
                held_out = await t.evaluate(data.heldout_batches(1, config.train.batch_size))
            return records, held_out
        finally:
            await asyncio.gather(*(w.stop(0) for w in workers))

    records, held_out = asyncio.run(main())
    assert [r.step for r in records] == [1] and held_out > 0


def test_a_unit_run_again_by_another_trainer_is_computed_but_applied_once(data):
    """Over gRPC: the second trainer runs a microbatch of a unit the first had run (a reclaimed
    lease): every stage computes it (the loss comes back), none adds its gradient again, and the
    trainer counts one repeat per stage."""
    config = _config()
    micro = data.train.unit(5)[:2]

    async def main():
        workers, discovery = await _swarm(config, 1, synchronous=True)
        try:
            losses, repeats = [], []
            for _ in range(2):  # the trainer that died after its forwards, then the one that reclaimed
                async with SwarmTrainer(config, data, discovery,
                                        TrainerOptions(run_id="test", synchronous=True, max_in_flight=1)) as trainer:
                    losses.append(await trainer.microbatches.run("u5m0", micro[:, :-1], micro[:, 1:]))
                    repeats.append(trainer.stats.repeats)
            accumulated = [await w.on_compute(lambda c: c.accumulated_microbatches) for w in workers]
            return losses, repeats, accumulated
        finally:
            await asyncio.gather(*(w.stop(0) for w in workers))

    losses, repeats, accumulated = asyncio.run(main())
    assert losses[0] == pytest.approx(losses[1])
    assert repeats == [0, 3] and accumulated == [1, 1, 1]


class DelayNthCall(CallHook):
    """Holds the worker's `n`-th call of one method for `seconds` (a slow moment on one microbatch)."""

    def __init__(self, method_suffix, n, seconds):
        super().__init__()
        self.method_suffix, self.n, self.seconds, self.calls = method_suffix, n, seconds, 0

    async def before(self, call, context):
        if call.method.endswith(self.method_suffix):
            self.calls += 1
            if self.calls == self.n:
                await asyncio.sleep(self.seconds)


def test_synchronous_stages_accumulate_in_index_order_with_microbatches_overtaking(data):
    """Four microbatches, two in flight; the second Backward to reach the head is held, so the
    batch's later microbatches get there before it (without the turns the head accumulated them
    as 1, 2, 3, 0). Float sums depend on their order: each stage still adds the batch's gradients
    in index order, and the run equals train-local bit for bit."""
    config = replace(_config(), train=replace(_config().train, batch_size=8, microbatches=4))
    steps = 2
    expected = [r.loss for r in CentralizedTrainer(config, data).run(steps)]

    async def main():
        workers = []
        for stage in range(3):
            hooks = [DelayNthCall("/Backward", 2, 0.5)] if stage == 0 else []
            worker = StageWorker(config, stage, run_id="test", options=WorkerOptions(synchronous=True),
                                 interceptors=hooks)
            await worker.start()
            workers.append(worker)
        orders = []  # per step, the order in which the head accumulated the batch's microbatches
        await workers[0].on_compute(lambda c: c.step_hooks.append(
            lambda compute: orders.append([int(i.split(".")[0].split("m")[1]) for i in compute.stepped_ids])))
        discovery = StaticDiscovery([WorkerView(f"s{i}", w.address, i) for i, w in enumerate(workers)])
        try:
            async with SwarmTrainer(config, data, discovery,
                                    TrainerOptions(run_id="test", synchronous=True, max_in_flight=2)) as trainer:
                return await trainer.run(steps), orders
        finally:
            await asyncio.gather(*(w.stop(0) for w in workers))

    records, orders = asyncio.run(main())
    assert orders == [[0, 1, 2, 3]] * steps
    assert [r.loss for r in records] == expected
