"""What one trainer's calls may do to a stage's replicas, over real gRPC with mutual TLS: a unit's
work and report are taken from the unit's lease holder only, as the worker reads a real admitted
DHT (node/worker/unit_holders.py), and completed-batch reports move a replica's count only as far
as their trainer's credit reaches (node/replica/epoch.py). The pure rules:
tests/unit/test_unit_holders.py, tests/unit/test_control_messages.py."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
import torch

from agora.auth.authority import RunAuthority
from agora.auth.node_state import NodeCredentials
from agora.dht.leases import LeaseBoard, read_block
from agora.dht.security import DHTSecurity
from agora.dht.swarm import SwarmDHT
from agora.node.replica.epoch import DEFAULT_REPORT_AHEAD, stage_step
from agora.node.rpc.server import run
from agora.node.rpc.tls import TlsChannels
from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.stage_client import StageCallError, StageClient, UnitNotHeld
from agora.node.trainer.trainer import SwarmTrainer
from agora.node.trainer.units import LeasedUnits, UnitLost
from agora.node.worker.unit_holders import UnitHolders
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data
from agora.pipeline.fingerprint import run_fingerprint

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

RUN = "binding-run"
CONFIG = PRESETS["tiny"].with_stages(1)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    base = tmp_path_factory.mktemp("binding")
    authority = RunAuthority(base / "ca", run_id=RUN)
    workers = [authority.mint(base / f"worker{i}", role="worker", stage=0).directory for i in range(2)]
    trainers = {name: authority.mint(base / name, role="trainer").directory for name in ("honest", "mallory")}
    return workers, trainers, authority.root_pem


@pytest.fixture(scope="module")
def dhts(pki):
    """The first worker's DHT peer (it stores the lease queue) and the honest trainer's."""
    workers, trainers, _ = pki
    worker = SwarmDHT.start(security=DHTSecurity.from_state_dir(workers[0]))
    try:
        trainer = SwarmDHT.start(initial_peers=worker.visible_maddrs(), client_mode=True,
                                 security=DHTSecurity.from_state_dir(trainers["honest"]))
        try:
            yield worker, trainer
        finally:
            trainer.shutdown()
    finally:
        worker.shutdown()


def client(worker: StageWorker, trainer_dir) -> StageClient:
    return StageClient(worker.address, run_id=RUN, stage=0, model=worker.config.model,
                       fingerprint=run_fingerprint(worker.config), peer_id=worker.credentials.peer_id,
                       channels=TlsChannels(NodeCredentials(trainer_dir, clock=time.time)), timeout_s=20)


@contextlib.asynccontextmanager
async def gated_stage(config, pki, dhts, unit: int):
    """A worker of stage 0 that takes a unit's work from its holder only, as its DHT peer reads the
    lease queue; `unit` claimed there by the honest trainer; (worker, honest client, mallory's)."""
    worker_dirs, trainers, _ = pki
    worker_dht, trainer_dht = dhts
    holders = UnitHolders(lambda block: read_block(worker_dht, RUN, block), clock=worker_dht.clock)
    worker = StageWorker(config, 0, run_id=RUN, options=WorkerOptions(), unit_holders=holders,
                         credentials=NodeCredentials(worker_dirs[0], clock=time.time))
    await worker.start()
    board = LeaseBoard(trainer_dht, run_id=RUN, lease_s=30.0)
    honest, mallory = client(worker, trainers["honest"]), client(worker, trainers["mallory"])
    try:
        assert await board.claim(unit)
        yield worker, honest, mallory
    finally:
        for call in (honest, mallory):
            await call.close()
        await worker.stop()


def microbatch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.randint(0, CONFIG.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(seed))
    return batch[:, :-1], batch[:, 1:]


async def refused(call) -> tuple[grpc.StatusCode, str, int | None]:
    """The refusal's code and details, and the unit it says the caller does not hold (None: not that)."""
    with pytest.raises(StageCallError) as error:
        await call
    return error.value.code, error.value.details, error.value.unit if isinstance(error.value, UnitNotHeld) else None


def test_a_unit_s_work_and_report_are_taken_from_its_holder_alone(pki, dhts):
    """The honest trainer claims unit 7 on the DHT; a second trainer sends work under unit 7's keys
    (and unit 8's, which nobody holds) and reports unit 7 done: each refused naming the unit and its
    holder, nothing applied. The holder's microbatches are applied once each and its report counted."""
    micro = CONFIG.train.microbatches

    async def main():
        async with gated_stage(CONFIG, pki, dhts, 7) as (worker, honest, mallory):
            tokens, targets = microbatch(0)
            squats = [await refused(mallory.forward(f"squat{i}", tokens, targets=targets, work_key=f"u{unit}m0"))
                      for i, unit in enumerate((7, 8))]
            squats.append(await refused(mallory.batch_done(7, micro, 1)))
            squats.append(await refused(mallory.forward("nokey", tokens, targets=targets)))
            before = await worker.on_compute(lambda c: (c.accumulated_microbatches, c.optimizer.steps, len(c.work)))
            applied = []
            for index in range(micro):
                tokens, targets = microbatch(index)
                applied.append((await honest.forward(f"mine{index}", tokens, targets=targets,
                                                     work_key=f"u7m{index}")).repeat)
            tokens, targets = microbatch(0)
            again = await honest.forward("mine-again", tokens, targets=targets, work_key="u7m0")
            accumulated = await worker.on_compute(lambda c: c.accumulated_microbatches)
            report = await honest.batch_done(7, micro, 1)
            return squats, before, applied, again.repeat, accumulated, report.accumulated, worker.refusals.snapshot()

    squats, before, applied, repeated, accumulated, stepped_on, refusals = run(main())
    holder = dhts[1].peer_id
    assert squats[0][0] == grpc.StatusCode.PERMISSION_DENIED and f"unit 7 is held by trainer {holder}" in squats[0][1]
    assert squats[1][0] == grpc.StatusCode.PERMISSION_DENIED and "unit 8 is held by no trainer" in squats[1][1]
    assert squats[2][0] == grpc.StatusCode.PERMISSION_DENIED and f"unit 7 is held by trainer {holder}" in squats[2][1]
    assert squats[3][0] == grpc.StatusCode.INVALID_ARGUMENT and "work_key: a training Forward names" in squats[3][1]
    assert before == (0, 0, 0)  # nothing of the squatter's was applied, stepped or remembered
    assert applied == [False] * micro and repeated  # the holder's microbatches, each applied once
    assert accumulated == micro and stepped_on == micro
    assert refusals["not_unit_holder"] == 3 and refusals["bad_work_key"] == 1
    # Each refusal of work or a report of a unit not held names the unit (the caller's own problem,
    # which its trainer settles with the lease queue, node/trainer/units.py), a bad work key does not.
    assert [unit for _, _, unit in squats] == [7, 8, 7, None]


def test_a_trainer_running_a_unit_another_holds_drops_it_at_the_first_refusal_and_blames_no_worker(pki, dhts):
    """Two trainers can both read back their claim of a unit when one's store lands late (dht/leases.py).
    The one the worker refuses asks the lease queue, finds the unit is the other's, and drops it: every
    microbatch stops, nothing of it is applied, no reroute, no failure counted against the worker (six
    such failures each had a trainer back off from its stage's only worker for a minute)."""
    _, trainers, _ = pki

    async def main():
        async with gated_stage(CONFIG, pki, dhts, 5) as (worker, _, _):
            security = DHTSecurity.from_state_dir(trainers["mallory"])
            other = await asyncio.to_thread(SwarmDHT.start, initial_peers=dhts[0].visible_maddrs(), client_mode=True,
                                            security=security)
            try:
                board = LeaseBoard(other, run_id=RUN, lease_s=30.0)
                units = LeasedUnits(board, total=16, clock=other.clock)
                view = WorkerView(worker.credentials.peer_id, worker.address, 0)
                channels = TlsChannels(NodeCredentials(trainers["mallory"], clock=time.time))
                async with SwarmTrainer(CONFIG, build_data(CONFIG), StaticDiscovery([view]),
                                        TrainerOptions(run_id=RUN, max_in_flight=2), channels=channels,
                                        units=units) as trainer:
                    with pytest.raises(UnitLost) as lost:
                        await trainer.train_unit(5)
                    applied = await worker.on_compute(lambda c: (c.accumulated_microbatches, len(c.work)))
                    return str(lost.value), applied, trainer.stats
            finally:
                await asyncio.to_thread(other.shutdown)

    lost, applied, stats = run(main())
    assert "unit 5 is held by another trainer" in lost
    assert applied == (0, 0) and stats.reroutes == 0 and stats.failures_by_peer == {}


def test_a_head_checks_a_forward_while_it_computes_and_applies_nothing_before_the_check_allows_it(pki, dhts):
    """On a head (or body) a Forward adds no gradient: it is served while its unit's holder is read,
    and its Backward, which adds the gradient, waits for that check."""
    config = PRESETS["tiny"].with_stages(2)
    wire = config.model.wire_dim

    async def main():
        async with gated_stage(config, pki, dhts, 9) as (worker, honest, mallory):
            tokens, _ = microbatch(1)
            grad = torch.ones(*tokens.shape, wire)
            await mallory.forward("squat", tokens, work_key="u9m0")  # served: it adds nothing
            squat = await refused(mallory.backward("squat", grad))
            unchecked = await refused(mallory.backward("never-forwarded", grad))
            applied_by_squatter = await worker.on_compute(lambda c: (c.accumulated_microbatches, len(c.work)))
            await honest.forward("mine", tokens, work_key="u9m0")
            await honest.backward("mine", grad)
            return squat, unchecked, applied_by_squatter, await worker.on_compute(
                lambda c: (c.accumulated_microbatches, c.work.keys()))

    squat, unchecked, applied_by_squatter, applied = run(main())
    assert squat[0] == grpc.StatusCode.PERMISSION_DENIED and f"unit 9 is held by trainer {dhts[1].peer_id}" in squat[1]
    assert unchecked[0] == grpc.StatusCode.FAILED_PRECONDITION and "no lease check" in unchecked[1]
    assert applied_by_squatter == (0, 0)
    assert applied == (1, ["u9m0"])


def test_one_trainer_s_reports_to_every_replica_move_the_stage_by_its_credit_not_the_window(pki):
    worker_dirs, trainers, _ = pki
    rounds = 60  # each report as far ahead as the window lets it: 60 x 257 steps before

    async def main():
        replicas = [StageWorker(CONFIG, 0, run_id=RUN, options=WorkerOptions(), credentials=NodeCredentials(d, clock=time.time))
                    for d in worker_dirs]
        for replica in replicas:
            await replica.start()
        honest = [client(replica, trainers["honest"]) for replica in replicas]
        mallory = [client(replica, trainers["mallory"]) for replica in replicas]
        try:
            for call in honest:
                await call.batch_done(1000, CONFIG.train.microbatches, 2)  # the stage is at step 1000
            start = [(await call.info()).step for call in honest]
            for _ in range(rounds):
                for replica, call in zip(replicas, mallory):
                    at = (await call.info()).step
                    await call.batch_done(at + DEFAULT_REPORT_AHEAD, CONFIG.train.microbatches, 2)
                steps = [(await call.info()).step for call in honest]
                for index, replica in enumerate(replicas):  # what the join daemon passes between heartbeats
                    median = stage_step(steps[:index] + steps[index + 1:])
                    await replica.on_compute(lambda compute, median=median: setattr(compute, "stage_step", median))
            moved = [(await call.info()).step - before for call, before in zip(honest, start)]
            # The honest trainer's next report still counts where the stage is.
            at = max(start[0] + moved[0], start[1] + moved[1])
            reply = await honest[0].batch_done(at, CONFIG.train.microbatches, 2)
            return moved, reply.step
        finally:
            for call in honest + mallory:
                await call.close()
            for replica in replicas:
                await replica.stop()

    moved, stepped_to = run(main())
    assert all(rounds <= step <= 2 * rounds + 1 for step in moved), moved
    assert stepped_to > 1001 + rounds
