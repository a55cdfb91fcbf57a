"""Fuzz the stage service's request parsing (hypothesis, fixed budget): arbitrary bytes and
arbitrary field values into every agora.v1.Stage method get only clean statuses, never UNKNOWN or
INTERNAL; the workers log no uncaught exception; and a genuine trainer's Forward, Backward and Step
on them still succeed afterwards.

Two real workers of a 3-stage `tiny` run on 127.0.0.1:0, with mutual TLS and credentials minted by
a RunAuthority: the body (stage 1, synchronous, so its Step is the barrier) and the tail (stage 2,
asynchronous, so its Step takes completed-batch reports). The fuzzing client holds a trainer
credential and sends the run fingerprint, so the calls pass the door and reach the parsing behind
it. Requests go out as bytes through identity-serialized calls, so nothing on the client side
(a generated stub, the adapter) sanitises them first. The workers' own limits are lowered (1 MiB
per message, 2 MiB per reassembled stream); the run's geometry (node/replica/bounds.py) caps both
lower still, so the size bounds are reached cheaply.

Structured requests draw every field of protos/stage.proto: run and stage mostly right (so the
example gets past the addressing checks), microbatch ids fresh, reused, empty, too long or
arbitrary, and codec frames (agora.pipeline.codec; the strategies are tests/helpers/codec_frames.py)
that are real or broken in one way each: wrong shape or ndim, another dtype, a token frame where floats belong, NaN/Inf or extreme finite values,
int8 frames with -128 or a bad row scale, token ids out of range, headers declaring sizes far over
the limit, truncated frames, trailing bytes, a corrupted header byte, random bytes, nothing.

Inference calls (Prefill, Decode, CloseSession) draw sessions fresh, open (their positions held
or not) or arbitrary, positions from 0 to 2**64 - 1, declared lengths over the worker's bound, and
the same frames; the fuzzing trainer credential may run inference (auth/grpc_policy.py).

The budget is fixed and derandomized (hypothesis' `derandomize=True`, no example database):
1,900 examples over the five fuzz tests, about 12 s on two cores. The inputs the fuzz found
breaking the workers are pinned in `test_the_inputs_that_broke_the_workers_are_refused_by_name`.

Some accepted inputs change the workers' state (a Step moves the optimizer, a Forward stashes its
input, a completed-batch report far ahead moves the epoch): that is what a trainer may do, and
bounding it is not this file's concern; only the statuses and the workers' health are.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, replace

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agora.auth.authority import RunAuthority
from agora.auth.grpc_policy import FINGERPRINT_METADATA
from agora.auth.node_state import NodeCredentials
from agora.node.inference.client import InferenceClient
from agora.node.rpc.server import new_event_loop
from agora.node.rpc.tls import TlsChannels, worker_server_name
from agora.node.trainer.stage_client import StageClient
from agora.node.replica.request_frames import MAX_MICROBATCH_ID_CHARS
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.codec import WireCodec, encode_tokens
from agora.pipeline.config import PRESETS
from agora.pipeline.fingerprint import run_fingerprint
from agora.protos import stage_adapter as adapter
from agora.protos import stage_pb2
from codec_frames import (MESSAGE_LIMIT, SEEDS, SHAPES, STREAM_LIMIT, float_frames, float_values, token_frames,
                          token_ids)

pytestmark = pytest.mark.timeout(180)

RUN = "fuzz-run"
CONFIG = PRESETS["tiny"].with_stages(3)
K = CONFIG.model.wire_dim
VOCAB = CONFIG.model.vocab_size
MAX_SEQ = CONFIG.model.max_seq_len
FINGERPRINT = run_fingerprint(CONFIG)
METADATA = ((FINGERPRINT_METADATA, FINGERPRINT.text()),)
BODY, TAIL = 1, 2
CHUNK = 64 * 2**10
# max_rows: the valid Forwards the Backward fuzz pairs with carry up to 3 rows, tiny's microbatch is 2.
OPTIONS = WorkerOptions(max_message_bytes=MESSAGE_LIMIT, max_stream_bytes=STREAM_LIMIT, stream_chunk_bytes=CHUNK,
                        max_rows=3)

CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAUTHENTICATED}
UNARY = ("Forward", "Backward", "Step", "Abort", "Info", "Prefill", "Decode", "CloseSession", "DeliverReceipt",
         "DeliverAttestation")
STREAMING = ("ForwardStream", "BackwardStream")
REQUEST_OF = {"Forward": stage_pb2.ForwardRequest, "Backward": stage_pb2.BackwardRequest,
              "Step": stage_pb2.StepRequest, "Abort": stage_pb2.AbortRequest, "Info": stage_pb2.InfoRequest,
              "ForwardStream": stage_pb2.ForwardRequest, "BackwardStream": stage_pb2.BackwardRequest,
              "Prefill": stage_pb2.InferRequest, "Decode": stage_pb2.InferRequest,
              "CloseSession": stage_pb2.CloseSessionRequest, "DeliverReceipt": stage_pb2.ReceiptDelivery,
              "DeliverAttestation": stage_pb2.AttestationDelivery}


def budget(examples: int):
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


U32, U64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)


# ---------------------------------------------------------------------------------------------- the workers


class Uncaught(logging.Handler):
    """Every record at ERROR or above, or carrying a traceback, from any logger (grpc's included)."""

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)

    def lines(self) -> list[str]:
        return [f"{r.name}: {r.getMessage()}" for r in self.records]


@dataclass
class World:
    loop: object
    workers: dict  # stage -> StageWorker
    channels: dict  # stage -> grpc.aio.Channel presenting the trainer credential
    peer_channels: dict  # stage -> one presenting another worker's of that stage (DeliverAttestation's callers)
    trainer: NodeCredentials
    uncaught: Uncaught
    ids: itertools.count = field(default_factory=itertools.count)
    used_ids: dict = field(default_factory=lambda: {BODY: [], TAIL: []})  # ids a Forward was accepted under
    sessions: dict = field(default_factory=lambda: {BODY: [], TAIL: []})  # sessions a Prefill opened

    def fresh_id(self) -> str:
        return f"fuzz-{next(self.ids)}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One body and one tail worker on one event loop for the whole module (hypothesis drives them
    example by example from this thread)."""
    base = tmp_path_factory.mktemp("stage-fuzz")
    authority = RunAuthority(base / "ca", run_id=RUN)
    worker_dirs = {stage: authority.mint(base / f"worker{stage}", role="worker", stage=stage).directory
                   for stage in (BODY, TAIL)}
    trainer = NodeCredentials(authority.mint(base / "trainer", role="trainer").directory, clock=time.time)
    peers = {stage: NodeCredentials(authority.mint(base / f"peer{stage}", role="worker", stage=stage).directory,
                                    clock=time.time) for stage in (BODY, TAIL)}
    uncaught = Uncaught()
    root = logging.getLogger()
    root.addHandler(uncaught)
    loop = new_event_loop()

    async def start():
        workers = {}
        for stage, directory in worker_dirs.items():
            worker = StageWorker(CONFIG, stage, run_id=RUN, credentials=NodeCredentials(directory, clock=time.time),
                                 options=replace(OPTIONS, synchronous=stage == BODY))
            await worker.start()
            workers[stage] = worker
        def opened(node: NodeCredentials, stage: int):
            worker = workers[stage]
            target = worker_server_name(stage, worker.credentials.peer_id)
            return TlsChannels(node).open(worker.address, target_name=target)

        return workers, {stage: opened(trainer, stage) for stage in workers}, \
            {stage: opened(peers[stage], stage) for stage in workers}

    workers, channels, peer_channels = loop.run_until_complete(start())
    try:
        yield World(loop, workers, channels, peer_channels, trainer, uncaught)
    finally:
        async def stop():
            for channel in [*channels.values(), *peer_channels.values()]:
                await channel.close()
            for worker in workers.values():
                await worker.stop(0)
        loop.run_until_complete(stop())
        loop.close()
        root.removeHandler(uncaught)


def _status(world: World, coroutine_fn) -> grpc.StatusCode:
    """Run one call on the workers' loop; its status must be clean and nothing may be logged as uncaught."""
    async def go():
        return await coroutine_fn()

    before = len(world.uncaught.records)
    try:
        world.loop.run_until_complete(go())
        code, details = grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as error:
        code, details = error.code(), error.details()
    assert code in CLEAN, f"{code}: {details}"
    assert world.uncaught.lines()[before:] == []
    return code


def _call(world: World, stage: int, method: str, parts: list[bytes], metadata=METADATA) -> grpc.StatusCode:
    """Send `parts` as they are (one for a unary method, any number for a streaming one) and read every reply."""
    channel = channel_for(world, stage, method)
    path = f"/{adapter.SERVICE_NAME}/{method}"
    if method in STREAMING:
        async def streamed():
            call = channel.stream_stream(path)(iter(parts), metadata=metadata, timeout=20)
            return [reply async for reply in call]
        return _status(world, streamed)
    (payload,) = parts
    return _status(world, lambda: channel.unary_unary(path)(payload, metadata=metadata, timeout=20))


def channel_for(world: World, stage: int, method: str):
    """The trainer's channel, or for DeliverAttestation (a worker's call) the stage's other worker's."""
    return world.peer_channels[stage] if method == "DeliverAttestation" else world.channels[stage]


def _healthy(world: World) -> None:
    assert world.uncaught.lines() == []
    assert all(worker.is_serving for worker in world.workers.values())


def run_ids():
    """Any run id but this run's (most are arbitrary; a few are this one's, a character off)."""
    return st.one_of(st.text(max_size=40), st.sampled_from(["", RUN[:-1], RUN + " ", RUN.upper()]))


def mostly(value, other):
    """`value` three times in four, else a draw from `other`."""
    return st.integers(0, 3).flatmap(lambda i: other if i == 0 else st.just(value))


def microbatch_ids(world: World, stage: int):
    """Ids a Forward under which may be refused: one already used here, empty, too long, or arbitrary
    text (which may be fine)."""
    return st.sampled_from(["used", "empty", "long", "text"]).flatmap(lambda how: {
        # An index, not sampled_from: the list grows, and a replayed example must draw the same way.
        "used": st.integers(0, 2**16).map(lambda i: world.used_ids[stage][i % len(world.used_ids[stage])]
                                          if world.used_ids[stage] else "never-used"),
        "empty": st.just(""),
        "long": st.just("m" * (MAX_MICROBATCH_ID_CHARS + 1)),
        "text": st.text(max_size=MAX_MICROBATCH_ID_CHARS),
    }[how])


def _send(world: World, stage: int, method: str, request, *, streamed: bool, chunk: int,
          reorder: bool = False) -> grpc.StatusCode:
    """A dataclass request, unary or cut into streamed parts of `chunk` payload bytes each
    (`reorder`: the scalar part last, so the first part the worker sees carries none of them)."""
    if streamed:
        chunk = max(chunk, adapter.payload_bytes(request) // 64 + 1)  # at most ~64 parts: the budget is time
        parts = [m.SerializeToString() for m in adapter.split_parts(request, chunk)]
        if reorder and len(parts) > 1:
            parts = parts[1:] + parts[:1]
        return _call(world, stage, f"{method}Stream", parts)
    return _call(world, stage, method, [adapter.to_message(request).SerializeToString()])


# ---------------------------------------------------------------------------------------------- raw bytes


@st.composite
def raw_payloads(draw):
    """Arbitrary bytes, or a valid request's serialization cut short, extended or with a byte changed."""
    method = draw(st.sampled_from(UNARY + STREAMING))
    if draw(st.booleans()):
        parts = [draw(st.binary(max_size=512)) for _ in range(draw(st.integers(0 if method in STREAMING else 1,
                                                                               3 if method in STREAMING else 1)))]
        return method, parts
    fields = {"ForwardRequest": dict(run_id=RUN, microbatch_id="raw", stage=BODY, tokens=encode_tokens(
                  token_ids((1, 4), 0), VOCAB), wire=WireCodec().encode(torch.zeros(1, 4, K))),
              "BackwardRequest": dict(run_id=RUN, microbatch_id="raw", stage=BODY,
                                      output_grad=WireCodec().encode(torch.zeros(1, 4, K))),
              "StepRequest": dict(run_id=RUN, stage=BODY, microbatches=1, step=0),
              "AbortRequest": dict(run_id=RUN, microbatch_id="raw", stage=BODY),
              "InfoRequest": {},
              "InferRequest": dict(run_id=RUN, stage=BODY, session_id="raw", position=0, tokens=encode_tokens(
                  token_ids((1, 4), 0), VOCAB), wire=WireCodec().encode(torch.zeros(1, 4, K)), max_tokens=8),
              "CloseSessionRequest": dict(run_id=RUN, stage=BODY, session_id="raw"),
              "ReceiptDelivery": dict(receipt='{"receipt": {}, "chain": "", "signature": ""}'),
              "AttestationDelivery": dict(attestation='{"attestation": {}, "chain": "", "signature": ""}')}
    message = REQUEST_OF[method]
    valid = message(**fields[message.DESCRIPTOR.name]).SerializeToString()
    how = draw(st.sampled_from(["cut", "extend", "byte", "prefix"]))
    if how == "cut":
        mutated = valid[:draw(st.integers(0, max(0, len(valid) - 1)))]
    elif how == "extend":
        mutated = valid + draw(st.binary(min_size=1, max_size=32))
    elif how == "prefix":
        mutated = draw(st.binary(min_size=1, max_size=32)) + valid
    else:
        at = draw(st.integers(0, max(0, len(valid) - 1)))
        mutated = valid[:at] + bytes([draw(st.integers(0, 255))]) + valid[at + 1:]
    return method, [mutated] if method in UNARY else [mutated, draw(st.binary(max_size=64))][:draw(st.integers(1, 2))]


PRINTABLE = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=120)


def test_arbitrary_bytes_get_clean_statuses(world):
    """Bytes that are no message, a message cut or extended, invalid UTF-8 in a string, a stream of
    such parts or of none; unary calls under the run fingerprint or an arbitrary one.

    Streamed calls always carry the run's fingerprint: one refused at the door (before the worker
    reads its parts) while the client is still writing is reported to a grpc.aio client as
    INTERNAL "Internal error from Core" (grpc/grpc#36066; the worker sends the right status), so
    that case would test grpc's client rather than the worker's parsing."""
    real = FINGERPRINT.text()
    fingerprints = st.one_of(*[st.just(real)] * 6, PRINTABLE,
                             st.builds(lambda cut: real[:cut], st.integers(0, len(real))),
                             st.builds(lambda at, c: real[:at] + c + real[at + 1:], st.integers(0, len(real) - 1),
                                       st.characters(min_codepoint=32, max_codepoint=126)))

    @budget(400)
    @given(stage=st.sampled_from([BODY, TAIL]), request=raw_payloads(), fingerprint=fingerprints)
    def check(stage, request, fingerprint):
        method, parts = request
        if method in UNARY:
            _call(world, stage, method, parts, metadata=((FINGERPRINT_METADATA, fingerprint),))
        else:
            _call(world, stage, method, parts)

    check()
    _healthy(world)


# ---------------------------------------------------------------------------------------------- fields


BROKEN_FORWARD = ("run_id", "stage", "microbatch_id", "tokens", "wire", "targets")
BROKEN_BACKWARD = ("run_id", "stage", "microbatch_id", "output_grad")


def broken_fields(names):
    """Which fields an example breaks: none, one (so that the others get it to the check of that
    one), or all of them."""
    return st.sampled_from([(), ()] + [(name,) for name in names] + [names])


@st.composite
def forward_requests(draw, world: World):
    stage = draw(st.sampled_from([BODY, TAIL]))
    broken = draw(broken_fields(BROKEN_FORWARD))
    shape = draw(SHAPES)  # a sequence over max_seq_len breaks the tokens too
    wire = draw(float_frames((*shape, K), valid="wire" not in broken))
    targets = draw(token_frames(shape, valid=stage == TAIL and "targets" not in broken))
    if "wire" in broken and draw(st.integers(0, 3)) == 0:
        wire = b""  # missing
    if "targets" in broken and stage == TAIL and draw(st.integers(0, 3)) == 0:
        targets = b""
    if "targets" not in broken and stage == BODY:
        targets = b""
    request = adapter.ForwardRequest(
        run_id=draw(run_ids()) if "run_id" in broken else RUN,
        microbatch_id=draw(microbatch_ids(world, stage)) if "microbatch_id" in broken else world.fresh_id(),
        stage=draw(U32) if "stage" in broken else stage,
        tokens=draw(token_frames(shape, valid="tokens" not in broken)), wire=wire, targets=targets,
        evaluate=draw(st.booleans()))
    return stage, request


def test_arbitrary_forward_fields_get_clean_statuses(world):
    @budget(500)
    @given(drawn=forward_requests(world), streamed=st.booleans(), chunk=st.sampled_from([97, 4096, CHUNK]),
           reorder=st.booleans())
    def check(drawn, streamed, chunk, reorder):
        stage, request = drawn
        code = _send(world, stage, "Forward", request, streamed=streamed, chunk=chunk, reorder=reorder)
        if code == grpc.StatusCode.OK and not request.evaluate:
            world.used_ids[stage].append(request.microbatch_id)

    check()
    _healthy(world)


def _forward(world: World, stage: int, shape, seed: int) -> str:
    """A valid Forward on `stage` (so a Backward or Abort has something to find); its microbatch id."""
    microbatch_id = world.fresh_id()
    request = adapter.ForwardRequest(
        run_id=RUN, microbatch_id=microbatch_id, stage=stage, tokens=encode_tokens(token_ids(shape, seed), VOCAB),
        wire=WireCodec().encode(torch.from_numpy(float_values((*shape, K), seed))),
        targets=encode_tokens(token_ids(shape, seed + 1), VOCAB) if stage == TAIL else b"")
    assert _send(world, stage, "Forward", request, streamed=False, chunk=CHUNK) == grpc.StatusCode.OK
    world.used_ids[stage].append(microbatch_id)
    return microbatch_id


def test_arbitrary_backward_fields_get_clean_statuses(world):
    """Half the examples back a Forward that just ran on the body (its stash entry is what the
    output gradient is checked against); the others name any id, on the body or the tail."""

    @budget(400)
    @given(stage=st.sampled_from([BODY, BODY, BODY, TAIL]), pending=st.booleans(),
           shape=st.tuples(st.integers(1, 3), st.integers(1, 16)), broken=broken_fields(BROKEN_BACKWARD),
           seed=SEEDS, data=st.data(), streamed=st.booleans(), chunk=st.sampled_from([97, 4096, CHUNK]))
    def check(stage, pending, shape, broken, seed, data, streamed, chunk):
        microbatch_id = _forward(world, BODY, shape, seed) if pending and stage == BODY else "never-forwarded"
        request = adapter.BackwardRequest(
            run_id=data.draw(run_ids()) if "run_id" in broken else RUN,
            microbatch_id=data.draw(microbatch_ids(world, stage)) if "microbatch_id" in broken else microbatch_id,
            stage=data.draw(U32) if "stage" in broken else stage,
            output_grad=data.draw(float_frames((*shape, K), valid="output_grad" not in broken)))
        _send(world, stage, "Backward", request, streamed=streamed, chunk=chunk)

    check()
    _healthy(world)


def test_arbitrary_step_and_abort_fields_get_clean_statuses(world):
    """Step on the synchronous body (the barrier) and the asynchronous tail (completed-batch
    reports), every field arbitrary; Abort of pending, applied, stepped and unknown ids."""
    big = st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1])

    @budget(300)
    @given(stage=st.sampled_from([BODY, TAIL]), run_id=mostly(RUN, run_ids()), data=st.data(),
           microbatches=st.one_of(st.integers(0, 8), U32), replicas=st.one_of(st.integers(0, 4), U32),
           step=st.one_of(st.none(), st.integers(0, 8), big, U64),
           completed_batch=st.one_of(st.none(), st.integers(0, 64), big, U64),
           abort=st.booleans(), shape=st.tuples(st.integers(1, 2), st.integers(1, 8)), seed=SEEDS)
    def check(stage, run_id, data, microbatches, replicas, step, completed_batch, abort, shape, seed):
        target = data.draw(mostly(stage, U32))
        if abort:
            if data.draw(st.booleans()):
                _forward(world, stage, shape, seed)
            request = adapter.AbortRequest(run_id=run_id, microbatch_id=data.draw(microbatch_ids(world, stage)),
                                           stage=target)
            _call(world, stage, "Abort", [adapter.to_message(request).SerializeToString()])
            return
        if stage == BODY and data.draw(st.booleans()):
            step = world.workers[BODY].info().step  # the barrier the worker is waiting for
        request = adapter.StepRequest(run_id=run_id, stage=target, microbatches=microbatches, step=step,
                                      completed_batch=completed_batch, replicas=replicas)
        _call(world, stage, "Step", [adapter.to_message(request).SerializeToString()])

    check()
    _healthy(world)


def session_ids(world: World, stage: int):
    """A session open on `stage` (one this module's Prefills opened), fresh, empty, too long, or arbitrary."""
    return st.sampled_from(["open", "open", "fresh", "empty", "long", "text"]).flatmap(lambda how: {
        "open": st.integers(0, 2**16).map(lambda i: world.sessions[stage][i % len(world.sessions[stage])]
                                          if world.sessions[stage] else "never-opened"),
        "fresh": st.just(None),
        "empty": st.just(""),
        "long": st.just("s" * 129),
        "text": st.text(max_size=140),
    }[how])


def test_arbitrary_inference_fields_get_clean_statuses(world):
    """Prefill, Decode and CloseSession with every field arbitrary or broken in one way; sessions the
    fuzz opened are decoded at their length, before it, after it, or far past it."""
    positions = st.one_of(st.integers(0, 20), st.sampled_from([MAX_SEQ - 1, MAX_SEQ, 2**32, 2**63, 2**64 - 1]))

    @budget(300)
    @given(stage=st.sampled_from([BODY, TAIL]), method=st.sampled_from(["Prefill", "Prefill", "Decode", "Decode",
                                                                        "CloseSession"]),
           broken=broken_fields(("run_id", "stage", "session_id", "tokens", "wire", "position", "max_tokens")),
           shape=st.tuples(st.integers(1, 3), st.integers(1, 12)), data=st.data())
    def check(stage, method, broken, shape, data):
        session_id = data.draw(session_ids(world, stage)) if "session_id" in broken else (
            world.fresh_id() if method == "Prefill" else data.draw(session_ids(world, stage)))
        session_id = world.fresh_id() if session_id is None else session_id
        run_id = data.draw(run_ids()) if "run_id" in broken else RUN
        target = data.draw(U32) if "stage" in broken else stage
        if method == "CloseSession":
            request = adapter.CloseSessionRequest(run_id=run_id, stage=target, session_id=session_id)
            _call(world, stage, method, [adapter.to_message(request).SerializeToString()])
            return
        position = data.draw(positions) if "position" in broken or method == "Decode" else 0
        request = adapter.InferRequest(
            run_id=run_id, stage=target, session_id=session_id, position=position,
            tokens=data.draw(token_frames(shape, valid="tokens" not in broken)),
            wire=data.draw(float_frames((*shape, K), valid="wire" not in broken)),
            max_tokens=data.draw(st.one_of(U32, st.just(MAX_SEQ + 1))) if "max_tokens" in broken else 0)
        code = _call(world, stage, method, [adapter.to_message(request).SerializeToString()])
        if code == grpc.StatusCode.OK and method == "Prefill":
            world.sessions[stage].append(session_id)

    check()
    _healthy(world)


def test_the_inputs_that_broke_the_workers_are_refused_by_name(world):
    """What the fuzz found, pinned: bytes that do not parse (grpc's own deserializer answered
    UNKNOWN), a completed-batch report of 2**64 - 1 (the step count it set made every later reply
    unencodable: UNKNOWN for good), and a wire of finite values at float32's limit (the stage
    overflowed and the worker answered INTERNAL, as if it were broken). Each is INVALID_ARGUMENT
    naming what is wrong, and changes nothing."""
    def refused(stage: int, method: str, parts: list[bytes], needle: str) -> None:
        async def go():
            path = f"/{adapter.SERVICE_NAME}/{method}"
            if method in STREAMING:
                return [r async for r in world.channels[stage].stream_stream(path)(iter(parts), metadata=METADATA)]
            return await channel_for(world, stage, method).unary_unary(path)(parts[0], metadata=METADATA)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            world.loop.run_until_complete(go())
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert needle in caught.value.details(), caught.value.details()

    def pending(stage: int) -> tuple[int, int, int]:
        return world.loop.run_until_complete(world.workers[stage].on_compute(
            lambda c: (len(c.stash), c.accumulated_microbatches, c.optimizer.steps)))

    before = {stage: pending(stage) for stage in (BODY, TAIL)}
    for method in UNARY + STREAMING:
        message = REQUEST_OF[method].DESCRIPTOR.full_name
        refused(BODY, method, [b"\xff\xff\xff"], f"not a valid {message} message")
        if method != "Info":  # an InfoRequest has no fields, so this one is an unknown field to skip
            refused(TAIL, method, [b"\x0a\x02\xc3\x28"], f"not a valid {message} message")  # bad UTF-8 run_id
    refused(TAIL, "Step", [stage_pb2.StepRequest(run_id=RUN, stage=TAIL, microbatches=1, replicas=1,
                                                 completed_batch=2**64 - 1).SerializeToString()],
            "completed_batch must be below 2**53")
    tokens, targets = encode_tokens(token_ids((2, 8), 1), VOCAB), encode_tokens(token_ids((2, 8), 2), VOCAB)
    limit = WireCodec().encode(torch.full((2, 8, K), float(np.finfo(np.float32).max)))
    refused(BODY, "Forward", [stage_pb2.ForwardRequest(run_id=RUN, microbatch_id="at-the-limit", stage=BODY,
                                                       tokens=tokens, wire=limit).SerializeToString()],
            "the request's values overflowed it")
    refused(TAIL, "Forward", [stage_pb2.ForwardRequest(run_id=RUN, microbatch_id="at-the-limit", stage=TAIL,
                                                       tokens=tokens, wire=limit, targets=targets
                                                       ).SerializeToString()],
            "the request's values overflowed it")
    assert {stage: pending(stage) for stage in (BODY, TAIL)} == before
    _healthy(world)


# ---------------------------------------------------------------------------------------------- after


def test_the_workers_still_serve_a_trainer_after_the_fuzzing(world):
    """A genuine Forward through body and tail, the body's Backward, and a Step on each: right
    shapes, a finite loss, and nothing logged as uncaught over the whole module."""
    tokens = token_ids((2, 16), 7)
    targets = token_ids((2, 16), 8)
    wire = torch.from_numpy(float_values((2, 16, K), 9))

    async def train():
        clients = {stage: StageClient(w.address, run_id=RUN, stage=stage, model=CONFIG.model, fingerprint=FINGERPRINT,
                                      peer_id=w.credentials.peer_id, channels=TlsChannels(world.trainer),
                                      timeout_s=20, max_message_bytes=MESSAGE_LIMIT, max_stream_bytes=STREAM_LIMIT,
                                      stream_chunk_bytes=CHUNK)
                   for stage, w in world.workers.items()}
        try:
            body = await clients[BODY].forward("after-fuzz", tokens, wire)
            tail = await clients[TAIL].forward("after-fuzz", tokens, body.wire_frame, targets)
            back = await clients[BODY].backward("after-fuzz", tail.grad_frame)
            inference = {stage: InferenceClient(w.address, run_id=RUN, stage=stage, model=CONFIG.model,
                                                fingerprint=FINGERPRINT, peer_id=w.credentials.peer_id,
                                                channels=TlsChannels(world.trainer), timeout_s=20)
                         for stage, w in world.workers.items()}
            opened = await inference[BODY].prefill("after-fuzz", tokens[:1, :8], wire[:1, :8])
            logits = await inference[TAIL].prefill("after-fuzz", tokens[:1, :8], opened.output, max_tokens=9)
            step = await inference[BODY].decode("after-fuzz", 8, tokens[:1, 8:9], wire[:1, 8:9])
            closed = await inference[BODY].close_session("after-fuzz")
            for client in inference.values():
                await client.close()
            assert step.length == 9 and closed and logits.output.shape == (1, 1, VOCAB)
            assert torch.isfinite(logits.output).all()
            body_step = (await clients[BODY].info()).step
            stepped = await clients[BODY].step(1, step=body_step)
            tail_step = (await clients[TAIL].info()).step
            await clients[TAIL].batch_done(tail_step + 1, 1, 1)  # stepped, or answered from the record
            return body, tail, back, body_step, stepped, tail_step, (await clients[TAIL].info()).step
        finally:
            for client in clients.values():
                await client.close()

    body, tail, back, body_step, stepped, tail_step, tail_step_after = world.loop.run_until_complete(train())
    assert body.wire.shape == (2, 16, K) and torch.isfinite(body.wire).all()
    assert tail.loss is not None and np.isfinite(tail.loss) and tail.input_grad.shape == (2, 16, K)
    assert back.input_grad.shape == (2, 16, K) and torch.isfinite(back.input_grad).all()
    assert stepped.step == body_step + 1 and stepped.accumulated >= 1
    assert tail_step_after >= tail_step
    _healthy(world)
