"""What one trainer's calls may do to a stage's replicas, over real gRPC with mutual TLS: its
completed-batch reports move a replica's count only as far as its credit reaches
(node/replica/epoch.py). The pure rules: tests/unit/test_control_messages.py."""

from __future__ import annotations

import time

import pytest

from agora.auth.authority import RunAuthority
from agora.auth.node_state import NodeCredentials
from agora.node.replica.epoch import DEFAULT_REPORT_AHEAD, stage_step
from agora.node.rpc.server import run
from agora.node.rpc.tls import TlsChannels
from agora.node.trainer.stage_client import StageClient
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
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
    return workers, trainers


def client(worker: StageWorker, trainer_dir) -> StageClient:
    return StageClient(worker.address, run_id=RUN, stage=0, model=CONFIG.model, fingerprint=run_fingerprint(CONFIG),
                       peer_id=worker.credentials.peer_id, channels=TlsChannels(NodeCredentials(trainer_dir, clock=time.time)),
                       timeout_s=20)


def test_one_trainer_s_reports_to_every_replica_move_the_stage_by_its_credit_not_the_window(pki):
    worker_dirs, trainers = pki
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
