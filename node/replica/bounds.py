"""What a worker accepts at the door, derived from the run's config: shapes, byte budgets, slots.

A credential says who a peer is, not that it behaves (README "Admission and trust"). Everything
a request could make a worker allocate is bounded here, before a tensor is built, as pure rules
over the run's geometry and the worker's counters, tested without sockets
(tests/integration/test_worker_bounds.py). The worker's StageService (node/worker/service.py)
applies them on the event loop ahead of the compute thread; `StageCompute`
(node/replica/compute.py) still decodes and checks every frame fully afterwards, against the
stash for a Backward.

Design choices:
- Shapes come from the config, not from the request: rows <= `train.microbatch_size` (what every
  trainer of the run sends; a worker may raise it with `--max-rows` for tools that batch more),
  sequence length <= `train.seq_len`, the wire's last dim exactly `model.wire_dim`. A frame's shape
  is read from its header (`pipeline.codec.peek_header`), so a 16 MiB frame of token ids that
  would ask the embedding for gigabytes is refused by its first 15 bytes. Every refusal names the
  field, what it carries and the bound with the config key it comes from (`OutOfBounds`).
- Byte budgets follow from the shapes: a Forward carries at most a token frame, a wire frame and
  (the tail) a target frame of the largest allowed shape in the widest dtype the codec takes
  (uint32 ids, fp32 or int8 values), a Backward one float frame; `HEADROOM_BYTES` on top covers the
  protobuf framing and the scalar fields. A stream is refused as soon as its reassembled payload
  passes that, and the same figure caps one gRPC message (`message_budget`), instead of the
  worker-wide 16 MiB / 512 MiB.
- Queue slots (`SlotPool`): a bounded count of requests admitted and not finished, and at most
  `per_caller` of them held by one caller identity, so one trainer cannot starve the others. A
  slot is taken when a request is admitted (a stream: on its first part), and given back when its
  compute job ends, or at once if it never reached the compute thread (`Slot.hand_off`/`close`).
- Inference calls (Prefill, Decode) are judged by the same rules with the session's bounds in
  place of training's: at most `max_rows` rows, a call's positions at most the worker's tokens per
  session (`for_inference`), the wire's width exactly `model.wire_dim`; their byte budget
  follows (`inference_budget`), and their queue slots are a pool of the inference service's own
  (node/inference/service.py), so serving and training never take each other's slots.
- Step and Abort have a pool of their own, bounded and per-caller limited like Forward/Backward.
  Not the data pool: a trainer's Step barrier, or the Abort that takes back a failed route, must
  get through a worker whose data slots are full of that same trainer's work (else a trainer at its
  per-caller limit could never close its batch or clean up its route). They carry no payload,
  and on the FIFO compute thread they still run after every request admitted before them.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Optional

from agora.pipeline.codec import FLOAT_DTYPES, WireFormatError, float_frame_bytes, peek_header
from agora.node.worker.options import default_per_caller
from agora.pipeline.config import ConfigError, RunConfig
from agora.protos.stage_adapter import BackwardRequest, ForwardRequest, InferRequest

__all__ = [
    "OutOfBounds",
    "SlotRefused",
    "RequestGeometry",
    "SlotPool",
    "Slot",
    "HEADROOM_BYTES",
    "default_per_caller",
]

# Protobuf framing and the scalar fields (a microbatch id of at most 256 characters, the run id,
# the stage), and slack should a frame header grow by a few bytes.
HEADROOM_BYTES = 64 * 2**10
# Token ids travel as uint8/16/32 (the sender picks; pipeline/codec.py accepts any): uint32 is the widest.
_TOKEN_ITEM_BYTES = 4
_TOKEN_HEADER_BYTES = 7 + 4 * 2


class OutOfBounds(ValueError):
    """A request whose declared shapes or sizes this worker does not take (INVALID_ARGUMENT)."""


class SlotRefused(Exception):
    """No queue slot for this request (RESOURCE_EXHAUSTED); the message says which limit, `reason`
    is "full" (routine load) or "caller_limit" (this caller holds its share)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class RequestGeometry:
    """The largest request a stage's worker takes, from the run config (see the module docstring)."""

    stage: int
    n_stages: int
    max_rows: int
    rows_source: str  # where max_rows comes from, for messages
    max_seq: int
    wire_dim: int
    seq_source: str = "train.seq_len"  # where max_seq comes from, for messages
    max_session_tokens: int = 0  # an inference session's positions at most (model.max_seq_len)

    @classmethod
    def from_config(cls, config: RunConfig, stage: int, max_rows: Optional[int] = None) -> "RequestGeometry":
        """`max_rows` (the worker's `--max-rows`) may raise the configured microbatch size, never lower it."""
        microbatch = config.train.microbatch_size
        if max_rows is not None and max_rows < microbatch:
            raise ConfigError(f"worker.max_rows: {max_rows} is below train.microbatch_size={microbatch}; it can "
                              "only raise the bound (every trainer of the run sends that many rows)")
        raised = max_rows is not None and max_rows > microbatch
        return cls(stage=stage, n_stages=len(config.layer_split),
                   max_rows=max_rows if raised else microbatch,
                   rows_source="--max-rows" if raised else "train.microbatch_size; raise with --max-rows",
                   max_seq=config.train.seq_len, wire_dim=config.model.wire_dim,
                   max_session_tokens=config.model.max_seq_len)

    @property
    def is_head(self) -> bool:
        return self.stage == 0

    @property
    def is_tail(self) -> bool:
        return self.stage == self.n_stages - 1

    # ------------------------------------------------------------------ budgets

    def _wire_bytes(self) -> int:
        shape = (self.max_rows, self.max_seq, self.wire_dim)
        return max(float_frame_bytes(shape, dtype) for dtype in FLOAT_DTYPES)

    def _token_bytes(self) -> int:
        return _TOKEN_HEADER_BYTES + _TOKEN_ITEM_BYTES * self.max_rows * self.max_seq

    def forward_budget(self) -> int:
        """Payload bytes of the largest Forward this stage takes, plus headroom."""
        total = self._token_bytes()
        if not self.is_head:
            total += self._wire_bytes()
        if self.is_tail:
            total += self._token_bytes()
        return total + HEADROOM_BYTES

    def backward_budget(self) -> int:
        """Payload bytes of the largest Backward (an output gradient; the tail takes none), plus headroom."""
        return (0 if self.is_tail else self._wire_bytes()) + HEADROOM_BYTES

    def for_inference(self, max_session_tokens: int) -> "RequestGeometry":
        """The bounds of a Prefill or Decode: the positions of one call at most a session's."""
        return replace(self, max_seq=max_session_tokens, seq_source="the worker's tokens per session, "
                                                                    "--max-session-tokens")

    def inference_budget(self) -> int:
        """Payload bytes of the largest Prefill/Decode (of a geometry from `for_inference`), plus headroom."""
        return self._token_bytes() + (0 if self.is_head else self._wire_bytes()) + HEADROOM_BYTES

    def check_inference(self, request: InferRequest) -> None:
        """Refuse a Prefill/Decode whose frames declare shapes outside this (inference) geometry."""
        tokens = self._tokens("tokens", request.tokens, False)
        if tokens is None:  # a unary call is whole: a frame cut inside its header is no frame
            raise OutOfBounds("tokens: the frame ends inside its header")
        if self.is_head:
            if request.wire:
                raise OutOfBounds("wire: the head stage takes token ids only, but a wire frame was sent")
            return
        wire = self._floats("wire", request.wire, False)
        if wire is None:
            raise OutOfBounds("wire: the frame ends inside its header")
        if wire[:2] != tokens:
            raise OutOfBounds(f"wire: shape {list(wire)} does not match tokens' {list(tokens)} (rows, positions)")

    def message_budget(self) -> int:
        """The largest request message of any kind: what one gRPC message may carry to this worker
        (a Prefill of the longest session the model takes included)."""
        return max(self.forward_budget(), self.backward_budget(),
                   self.for_inference(self.max_session_tokens).inference_budget())

    def describe_budget(self, method: str) -> str:
        """How a budget was derived, for the message that refuses a stream over it."""
        frames = {"Forward": ("token ids" + ("" if self.is_head else f" + wire of width {self.wire_dim}")
                              + (" + targets" if self.is_tail else "")),
                  "Backward": f"output_grad of width {self.wire_dim}"}[method]
        return (f"{self.max_rows} rows ({self.rows_source}) x {self.max_seq} tokens (train.seq_len): {frames}, "
                f"at most 4 bytes per value, + {HEADROOM_BYTES // 1024} KiB headroom")

    # ------------------------------------------------------------------ shapes

    def _rows_and_seq(self, field: str, shape: tuple[int, ...]) -> None:
        if shape[0] > self.max_rows:
            raise OutOfBounds(f"{field}: {shape[0]} rows, at most {self.max_rows} ({self.rows_source})")
        if len(shape) > 1 and shape[1] > self.max_seq:
            raise OutOfBounds(f"{field}: sequence length {shape[1]}, at most {self.max_seq} ({self.seq_source})")

    def _tokens(self, field: str, frame: bytes, partial: bool) -> Optional[tuple[int, ...]]:
        header = _peek(field, frame, "token")
        if header is None:
            if not partial and not frame:
                raise OutOfBounds(f"{field}: missing (empty frame)")
            return None
        if len(header.shape) != 2:
            raise OutOfBounds(f"{field}: shape {list(header.shape)}, expected [rows, seq] (2 dims)")
        self._rows_and_seq(field, header.shape)
        return header.shape

    def _floats(self, field: str, frame: bytes, partial: bool) -> Optional[tuple[int, ...]]:
        header = _peek(field, frame, "float")
        if header is None:
            if not partial and not frame:
                raise OutOfBounds(f"{field}: missing (empty frame)")
            return None
        if len(header.shape) != 3:
            raise OutOfBounds(f"{field}: shape {list(header.shape)}, expected [rows, seq, {self.wire_dim}] (3 dims)")
        self._rows_and_seq(field, header.shape)
        if header.shape[2] != self.wire_dim:
            raise OutOfBounds(f"{field}: last dim {header.shape[2]}, this stage's wire width is {self.wire_dim} "
                              "(model.wire_dim)")
        return header.shape

    def check_forward(self, request: ForwardRequest, *, partial: bool = False) -> None:
        """Refuse a Forward whose frames declare shapes outside the geometry, or that disagree with
        each other. `partial`: a stream's first part, where a frame may be absent or cut short (only
        what has arrived is checked; the whole request is checked again once reassembled)."""
        tokens = self._tokens("tokens", request.tokens, partial)
        if self.is_head:
            if request.wire:
                raise OutOfBounds("wire: the head stage takes token ids only, but a wire frame was sent")
        else:
            wire = self._floats("wire", request.wire, partial)
            if tokens is not None and wire is not None and wire[:2] != tokens:
                raise OutOfBounds(f"wire: shape {list(wire)} does not match tokens' {list(tokens)} (rows, seq)")
        if self.is_tail:
            targets = self._tokens("targets", request.targets, partial)
            if tokens is not None and targets is not None and targets != tokens:
                raise OutOfBounds(f"targets: shape {list(targets)} does not match tokens' {list(tokens)}")
        elif request.targets:
            raise OutOfBounds(f"targets: only the tail takes targets; this is stage {self.stage} of {self.n_stages}")

    def check_backward(self, request: BackwardRequest, *, partial: bool = False) -> None:
        """Refuse an output gradient outside the geometry. Whether it is shaped exactly like the
        stashed forward's output is checked against the stash on the compute thread, from the header
        too (`StageCompute.backward` decodes it with that expected shape before reading its payload)."""
        if self.is_tail:
            return  # the tail runs its backward inside Forward; compute answers FAILED_PRECONDITION
        self._floats("output_grad", request.output_grad, partial)


def _peek(field: str, frame: bytes, kind: str):
    try:
        return peek_header(frame, kind)
    except WireFormatError as error:
        raise OutOfBounds(f"{field}: {error}") from None


class Slot:
    """One admitted request's place in a `SlotPool`. Released exactly once: by `close()` unless it
    was handed to a compute job, then when that job ends (a job already on the thread still
    occupies the worker even if its caller gave up)."""

    def __init__(self, pool: "SlotPool", owner: str):
        self._pool = pool
        self.owner = owner
        self._handed_off = False
        self._released = False
        self._lock = threading.Lock()

    def hand_off(self, job: Future) -> None:
        with self._lock:
            self._handed_off = True
        job.add_done_callback(lambda _: self._release())

    def close(self) -> None:
        with self._lock:
            if self._handed_off:
                return
        self._release()

    def _release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._pool._give_back(self.owner)


class SlotPool:
    """`capacity` slots, at most `per_caller` of them per caller identity. Thread-safe: slots are
    taken on the event loop and given back from the compute thread."""

    def __init__(self, what: str, capacity: int, per_caller: int, *, option: str):
        if capacity <= 0 or not 0 < per_caller <= capacity:
            raise ValueError(f"{what}: need 0 < per_caller <= capacity, got {per_caller} and {capacity}")
        self.what = what  # e.g. "stage 1 worker" / "Step/Abort calls"
        self.capacity = capacity
        self.per_caller = per_caller
        self._option = option  # the WorkerOptions field that sets the per-caller limit, for messages
        self._held: dict[str, int] = {}
        self._in_use = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        return self._in_use

    def held_by(self, owner: str) -> int:
        with self._lock:
            return self._held.get(owner, 0)

    def acquire(self, owner: str) -> Slot:
        """A slot for `owner`; SlotRefused naming the limit when the pool or the caller's share is full."""
        with self._lock:
            if self._in_use >= self.capacity:
                raise SlotRefused(f"{self.what} is full: {self.capacity} requests in flight; route to another "
                                  "replica or retry later", "full")
            held = self._held.get(owner, 0)
            if held >= self.per_caller:
                raise SlotRefused(f"{self.what}: this caller already holds {held} of its {self.capacity} slots, "
                                  f"at most {self.per_caller} per caller ({self._option}); retry when one of "
                                  "yours finishes", "caller_limit")
            self._held[owner] = held + 1
            self._in_use += 1
        return Slot(self, owner)

    def _give_back(self, owner: str) -> None:
        with self._lock:
            self._in_use -= 1
            left = self._held[owner] - 1
            if left:
                self._held[owner] = left
            else:
                del self._held[owner]
