"""Health checks and reflection have a pool of calls of their own (node/rpc/call_slots.py): peers of any
role holding health Watch or reflection streams open never take the calls a trainer's Forward needs.
A real StageWorker on 127.0.0.1:0 with mutual TLS, real credentials (tests/helpers/run_pki.py).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from agora.auth.node_state import NodeCredentials
from agora.node.rpc.server import run
from agora.node.rpc.tls import TlsChannels, worker_server_name
from agora.node.trainer.stage_client import StageClient
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.fingerprint import run_fingerprint
from run_pki import Pki, build_pki

pytestmark = pytest.mark.timeout(120)

RUN = "slots-run"
CONFIG = PRESETS["tiny"].with_stages(3)
# Room for 8 calls beside the probes: what grpc's own limit alone allowed every call, Watch streams included.
OPTIONS = WorkerOptions(max_queue=2, max_control_queue=2, max_concurrent_rpcs=8, max_probe_calls=4)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return build_pki(tmp_path_factory.mktemp("pki"), RUN)


async def start_worker(pki: Pki, stage: int) -> StageWorker:
    worker = StageWorker(CONFIG, stage, run_id=RUN, credentials=NodeCredentials(pki.workers[stage], clock=time.time),
                         options=OPTIONS)
    await worker.start()
    return worker


def stage_client(worker: StageWorker, directory) -> StageClient:
    """A StageClient presenting the credential in `directory` (a trainer's, a monitor's)."""
    return StageClient(worker.address, run_id=RUN, stage=worker.stage_index, model=CONFIG.model,
                       fingerprint=run_fingerprint(CONFIG), peer_id=worker.credentials.peer_id,
                       channels=TlsChannels(NodeCredentials(directory, clock=time.time)), timeout_s=10)


async def close(worker: StageWorker, client: StageClient, channels: list) -> None:
    await client.close()
    for channel in channels:
        await channel.close()
    await worker.stop(0)


def channel_as(directory, worker: StageWorker) -> grpc.aio.Channel:
    target = worker_server_name(worker.stage_index, worker.credentials.peer_id)
    return TlsChannels(NodeCredentials(directory, clock=time.time)).open(worker.address, target_name=target)


async def watch(channel: grpc.aio.Channel):
    """A health Watch stream and its first answer: a status when it was admitted, the error otherwise."""
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    try:
        return stream, (await stream.read()).status
    except grpc.aio.AioRpcError as error:
        return stream, error


async def reflect(channel: grpc.aio.Channel):
    """A reflection stream kept open after its first answer (what grpcurl holds while it works)."""
    requests: asyncio.Queue = asyncio.Queue()
    await requests.put(reflection_pb2.ServerReflectionRequest(list_services=""))

    async def sent():
        while True:
            yield await requests.get()
    stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(sent())
    try:
        return stream, await stream.read()
    except grpc.aio.AioRpcError as error:
        return stream, error


def refused(outcome) -> bool:
    return isinstance(outcome, grpc.aio.AioRpcError) and outcome.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_watch_streams_beyond_the_probe_pool_are_refused_and_a_trainer_still_runs_forward(pki):
    """A plain worker and a monitor open 12 Watch streams (more than the 8 calls the worker serves
    beside probes): each holds 2 (half the pool of 4), the rest are RESOURCE_EXHAUSTED (the worker's
    share, then the pool), another caller's Watch finds the pool full, and the trainer's Forward is
    served all the same."""
    tokens = torch.randint(0, CONFIG.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    async def main():
        worker = await start_worker(pki, 0)
        channels = [channel_as(directory, worker) for directory in (pki.workers[1], pki.monitor, pki.trainer_b)]
        trainer = stage_client(worker, pki.trainer)
        try:
            plain_worker = [await watch(channels[0]) for _ in range(6)]
            monitor = [await watch(channels[1]) for _ in range(6)]
            held = [stream for stream, outcome in plain_worker + monitor
                    if outcome == health_pb2.HealthCheckResponse.SERVING]
            assert len(held) == 4
            assert all(refused(outcome) and "at most 2 per caller" in outcome.details() for _, outcome in plain_worker[2:])
            assert all(refused(outcome) and "at most 4 health" in outcome.details() for _, outcome in monitor[2:])
            _, third = await watch(channels[2])
            assert refused(third) and "at most 4 health and reflection calls" in third.details()
            assert "worker.max_probe_calls" in third.details()

            reply = await trainer.forward("m", tokens)  # the probes took none of the trainer's calls
            assert reply is not None and (await worker.on_compute(lambda compute: len(compute.stash))) == 1
            assert worker.refusals.snapshot() == {"probe_caller_limit": 4, "probe_full": 5}

            held[0].cancel()  # a Watch that ends gives its slot back
            for _ in range(400):  # readiness: the server saw the cancellation
                _, outcome = await watch(channels[2])
                if outcome == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the pool never gave a slot back")
        finally:
            await close(worker, trainer, channels)

    run(main())


def test_reflection_streams_share_the_probe_pool_not_the_calls(pki):
    """Reflection streams held open by two workers fill the probe pool (a Watch is then refused);
    Info, a call of the other pool, is still served."""
    async def main():
        worker = await start_worker(pki, 1)
        channels = [channel_as(directory, worker) for directory in (pki.workers[0], pki.workers[2])]
        monitor = stage_client(worker, pki.monitor)
        try:
            streams = [await reflect(channels[0]) for _ in range(3)] + [await reflect(channels[1]) for _ in range(2)]
            outcomes = [outcome for _, outcome in streams]
            assert refused(outcomes[2]) and "at most 2 per caller" in outcomes[2].details()
            del streams[2], outcomes[2]
            assert all(outcome.list_services_response.service for outcome in outcomes)
            _, outcome = await watch(channels[1])
            assert refused(outcome) and "at most 4 health and reflection calls" in outcome.details()
            info = await monitor.info()
            assert info.stage == 1
            for stream, _ in streams:
                stream.cancel()
        finally:
            await close(worker, monitor, channels)

    run(main())
