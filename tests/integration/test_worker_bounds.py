"""Bounds at the door (issue 11): what a worker refuses before it allocates, and what that buys.

Three layers, cheapest first (the last in its own file):
- the pure rules of node/replica/bounds.py (shapes from the config, byte budgets, queue slots),
  without sockets;
- real in-process workers (head, body and tail of a 3-stage `tiny` run, --insecure, grpc.aio on
  127.0.0.1:0) sent raw protobuf requests whose codec frames are often a header and nothing more:
  each bound answers its status with a message naming the field and both values, and nothing is
  stashed, accumulated or stepped;
- one worker process under a flood: tests/integration/test_worker_memory.py.

The requests and frames are built in tests/helpers/stage_requests.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from concurrent.futures import Future
from dataclasses import replace

import grpc
import pytest
import torch

from agora.node.rpc.server import new_event_loop
from agora.node.replica.bounds import (
    HEADROOM_BYTES,
    OutOfBounds,
    RequestGeometry,
    SlotPool,
    SlotRefused,
    default_per_caller,
)
from agora.node.trainer.stage_client import InputRefused, StageClient
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.codec import WireCodec, WireFormatError, encode_tokens, peek_header
from agora.pipeline.config import ConfigError, checked
from agora.protos import stage_adapter as adapter
from agora.protos import stage_pb2

pytestmark = pytest.mark.timeout(120)

from stage_requests import (BODY, CONFIG, FINGERPRINT, HEAD, K, METADATA, ROWS, RUN, SEQ, TAIL, VOCAB,
                            forward, header, serialized, streamed, tokens, wire)


# ---------------------------------------------------------------------------------------------- pure rules


GEOMETRY = {stage: RequestGeometry.from_config(CONFIG, stage) for stage in (HEAD, BODY, TAIL)}


FORWARD_REFUSALS = [
    # (stage, fields, message): every one a frame header and nothing else where the shape is the point
    (BODY, dict(tokens=header("token", (4096, 8))),
     "tokens: 4096 rows, at most 2 (train.microbatch_size; raise with --max-rows)"),
    (BODY, dict(tokens=header("token", (2, 4096))), "tokens: sequence length 4096, at most 128 (train.seq_len)"),
    (BODY, dict(tokens=header("token", (2**32 - 1, 2**32 - 1))), "tokens: 4294967295 rows, at most 2"),
    (BODY, dict(tokens=header("token", (2, 8, 1))), "tokens: shape [2, 8, 1], expected [rows, seq] (2 dims)"),
    (BODY, dict(tokens=header("float", (2, 8))), "tokens: expected a token frame, found a float frame"),
    (BODY, dict(tokens=b"XYZ\x01\x02\x10\x02" + b"\0" * 8), "tokens: bad magic"),
    (BODY, dict(tokens=b""), "tokens: missing (empty frame)"),
    (BODY, dict(wire=header("float", (4096, 8, K))), "wire: 4096 rows, at most 2 (train.microbatch_size"),
    (BODY, dict(wire=header("float", (2, 8, K + 1))),
     "wire: last dim 17, this stage's wire width is 16 (model.wire_dim)"),
    (BODY, dict(wire=header("float", (2, 8))), "wire: shape [2, 8], expected [rows, seq, 16] (3 dims)"),
    (BODY, dict(wire=wire(rows=1)), "wire: shape [1, 8, 16] does not match tokens' [2, 8] (rows, seq)"),
    (BODY, dict(wire=b""), "wire: missing (empty frame)"),
    (BODY, dict(targets=tokens()), "targets: only the tail takes targets; this is stage 1 of 3"),
    (HEAD, dict(wire=wire()), "wire: the head stage takes token ids only, but a wire frame was sent"),
    (TAIL, dict(targets=tokens(seq=7)), "targets: shape [2, 7] does not match tokens' [2, 8]"),
    (TAIL, dict(targets=header("token", (2, 8, 4096))), "targets: shape [2, 8, 4096], expected [rows, seq]"),
]


@pytest.mark.parametrize("stage, fields, message", FORWARD_REFUSALS)
def test_a_forward_outside_the_geometry_is_refused_by_its_headers(stage, fields, message):
    with pytest.raises(OutOfBounds) as caught:
        GEOMETRY[stage].check_forward(forward(stage, **fields))
    assert message in str(caught.value)


def test_valid_requests_and_partial_stream_heads_pass():
    for stage in (HEAD, BODY, TAIL):
        GEOMETRY[stage].check_forward(forward(stage))
        GEOMETRY[stage].check_forward(forward(stage, tokens=tokens(ROWS, SEQ), wire=b"" if stage == HEAD else
                                              wire(ROWS, SEQ), targets=tokens(ROWS, SEQ) if stage == TAIL else b""))
    # A stream's first part may stop anywhere: inside a header (nothing to judge yet) or before a frame.
    body = GEOMETRY[BODY]
    body.check_forward(forward(BODY, tokens=tokens()[:9], wire=b""), partial=True)
    body.check_forward(forward(BODY, tokens=b"", wire=b""), partial=True)
    body.check_backward(adapter.BackwardRequest(RUN, "m", BODY, output_grad=wire()[:10]), partial=True)
    # ...but a header that has arrived is judged at once.
    with pytest.raises(OutOfBounds, match="tokens: 4096 rows"):
        body.check_forward(forward(BODY, tokens=header("token", (4096, 8)), wire=b""), partial=True)
    with pytest.raises(OutOfBounds, match="tokens: bad magic"):
        body.check_forward(forward(BODY, tokens=b"NOP\x01\x02\x10\x02\x02", wire=b""), partial=True)


def test_an_output_gradient_outside_the_geometry_is_refused():
    body = GEOMETRY[BODY]
    body.check_backward(adapter.BackwardRequest(RUN, "m", BODY, output_grad=wire(ROWS, SEQ)))
    cases = [(header("float", (4096, 8, K)), "output_grad: 4096 rows, at most 2"),
             (header("float", (2, 4096, K)), "output_grad: sequence length 4096, at most 128"),
             (header("float", (2, 8, 4096)), "output_grad: last dim 4096, this stage's wire width is 16"),
             (header("token", (2, 8)), "output_grad: expected a float frame, found a token frame"),
             (b"", "output_grad: missing (empty frame)")]
    for frame, message in cases:
        with pytest.raises(OutOfBounds) as caught:
            body.check_backward(adapter.BackwardRequest(RUN, "m", BODY, output_grad=frame))
        assert message in str(caught.value)
    GEOMETRY[TAIL].check_backward(adapter.BackwardRequest(RUN, "m", TAIL, output_grad=b"anything"))


def test_budgets_follow_from_the_geometry():
    body, head, tail = GEOMETRY[BODY], GEOMETRY[HEAD], GEOMETRY[TAIL]
    token_frame = 7 + 4 * 2 + 4 * ROWS * SEQ  # uint32 ids, the widest a sender may pick
    wire_frame = 7 + 4 * 3 + 4 * ROWS * SEQ * K  # fp32 (int8 is smaller at width 16)
    assert head.forward_budget() == token_frame + HEADROOM_BYTES
    assert body.forward_budget() == token_frame + wire_frame + HEADROOM_BYTES
    assert tail.forward_budget() == 2 * token_frame + wire_frame + HEADROOM_BYTES
    assert body.backward_budget() == wire_frame + HEADROOM_BYTES and tail.backward_budget() == HEADROOM_BYTES
    # One message carries the largest Forward or the largest Prefill (a session of model.max_seq_len).
    prefill = body.for_inference(CONFIG.model.max_seq_len).inference_budget()
    assert body.message_budget() == max(body.forward_budget(), prefill) < 128 * 2**10  # not the worker-wide 16 MiB
    # The largest valid request in any dtype fits its budget, with room for the scalar fields.
    for dtype in ("fp32", "bf16", "fp16", "int8"):
        widest_ids = encode_tokens(torch.full((ROWS, SEQ), VOCAB - 1), 2**32)
        biggest = forward(TAIL, microbatch_id="x" * 256, tokens=widest_ids,
                          wire=WireCodec(dtype).encode(torch.ones(ROWS, SEQ, K)),
                          targets=encode_tokens(torch.zeros(ROWS, SEQ, dtype=torch.long), 2**32))
        assert adapter.to_message(biggest).ByteSize() <= tail.message_budget()
    assert "2 rows (train.microbatch_size; raise with --max-rows) x 128 tokens" in body.describe_budget("Forward")


def test_max_rows_only_raises_the_configured_microbatch():
    raised = RequestGeometry.from_config(CONFIG, BODY, max_rows=64)
    assert raised.max_rows == 64 and raised.rows_source == "--max-rows"
    with pytest.raises(OutOfBounds, match=r"tokens: 65 rows, at most 64 \(--max-rows\)"):
        raised.check_forward(forward(BODY, tokens=header("token", (65, 8)), wire=b""), partial=True)
    assert RequestGeometry.from_config(CONFIG, BODY, max_rows=ROWS).rows_source.startswith("train.microbatch_size")
    with pytest.raises(ConfigError, match="worker.max_rows: 1 is below train.microbatch_size=2"):
        RequestGeometry.from_config(CONFIG, BODY, max_rows=1)


def test_peek_header_reads_only_the_header():
    assert peek_header(header("token", (4096, 4096)), "token").shape == (4096, 4096)
    assert peek_header(header("token", (4096, 4096)), "token").frame_bytes == 15 + 4096 * 4096
    assert peek_header(header("float", (2, 3, 4))[:12], "float") is None  # cut inside the dims
    assert peek_header(b"AGW", "float") is None
    with pytest.raises(WireFormatError, match="expected a float frame, found a token frame"):
        peek_header(header("token", (2, 3)), "float")
    with pytest.raises(WireFormatError, match="every dim must be positive"):
        peek_header(header("float", (2, 0, 4)), "float")


def test_slot_pool_bounds_the_whole_and_each_caller():
    pool = SlotPool("stage 1 worker", 4, 2, option="worker.max_queue_per_caller")
    a1, a2 = pool.acquire("a"), pool.acquire("a")
    with pytest.raises(SlotRefused) as caught:
        pool.acquire("a")
    assert caught.value.reason == "caller_limit"
    assert str(caught.value) == ("stage 1 worker: this caller already holds 2 of its 4 slots, at most 2 per caller "
                                 "(worker.max_queue_per_caller); retry when one of yours finishes")
    b1, b2 = pool.acquire("b"), pool.acquire("b")
    with pytest.raises(SlotRefused, match="stage 1 worker is full: 4 requests in flight"):
        pool.acquire("c")
    job: Future = Future()
    a1.hand_off(job)
    a1.close()  # handed to a job: the job's end releases it, not the caller's
    assert pool.in_use == 4 and pool.held_by("a") == 2
    job.set_result(None)
    assert pool.in_use == 3 and pool.held_by("a") == 1
    a2.close()
    a2.close()  # idempotent
    assert pool.in_use == 2 and pool.held_by("a") == 0
    pool.acquire("c").close()
    for slot in (b1, b2):
        slot.close()
    assert pool.in_use == 0
    assert [default_per_caller(n) for n in (1, 2, 4, 8, 64)] == [1, 2, 3, 6, 48]


def test_worker_options_for_the_bounds_are_checked():
    # The queue defaults to the stash's capacity (the in-flight depth the memory plan sizes).
    options = WorkerOptions()
    assert (options.queue_capacity, options.queue_per_caller, options.control_queue,
            options.concurrent_rpcs) == (64, 48, 64, 288)
    assert replace(options, stash_capacity=16).queue_capacity == 16
    options = WorkerOptions(max_queue=8)
    assert (options.queue_per_caller, options.control_queue, options.concurrent_rpcs) == (6, 8, 64)
    for bad, message in [(dict(max_queue_per_caller=9), "worker.max_queue_per_caller: 9 is above max_queue=8"),
                         (dict(max_queue=0), "worker.max_queue: must be > 0, got 0"),
                         (dict(max_rows=0), "worker.max_rows: must be > 0, got 0"),
                         (dict(max_control_queue=-1), "worker.max_control_queue: must be > 0, got -1"),
                         (dict(max_concurrent_rpcs=16), "worker.max_concurrent_rpcs: 16 leaves no room"),
                         (dict(wire_dtype="fp8"), "worker.wire_dtype: expected one of fp32, bf16, fp16 or int8"),
                         (dict(stream_chunk_bytes=2**30), "worker.stream_chunk_bytes: 1073741824 must be below"),
                         (dict(gradient_bound_factor=1.0), "worker.gradient_bound_factor: must be > 1, got 1.0"),
                         (dict(gradient_bound_warmup=0), "worker.gradient_bound_warmup: must be >= 1, got 0")]:
        with pytest.raises(ConfigError, match=message):
            checked(WorkerOptions, "worker", **{**dataclasses.asdict(options), **bad, "inference": options.inference})
    with pytest.raises(ConfigError, match="worker.max_rows: 1 is below train.microbatch_size=2"):
        StageWorker(CONFIG, BODY, run_id=RUN, options=WorkerOptions(max_rows=1))


# ---------------------------------------------------------------------------------------------- real workers


class Workers:
    """Head, body and tail workers (--insecure) on one event loop, driven with raw requests."""

    def __init__(self, options: WorkerOptions, stages=(HEAD, BODY, TAIL)):
        self.loop = new_event_loop()
        self.options = options
        self.stages = stages
        self.workers: dict[int, StageWorker] = {}
        self.channels: dict[int, grpc.aio.Channel] = {}

    def start(self) -> "Workers":
        async def start():
            for stage in self.stages:
                worker = StageWorker(CONFIG, stage, run_id=RUN, options=self.options)
                await worker.start()
                self.workers[stage] = worker
                self.channels[stage] = grpc.aio.insecure_channel(worker.address)
        self.loop.run_until_complete(start())
        return self

    def stop(self) -> None:
        async def stop():
            for channel in self.channels.values():
                await channel.close()
            for worker in self.workers.values():
                await worker.stop(0)
        self.loop.run_until_complete(stop())
        self.loop.close()

    def call(self, stage: int, method: str, parts: list, **kwargs):
        """Send serialized parts; (code, details, replies)."""
        path = f"/{adapter.SERVICE_NAME}/{method}"
        channel = self.channels[stage]

        async def go():
            if method.endswith("Stream"):
                call = channel.stream_stream(path)(iter(parts), metadata=METADATA, timeout=20, **kwargs)
                return [reply async for reply in call]
            return [await channel.unary_unary(path)(parts[0], metadata=METADATA, timeout=20, **kwargs)]
        try:
            return grpc.StatusCode.OK, "", self.loop.run_until_complete(go())
        except grpc.aio.AioRpcError as error:
            return error.code(), error.details(), []

    def state(self, stage: int) -> tuple:
        """What a served call would change: stash, accumulated microbatches, step, load."""
        worker = self.workers[stage]
        return self.loop.run_until_complete(worker.on_compute(
            lambda c: (len(c.stash), c.accumulated_microbatches, c.optimizer.steps))) + (worker.load,)


@pytest.fixture(scope="module")
def workers():
    started = Workers(WorkerOptions()).start()
    try:
        yield started
    finally:
        started.stop()


@pytest.mark.parametrize("stage, fields, message", FORWARD_REFUSALS)
def test_the_worker_refuses_each_bound_unary_and_streamed_and_changes_nothing(workers, stage, fields, message):
    request = forward(stage, microbatch_id=f"refused-{len(message)}", **fields)
    before = workers.state(stage)
    refusals = workers.workers[stage].refusals.snapshot().get("out_of_bounds", 0)
    for method, parts in (("Forward", serialized(request)), ("ForwardStream", streamed(request, 97))):
        code, details, _ = workers.call(stage, method, parts)
        assert (code, message in details) == (grpc.StatusCode.INVALID_ARGUMENT, True), (method, code, details)
    assert workers.state(stage) == before
    assert workers.workers[stage].refusals.snapshot()["out_of_bounds"] == refusals + 2


def test_a_huge_declared_stream_is_refused_on_its_first_part(workers):
    """4096 rows declared in the first part, then 4 MiB of payload: INVALID_ARGUMENT naming the rows
    (read to its end first, so the client sees it rather than INTERNAL), nothing reassembled."""
    frame = header("token", (4096, 1024))
    parts = [stage_pb2.ForwardRequest(run_id=RUN, microbatch_id="huge", stage=BODY, tokens=frame).SerializeToString()]
    parts += [stage_pb2.ForwardRequest(tokens=b"\0" * 2**16).SerializeToString()] * 64
    before = workers.state(BODY)
    code, details, _ = workers.call(BODY, "ForwardStream", parts)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tokens: 4096 rows, at most 2" in details, details
    assert workers.state(BODY) == before


def test_a_stream_over_its_budget_is_refused_naming_the_budget(workers):
    """Headers within bounds, then more bytes than they imply: RESOURCE_EXHAUSTED at the budget."""
    budget = GEOMETRY[BODY].forward_budget()
    request = forward(BODY, microbatch_id="padded", wire=wire() + b"\0" * (budget + 1))
    before = workers.state(BODY)
    code, details, _ = workers.call(BODY, "ForwardStream", streamed(request, 32 * 2**10))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert f"streamed ForwardRequest exceeds the {budget}-byte limit (2 rows (train.microbatch_size" in details
    assert workers.state(BODY) == before


def test_one_message_is_capped_by_the_geometry_not_16_mib(workers):
    """A unary Forward carrying a full 2 MiB token frame (16k rows of 128 ids, which the embedding
    would turn into 1 GiB): grpc refuses it at the geometry's message budget, before any handler."""
    request = forward(BODY, microbatch_id="big", tokens=encode_tokens(torch.zeros(2**14, SEQ, dtype=torch.long), VOCAB))
    code, details, _ = workers.call(BODY, "Forward", serialized(request))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert str(GEOMETRY[BODY].message_budget()) in details, details


def test_an_output_gradient_unlike_the_stashed_output_is_refused_and_the_stash_kept(workers):
    request = forward(BODY, microbatch_id="pending")
    code, details, _ = workers.call(BODY, "Forward", serialized(request))
    assert code == grpc.StatusCode.OK, details
    before = workers.state(BODY)
    for frame, message in [(wire(rows=1), "output_grad: shape mismatch: expected [2, 8, 16], found [1, 8, 16]"),
                           (header("float", (4096, 8, K)), "output_grad: 4096 rows, at most 2"),
                           (header("float", (2, 8, 3)), "output_grad: last dim 3, this stage's wire width is 16")]:
        backward = adapter.BackwardRequest(RUN, "pending", BODY, output_grad=frame)
        for method, parts in (("Backward", serialized(backward)), ("BackwardStream", streamed(backward, 97))):
            code, details, _ = workers.call(BODY, method, parts)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details, (method, details)
    assert workers.state(BODY) == before
    code, details, _ = workers.call(BODY, "Backward", serialized(adapter.BackwardRequest(RUN, "pending", BODY, wire())))
    assert code == grpc.StatusCode.OK, details  # the entry was kept for the real gradient


def test_an_output_gradient_far_beyond_the_ones_the_worker_took_is_refused_naming_it_and_counted():
    """A trainer (a StageClient over gRPC) sends a body honest output gradients, one a million times
    larger once the worker's bound is warm (4 taken), then honest ones again. The huge one is refused
    with INVALID_ARGUMENT naming output_grad in its trailing metadata (the client's `InputRefused`),
    counted as `extreme_output_grad`, and changes nothing: the stashed input stays for the honest
    gradient that follows, which is taken like every other."""
    started = Workers(WorkerOptions(gradient_bound_warmup=4), stages=(BODY,)).start()
    usual = torch.randn(2, 8, K, generator=torch.Generator().manual_seed(5)) * 1e-3
    try:
        body = started.workers[BODY]
        client = StageClient(body.address, run_id=RUN, stage=BODY, model=CONFIG.model, fingerprint=FINGERPRINT)

        async def backward(microbatch_id: str, grad: torch.Tensor):
            await client.forward(microbatch_id, torch.zeros(2, 8, dtype=torch.long), wire())
            return await client.backward(microbatch_id, grad)

        async def state():
            return await body.on_compute(lambda c: (len(c.stash), c.accumulated_microbatches, c.optimizer.steps))

        async def scenario():
            for index in range(4):
                await backward(f"warm{index}", usual * (1 + index))
            before = await state()
            with pytest.raises(InputRefused) as refused:
                await backward("huge", usual * 1e6)
            after = await state()
            await client.backward("huge", usual)  # the same microbatch, an honest gradient: kept for it
            await backward("later", usual * 3)
            await client.close()
            return refused.value, before, after

        refused, before, after = started.loop.run_until_complete(scenario())
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and refused.field == "output_grad"
        assert "output_grad: values up to" in refused.details and "the stashed input is kept" in refused.details
        assert after[1:] == before[1:] and after[0] == before[0] + 1  # its forward stashed, nothing applied
        assert body.refusals.snapshot().get("extreme_output_grad") == 1
        assert started.state(BODY)[:2] == (0, 6)  # every other backward taken, nothing left stashed
    finally:
        started.stop()


def test_slots_per_caller_streams_admitted_on_their_first_part_and_step_gets_through():
    """max_queue 4, 2 per caller (one caller here: --insecure callers on one host share an identity).
    A stream holds its slot from its first part; a third request of the caller is refused naming
    the limit; a Step is admitted into its own pool while the caller's data slots are full, and
    Steps are bounded too."""
    options = WorkerOptions(max_queue=4, max_queue_per_caller=2, max_control_queue=2)
    started = Workers(options, stages=(BODY,)).start()
    release = threading.Event()
    try:
        body = started.workers[BODY]
        loop = started.loop
        channel = started.channels[BODY]
        path = f"/{adapter.SERVICE_NAME}/"

        async def scenario():
            blocker = asyncio.ensure_future(body.on_compute(lambda _: release.wait(30)))
            first = asyncio.ensure_future(channel.unary_unary(path + "Forward")(
                serialized(forward(BODY, microbatch_id="a"))[0], metadata=METADATA, timeout=20))
            rest: asyncio.Queue = asyncio.Queue()
            parts = streamed(forward(BODY, microbatch_id="b"), 64)

            async def trickle():
                yield parts[0]
                while (part := await rest.get()) is not None:
                    yield part
            stream = channel.stream_stream(path + "ForwardStream")(trickle(), metadata=METADATA, timeout=20)
            for _ in range(2000):  # readiness: both admitted (the stream on its first part only)
                if body.load == 2:
                    break
                await asyncio.sleep(0.005)
            assert body.load == 2
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.unary_unary(path + "Forward")(serialized(forward(BODY, microbatch_id="c"))[0],
                                                             metadata=METADATA, timeout=20)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ("this caller already holds 2 of its 4 slots, at most 2 per caller (worker.max_queue_per_caller)"
                    in caught.value.details())
            step = adapter.StepRequest(RUN, BODY, microbatches=1, completed_batch=0, replicas=1)
            steps = [asyncio.ensure_future(channel.unary_unary(path + "Step")(serialized(step)[0], metadata=METADATA,
                                                                              timeout=20)) for _ in range(2)]
            for _ in range(2000):
                if body.control_load == 2:
                    break
                await asyncio.sleep(0.005)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.unary_unary(path + "Step")(serialized(step)[0], metadata=METADATA, timeout=20)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "stage 1 worker's Step/Abort queue is full: 2 requests in flight" in caught.value.details()
            for part in parts[1:]:
                rest.put_nowait(part)
            rest.put_nowait(None)
            release.set()
            await blocker
            await first
            assert len([reply async for reply in stream]) >= 1
            await asyncio.gather(*steps)
            return body.load, body.control_load

        assert loop.run_until_complete(scenario()) == (0, 0)
        assert body.refusals.snapshot() == {"caller_limit": 1}
    finally:
        release.set()
        started.stop()


def test_a_trickling_stream_loses_its_slot_after_stream_timeout_s():
    """Admitted on its first part, then nothing: the slot is given back after stream_timeout_s and
    the worker serves the next request, while the stalled client's call is still open."""
    started = Workers(WorkerOptions(max_queue=1, stream_timeout_s=0.3), stages=(BODY,)).start()
    try:
        body, channel = started.workers[BODY], started.channels[BODY]
        path = f"/{adapter.SERVICE_NAME}/"

        async def scenario():
            hold = asyncio.Event()
            parts = streamed(forward(BODY, microbatch_id="stalled"), 64)

            async def stalled():
                yield parts[0]
                await hold.wait()
                for part in parts[1:]:
                    yield part
            call = channel.stream_stream(path + "ForwardStream")(stalled(), metadata=METADATA, timeout=20)
            reading = asyncio.ensure_future(call.read())
            admitted_at = None
            for _ in range(2000):  # readiness: admitted, then released by the timeout
                if admitted_at is None and body.load == 1:
                    admitted_at = time.monotonic()
                if admitted_at is not None and body.load == 0:
                    break
                await asyncio.sleep(0.005)
            held_s = time.monotonic() - admitted_at
            reply = stage_pb2.ForwardReply.FromString(await channel.unary_unary(path + "Forward")(
                serialized(forward(BODY, microbatch_id="next"))[0], metadata=METADATA, timeout=20))
            hold.set()
            outcome = (await asyncio.gather(reading, return_exceptions=True))[0]
            return held_s, reply, outcome

        held_s, reply, outcome = started.loop.run_until_complete(scenario())
        assert 0.2 < held_s < 5 and peek_header(reply.wire, "float").shape == (2, 8, K)
        assert isinstance(outcome, grpc.aio.AioRpcError)  # DEADLINE_EXCEEDED, or INTERNAL (grpc/grpc#36066)
        assert started.state(BODY)[:2] == (1, 0)  # only "next" is stashed
    finally:
        started.stop()


def test_calls_beyond_max_concurrent_rpcs_are_refused():
    """max_concurrent_rpcs bounds what every call may hold in sum: with 3, a Forward waiting on the
    compute thread, a Step behind it and a stream still being written leave no room for a fourth."""
    options = WorkerOptions(max_queue=1, max_control_queue=1, max_concurrent_rpcs=3)
    started = Workers(options, stages=(BODY,)).start()
    release = threading.Event()
    try:
        body = started.workers[BODY]
        channel = started.channels[BODY]
        path = f"/{adapter.SERVICE_NAME}/"

        async def scenario():
            blocker = asyncio.ensure_future(body.on_compute(lambda _: release.wait(30)))
            forwarded = asyncio.ensure_future(channel.unary_unary(path + "Forward")(
                serialized(forward(BODY, microbatch_id="a"))[0], metadata=METADATA, timeout=20))
            step = adapter.StepRequest(RUN, BODY, microbatches=1, completed_batch=0, replicas=1)
            stepped = asyncio.ensure_future(channel.unary_unary(path + "Step")(
                serialized(step)[0], metadata=METADATA, timeout=20))
            hold = asyncio.Event()

            async def held_back():
                await hold.wait()
                yield serialized(forward(BODY, microbatch_id="b"))[0]
            stream = channel.stream_stream(path + "ForwardStream")(held_back(), metadata=METADATA, timeout=20)
            streaming = asyncio.ensure_future(stream.read())
            for _ in range(2000):  # readiness: the Forward and the Step admitted
                if body.load == 1 and body.control_load == 1:
                    break
                await asyncio.sleep(0.005)
            for _ in range(400):  # the stream reaches the server's count of calls (no part sent yet)
                try:
                    await channel.unary_unary(path + "Info")(stage_pb2.InfoRequest().SerializeToString(),
                                                             metadata=METADATA, timeout=20)
                except grpc.aio.AioRpcError as error:
                    refused = error
                    break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError("a fourth call was served beside three in flight")
            release.set()
            hold.set()
            await blocker
            await forwarded
            await stepped
            await asyncio.gather(streaming, return_exceptions=True)  # served, or refused if "a" still ran
            return refused

        refused = started.loop.run_until_complete(scenario())
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
    finally:
        release.set()
        started.stop()
