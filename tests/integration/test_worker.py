"""Stage workers over real grpc.aio on 127.0.0.1:0, driven by StageClient, one event loop per test."""

from __future__ import annotations

import asyncio
import struct
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from agora.node.rpc.interceptors import CallHook
from agora.node.rpc.server import run
from agora.node.trainer.stage_client import RequestRefused, StageClient, WorkerBusy, WorkerUnreachable
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.codec import WireCodec, encode_tokens
from agora.pipeline.config import PRESETS
from agora.pipeline.fingerprint import run_fingerprint
from agora.pipeline.optim import StageOptimizer
from agora.pipeline.stages import build_stage
from fake_clock import FakeClock

pytestmark = pytest.mark.timeout(60)

CONFIG = PRESETS["tiny"].with_stages(3)
K = CONFIG.model.wire_dim
RUN = "test-run"
FINGERPRINT = run_fingerprint(CONFIG)


def batch(seed: int, size: int = 2, seq: int = 32):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.model.vocab_size, (size, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def client_for(worker: StageWorker, stage: int | None = None, **kwargs) -> StageClient:
    kwargs.setdefault("run_id", RUN)
    kwargs.setdefault("fingerprint", FINGERPRINT)
    return StageClient(worker.address, stage=worker.stage_index if stage is None else stage,
                       model=CONFIG.model, **kwargs)


class Arrivals(CallHook):
    """The readiness handshake for "the worker has admitted my request": its handler admits a call
    before it first yields, so once `before` has run for it, it holds a queue slot."""

    def __init__(self):
        super().__init__()
        self.arrived = asyncio.Event()

    async def before(self, call, context):
        self.arrived.set()


def snapshot(kind: str):
    def read(compute):
        return {name: (p.grad if kind == "grad" else p).detach().clone()
                for name, p in compute.stage.named_parameters() if kind != "grad" or p.grad is not None}
    return read


def test_three_workers_reproduce_the_in_process_pipeline():
    """Loss, parameter gradients and two steps of parameters equal the composed local stages."""
    reference = [build_stage(CONFIG.model, i) for i in range(3)]
    optimizers = [StageOptimizer(s, CONFIG.optim, i, 3) for i, s in enumerate(reference)]
    batches = [[batch(10 * step + m) for m in range(2)] for step in range(2)]

    async def main():
        options = WorkerOptions(synchronous=True)
        workers = [StageWorker(CONFIG, i, run_id=RUN, options=options) for i in range(3)]
        for worker in workers:
            await worker.start()
        clients = [client_for(w) for w in workers]
        try:
            for step, microbatches in enumerate(batches):
                for m, (tokens, targets) in enumerate(microbatches):
                    mb = f"s{step}m{m}"
                    head = await clients[0].forward(mb, tokens)
                    body = await clients[1].forward(mb, tokens, head.wire)
                    tail = await clients[2].forward(mb, tokens, body.wire_frame, targets)  # frames pass through
                    body_back = await clients[1].backward(mb, tail.input_grad)
                    head_back = await clients[0].backward(mb, body_back.grad_frame)
                    assert head_back.input_grad is None and head.step == step

                    ref_loss = reference[2](tokens, reference[1](tokens, reference[0](tokens)), targets)
                    ref_loss.backward()
                    torch.testing.assert_close(torch.tensor(tail.loss), ref_loss.detach())
                for i, worker in enumerate(workers):
                    grads = await worker.on_compute(snapshot("grad"))
                    expected = {n: p.grad for n, p in reference[i].named_parameters() if p.grad is not None}
                    assert grads.keys() == expected.keys()
                    torch.testing.assert_close(grads, expected)
                replies = [await c.step(len(microbatches), step=step) for c in clients]
                results = [opt.step(len(microbatches)) for opt in optimizers]
                for reply, result in zip(replies, results):
                    assert reply.step == step + 1 and reply.accumulated == 2
                    assert reply.grad_norm == pytest.approx(result["grad_norm"], rel=1e-5)
                for i, worker in enumerate(workers):
                    torch.testing.assert_close(await worker.on_compute(snapshot("param")),
                                               {n: p.detach() for n, p in reference[i].named_parameters()})
            info = await clients[1].info()
            assert (info.stage, info.n_stages, info.step, info.phase, info.load, info.stashed) == (1, 3, 2, "member", 0, 0)
            assert info.run_id == RUN and info.synchronous and info.throughput > 0
        finally:
            for c in clients:
                await c.close()
            for w in workers:
                await w.stop()

    run(main())


def nan_frame(shape) -> bytes:
    frame = bytearray(WireCodec().encode(torch.zeros(shape)))
    struct.pack_into("<f", frame, 7 + 4 * len(shape), float("nan"))  # first payload element
    return bytes(frame)


def test_malformed_requests_are_refused_and_the_worker_keeps_serving():
    tokens, targets = batch(1)
    good_wire = torch.randn(2, 32, K)

    async def main():
        async with StageWorker(CONFIG, 1, run_id=RUN) as worker, \
                StageWorker(CONFIG, 2, run_id=RUN) as tail_worker:
            body, tail = client_for(worker), client_for(tail_worker)
            bad_tokens = tokens.clone()
            bad_tokens[0, 0] = 300  # framed as uint16, beyond the run's vocabulary of 256
            cases = {
                "bad magic": lambda: body.forward("m", tokens, b"not a wire frame at all"),
                "wire: last dim 17, this stage's wire width is 16":
                    lambda: body.forward("m", tokens, torch.randn(2, 32, K + 1)),
                "NaN": lambda: body.forward("m", tokens, nan_frame((2, 32, K))),
                "token id 300 is out of range": lambda: body.forward("m", encode_tokens(bad_tokens, 2**16), good_wire),
                "stage 2 reached a worker of stage 1":
                    lambda: client_for(worker, stage=2).forward("m", tokens, good_wire),
                "does not match this worker's run":
                    lambda: client_for(worker, run_id="other").forward("m", tokens, good_wire),
                "targets: missing": lambda: tail.forward("m", tokens, good_wire),
                "microbatch_id": lambda: body.forward("", tokens, good_wire),
            }
            for expected, call in cases.items():
                with pytest.raises(RequestRefused) as caught:
                    await call()
                assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT, expected
                assert expected in caught.value.details, (expected, caught.value.details)
            with pytest.raises(RequestRefused) as caught:
                await tail.step(1)
            assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION  # asynchronous worker
            good = await body.forward("m", tokens, good_wire)
            assert good.wire.shape == (2, 32, K)
            assert (await tail.forward("m", tokens, good.wire, targets)).loss > 0
            await body.close()
            await tail.close()

    run(main())


def test_payload_limits_and_streaming():
    """Over one message: RESOURCE_EXHAUSTED unless streamed; a stream's declared rows are checked on
    its first part (every bound: tests/integration/test_worker_bounds.py)."""
    options = WorkerOptions(max_message_bytes=128 * 2**10, stream_chunk_bytes=32 * 2**10,
                            max_stream_bytes=400 * 2**10, max_rows=25)
    tokens, _ = batch(2, size=25, seq=128)  # wire frame: 25 * 128 * 16 * 4 = 200 KiB
    wire = torch.randn(25, 128, K)

    async def main():
        async with StageWorker(CONFIG, 1, run_id=RUN, options=options) as worker:
            unary = client_for(worker, max_message_bytes=4 * 2**20)  # believes the worker takes big messages
            with pytest.raises(WorkerBusy) as caught:
                await unary.forward("big", tokens, wire)
            assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            streaming = client_for(worker, max_message_bytes=128 * 2**10, stream_chunk_bytes=32 * 2**10)
            huge_tokens, _ = batch(3, size=40, seq=128)  # more rows than the worker takes
            with pytest.raises(RequestRefused, match="tokens: 40 rows, at most 25"):
                await streaming.forward("huge", huge_tokens, torch.randn(40, 128, K))
            out = await streaming.forward("big", tokens, wire)  # streamed both ways
            assert out.wire.shape == (25, 128, K)
            back = await streaming.backward("big", torch.ones(25, 128, K))
            assert back.input_grad.shape == (25, 128, K)
            small_tokens, _ = batch(4)
            assert (await unary.forward("small", small_tokens, torch.randn(2, 32, K))).wire.shape == (2, 32, K)
            await unary.close()
            await streaming.close()

    run(main())


def test_full_queue_answers_resource_exhausted():
    tokens, _ = batch(5)
    release = threading.Event()

    async def main():
        arrivals = Arrivals()
        async with StageWorker(CONFIG, 0, run_id=RUN, options=WorkerOptions(max_queue=1),
                               interceptors=[arrivals]) as worker:
            client = client_for(worker)
            blocker = asyncio.ensure_future(worker.on_compute(lambda _: release.wait(30)))
            first = asyncio.ensure_future(client.forward("first", tokens))
            await asyncio.wait_for(arrivals.arrived.wait(), 20)
            assert worker.load == 1
            with pytest.raises(WorkerBusy) as caught:
                await client.forward("second", tokens)
            assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "full" in caught.value.details
            release.set()
            await blocker
            assert (await first).wire.shape == (2, 32, K)
            assert (await client.forward("third", tokens)).wire.shape == (2, 32, K)
            await client.close()

    run(main())


def test_stale_backward_for_an_expired_or_evicted_microbatch_is_a_clean_error():
    tokens, _ = batch(6)
    clock = FakeClock()
    options = WorkerOptions(stash_capacity=2, stash_ttl_s=30.0)

    async def main():
        async with StageWorker(CONFIG, 0, run_id=RUN, options=options, clock=clock) as worker:
            client = client_for(worker)
            grad = torch.ones(2, 32, K)
            for name in ("a", "b", "c"):  # capacity 2: "a" is evicted by "c"
                await client.forward(name, tokens)
            with pytest.raises(RequestRefused) as caught:
                await client.backward("a", grad)
            assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "'a'" in caught.value.details and "evicted" in caught.value.details
            await client.backward("b", grad)
            clock.now = 31.0  # "c" is past its TTL
            with pytest.raises(RequestRefused, match="rerun the microbatch"):
                await client.backward("c", grad)
            await client.forward("d", tokens)
            await client.backward("d", grad)  # and the worker still serves
            await client.close()

    run(main())


class Recorder(CallHook):
    """A metrics-like observer and a credential-check-like gate on the same chain."""

    def __init__(self):
        super().__init__()
        self.records = []

    async def before(self, call, context):
        if call.method.endswith("/Step"):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no credential for Step")

    def after(self, record):
        self.records.append((record.method.rsplit("/", 1)[-1], record.code))


def test_health_reflection_and_interceptor_chain():
    async def main():
        recorder = Recorder()
        async with StageWorker(CONFIG, 2, run_id=RUN, interceptors=[recorder],
                               options=WorkerOptions(synchronous=True)) as worker:
            async with grpc.aio.insecure_channel(worker.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for service in ("", "agora.v1.Stage"):
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
                responses = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                names = {s.name async for r in responses for s in r.list_services_response.service}
                assert {"agora.v1.Stage", "grpc.health.v1.Health"} <= names
            client = client_for(worker)
            with pytest.raises(RequestRefused) as caught:
                await client.step(1)
            assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(RequestRefused):
                tokens, targets = batch(7)
                await client.forward("m", tokens, targets=targets)  # a tail without its wire input
            await client.info()
            await client.close()
        assert ("Step", grpc.StatusCode.PERMISSION_DENIED) in recorder.records
        assert ("Forward", grpc.StatusCode.INVALID_ARGUMENT) in recorder.records
        assert ("Info", grpc.StatusCode.OK) in recorder.records
        assert ("Check", grpc.StatusCode.OK) in recorder.records

    run(main())


def test_graceful_stop_finishes_in_flight_work_then_refuses():
    tokens, _ = batch(8)
    release = threading.Event()

    async def main():
        arrivals = Arrivals()
        worker = StageWorker(CONFIG, 0, run_id=RUN, interceptors=[arrivals])
        await worker.start()
        client = client_for(worker, timeout_s=10)
        blocker = asyncio.ensure_future(worker.on_compute(lambda _: release.wait(30)))
        in_flight = asyncio.ensure_future(client.forward("m", tokens))
        await asyncio.wait_for(arrivals.arrived.wait(), 20)
        assert worker.load == 1
        stopping = asyncio.ensure_future(worker.stop(grace_s=20))
        while worker.phase != "leaving":  # yield to the loop until the stop task has begun (no timed wait)
            await asyncio.sleep(0)
        release.set()
        await blocker
        assert (await in_flight).wire.shape == (2, 32, K)
        await stopping
        with pytest.raises(WorkerUnreachable):
            await client.info(timeout_s=2)
        await client.close()

    run(main())


def test_serve_runs_until_cancelled_then_stops_gracefully():
    async def main():
        worker = StageWorker(CONFIG, 1, run_id=RUN)
        await worker.start()  # serve() starts a worker that is not started yet, and serves a started one
        serving = asyncio.ensure_future(worker.serve())
        client = client_for(worker)
        assert (await client.info()).phase == "member"
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving
        assert not worker.is_serving and worker.phase == "leaving"
        with pytest.raises(WorkerUnreachable):
            await client.info(timeout_s=2)
        await client.close()

    run(main())
