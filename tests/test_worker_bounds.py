"""Bounds at the door (issue 11): what a worker refuses before it allocates, and what that buys.

Three layers, cheapest first:
- the pure rules of node/worker/bounds.py (shapes from the config, byte budgets, queue slots),
  without sockets;
- real in-process workers (head, body and tail of a 3-stage `tiny` run, --insecure, grpc.aio on
  127.0.0.1:0) sent raw protobuf requests whose codec frames are often a header and nothing more:
  each bound answers its status with a message naming the field and both values, and nothing is
  stashed, accumulated or stepped;
- one worker process under a flood (slow): several credentialed clients at once, valid calls
  mixed with oversized and malformed ones; its peak RSS stays within a bound derived from the
  geometry, and every valid call is served.
"""

from __future__ import annotations

import asyncio
import select
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import replace

import grpc
import pytest
import torch

from agora.auth.authority import RunAuthority
from agora.auth.grpc_policy import FINGERPRINT_METADATA
from agora.auth.node_state import NodeCredentials
from agora.node.rpc.server import new_event_loop, run
from agora.node.rpc.tls import TlsChannels, worker_server_name
from agora.node.worker.bounds import (
    HEADROOM_BYTES,
    OutOfBounds,
    RequestGeometry,
    SlotPool,
    SlotRefused,
    default_per_caller,
)
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.codec import WireCodec, WireFormatError, encode_tokens, peek_header
from agora.pipeline.config import PRESETS, ConfigError
from agora.pipeline.fingerprint import run_fingerprint
from agora.protos import stage_adapter as adapter
from agora.protos import stage_pb2

pytestmark = pytest.mark.timeout(120)

RUN = "bounds-run"
CONFIG = PRESETS["tiny"].with_stages(3)  # microbatch_size 2, seq_len 128, wire_dim 16, vocab 256
K = CONFIG.model.wire_dim
VOCAB = CONFIG.model.vocab_size
ROWS, SEQ = CONFIG.train.microbatch_size, CONFIG.train.seq_len
FINGERPRINT = run_fingerprint(CONFIG)
METADATA = ((FINGERPRINT_METADATA, FINGERPRINT.text()),)
HEAD, BODY, TAIL = 0, 1, 2


def header(kind: str, shape, dtype_code: int | None = None) -> bytes:
    """A codec frame header declaring `shape`, with no payload at all: what a peer needs to send
    to ask for a tensor of that shape."""
    kind_code, default_dtype = {"float": (1, 1), "token": (2, 16)}[kind]
    code = default_dtype if dtype_code is None else dtype_code
    return struct.pack("<3sBBBB", b"AGW", 1, kind_code, code, len(shape)) + struct.pack(f"<{len(shape)}I", *shape)


def tokens(rows: int = 2, seq: int = 8, seed: int = 0) -> bytes:
    return encode_tokens(torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed)), VOCAB)


def wire(rows: int = 2, seq: int = 8, width: int = K, seed: int = 0) -> bytes:
    return WireCodec().encode(torch.randn(rows, seq, width, generator=torch.Generator().manual_seed(seed)) * 0.1)


# ---------------------------------------------------------------------------------------------- pure rules


GEOMETRY = {stage: RequestGeometry.from_config(CONFIG, stage) for stage in (HEAD, BODY, TAIL)}


def forward(stage: int, **fields) -> adapter.ForwardRequest:
    values = dict(run_id=RUN, microbatch_id="m", stage=stage, tokens=tokens(),
                  wire=b"" if stage == HEAD else wire(), targets=tokens(seed=1) if stage == TAIL else b"")
    values.update(fields)
    return adapter.ForwardRequest(**values)


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
    assert body.message_budget() == body.forward_budget() < 128 * 2**10  # not the worker-wide 16 MiB
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
    options = WorkerOptions()
    assert (options.queue_per_caller, options.control_queue, options.concurrent_rpcs) == (6, 8, 64)
    for bad, message in [(dict(max_queue_per_caller=9), "worker.max_queue_per_caller: 9 is above max_queue=8"),
                         (dict(max_rows=0), "worker.max_rows: must be positive, got 0"),
                         (dict(max_control_queue=-1), "worker.max_control_queue: must be positive"),
                         (dict(max_concurrent_rpcs=16), "worker.max_concurrent_rpcs: 16 leaves no room")]:
        with pytest.raises(ConfigError, match=message):
            replace(options, **bad).validate()
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


def serialized(request) -> list[bytes]:
    return [adapter.to_message(request).SerializeToString()]


def streamed(request, chunk: int) -> list[bytes]:
    return [m.SerializeToString() for m in adapter.split_parts(request, chunk)]


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
                if body._control_slots.in_use == 2:
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
            return body.load, body._control_slots.in_use

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


def test_calls_beyond_max_concurrent_rpcs_are_refused_by_grpc():
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
                if body.load == 1 and body._control_slots.in_use == 1:
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


# ---------------------------------------------------------------------------------------------- memory


# The worker process: a body worker of `tiny` under a worker credential, asynchronous, default options.
CHILD = r"""
import sys, time, torch
torch.set_num_threads(1)
from agora.auth.node_state import NodeCredentials
from agora.node.rpc.server import run
from agora.node.worker.worker import StageWorker
from agora.pipeline.config import PRESETS

async def main():
    worker = StageWorker(PRESETS["tiny"].with_stages(3), 1, run_id=sys.argv[1],
                         credentials=NodeCredentials(sys.argv[2], clock=time.time))
    await worker.start()
    print("READY", worker.port, worker.credentials.peer_id, flush=True)
    await worker.serve()

run(main())
"""


def _memory_kib(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status if line.startswith(("VmHWM", "VmRSS")))
    return {key: int(value.split()[0]) for key, value in fields.items()}


def _reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: "5" into clear_refs)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def credentialed(tmp_path_factory):
    base = tmp_path_factory.mktemp("bounds-pki")
    authority = RunAuthority(base / "ca", run_id=RUN)
    return {"worker": authority.mint(base / "worker", role="worker", stage=BODY).directory,
            "honest": authority.mint(base / "honest", role="trainer").directory,
            "hostile": authority.mint(base / "hostile", role="trainer").directory}


@pytest.fixture
def worker_process(credentialed):
    child = subprocess.Popen([sys.executable, "-c", CHILD, RUN, str(credentialed["worker"])],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 60)
        line = child.stdout.readline() if ready else ""
        if not line.startswith("READY"):
            child.kill()
            raise AssertionError(f"worker did not start: {line!r} {child.stderr.read()[-2000:]}")
        _, port, peer_id = line.split()
        yield child, f"127.0.0.1:{port}", peer_id
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()
        child.stderr.close()


# Peak RSS the flood may add to the warmed-up worker. What the bounds let it hold at once:
# max_concurrent_rpcs (64) calls, each at most one message of the geometry's budget
# (`message_budget`, 81 KiB for tiny's body) as received, parsed and reassembled (x3): 15 MiB; the
# stash (64 entries of 2 x 128 tokens: 1.2 MiB); one microbatch's activations at a time on the
# compute thread; grpc's transport, which reads ahead into a message it then refuses for its size
# (HTTP/2 windows, grown by BDP probing to a few MiB per connection; the flood sends 12 such
# messages at once over 3 connections). 200 MiB covers that with room for the allocator. Without
# the geometry's cap on one message the same flood peaks around +900 MiB (grpc buffers and parses
# each 16 MB message), and before any bound one such request asked the embedding for 8 GiB.
RSS_MARGIN_MIB = 200


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_flood_of_oversized_and_malformed_requests_leaves_memory_bounded_and_valid_calls_served(
        credentialed, worker_process):
    child, address, peer_id = worker_process
    target = worker_server_name(BODY, peer_id)
    max_message = 16 * 2**20  # what a client may try: the worker-wide message cap before issue 11

    async def main():
        honest = TlsChannels(NodeCredentials(credentialed["honest"], clock=time.time))
        hostile = TlsChannels(NodeCredentials(credentialed["hostile"], clock=time.time))
        options = [("grpc.max_send_message_length", max_message), ("grpc.max_receive_message_length", max_message)]
        good = honest.open(address, target_name=target, options=options)
        bad = [hostile.open(address, target_name=target, options=options) for _ in range(3)]
        path = f"/{adapter.SERVICE_NAME}/"
        valid_calls = 0

        async def valid_microbatch(index: int) -> None:
            nonlocal valid_calls
            request = forward(BODY, microbatch_id=f"ok-{index}", tokens=tokens(ROWS, SEQ, index),
                              wire=wire(ROWS, SEQ, seed=index))
            reply = stage_pb2.ForwardReply.FromString(await good.unary_unary(path + "Forward")(
                serialized(request)[0], metadata=METADATA, timeout=30))
            assert peek_header(reply.wire, "float").shape == (ROWS, SEQ, K)
            backward = adapter.BackwardRequest(RUN, f"ok-{index}", BODY, wire(ROWS, SEQ, seed=index + 1))
            await good.unary_unary(path + "Backward")(serialized(backward)[0], metadata=METADATA, timeout=30)
            valid_calls += 2

        for index in range(4):  # warm-up: the allocator, torch's kernels, grpc's buffers
            await valid_microbatch(index)
        await asyncio.to_thread(lambda: None)
        baseline = _memory_kib(child.pid)["VmRSS"]
        reset = _reset_peak(child.pid)

        # 16.6 MB of token ids (65,000 sequences of 256, tiny's max_seq_len): the embedding alone
        # would be 8 GiB; 12 of these at once are 200 MB as received and 400 MB once parsed.
        huge = serialized(forward(BODY, microbatch_id="huge", tokens=encode_tokens(
            torch.zeros(65_000, 256, dtype=torch.long), VOCAB), wire=header("float", (65_000, 256, K))))[0]
        outcomes: dict = {}

        def note(code) -> None:
            outcomes[code] = outcomes.get(code, 0) + 1

        async def unary(channel, method: str, payload: bytes) -> None:
            try:
                await channel.unary_unary(path + method)(payload, metadata=METADATA, timeout=30)
                note(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as error:
                note(error.code())

        async def stream(channel, method: str, parts) -> None:
            try:
                call = channel.stream_stream(path + method)(parts, metadata=METADATA, timeout=30)
                async for _ in call:
                    pass
                note(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as error:
                note(error.code())

        def declared(rows: int, seq: int, index: int) -> bytes:
            return serialized(forward(BODY, microbatch_id=f"declared-{index}", tokens=header("token", (rows, seq)),
                                      wire=header("float", (rows, seq, K))))[0]

        async def slow_parts(index: int):
            """A stream that declares a valid head and then trickles 64 KiB parts of padding: it holds
            its slot (admitted on its first part) until the budget cuts it off."""
            yield forward_part(index)
            for _ in range(48):
                yield stage_pb2.ForwardRequest(wire=b"\0" * 2**16).SerializeToString()
                await asyncio.sleep(0.01)

        def forward_part(index: int) -> bytes:
            return stage_pb2.ForwardRequest(run_id=RUN, microbatch_id=f"slow-{index}", stage=BODY,
                                            tokens=tokens(ROWS, SEQ), wire=header("float", (ROWS, SEQ, K))
                                            ).SerializeToString()

        def flood(round_index: int) -> list:
            calls = []
            for i, channel in enumerate(bad):
                n = round_index * 100 + i * 10
                calls += [
                    *[unary(channel, "Forward", huge) for _ in range(4)],
                    unary(channel, "Forward", declared(2**20, 2**11, n)),
                    unary(channel, "Forward", b"\xff" * 4096),
                    unary(channel, "Backward", serialized(adapter.BackwardRequest(
                        RUN, "ok-0", BODY, header("float", (2**20, SEQ, K))))[0]),
                    stream(channel, "ForwardStream", iter([declared(2**20, 2**11, n + 1)] +
                                                          [stage_pb2.ForwardRequest(tokens=b"\0" * 2**16)
                                                           .SerializeToString()] * 64)),
                    *[stream(channel, "ForwardStream", slow_parts(n + j)) for j in range(6)],
                ]
            return calls

        async def honest_loop(stop: asyncio.Event) -> None:
            index = 100
            while not stop.is_set():
                await valid_microbatch(index)
                index += 1

        stop = asyncio.Event()
        before_flood = valid_calls
        served = asyncio.ensure_future(honest_loop(stop))
        for round_index in range(3):
            await asyncio.gather(*flood(round_index))
            assert not served.done()  # the honest trainer's calls are all still succeeding
        stop.set()
        await served  # raises if any of its calls failed
        assert valid_calls - before_flood >= 2, "no valid call was served during the flood"
        for index in range(200, 204):  # and after the flood
            await valid_microbatch(index)
        memory = _memory_kib(child.pid)
        for channel in [good, *bad]:
            await channel.close()
        return baseline, memory, reset, outcomes, valid_calls

    baseline, memory, reset, outcomes, valid_calls = run(main())
    peak = memory["VmHWM"] if reset else memory["VmRSS"]
    print(f"worker RSS: baseline {baseline / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB; "
          f"flood outcomes {dict((c.name, n) for c, n in outcomes.items())}; {valid_calls} valid calls served")
    assert child.poll() is None, "the worker died"
    assert peak - baseline < RSS_MARGIN_MIB * 1024, (baseline, peak)
    assert grpc.StatusCode.OK not in outcomes and set(outcomes) <= {
        grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}, outcomes
    assert valid_calls >= 16
