"""The checks every Stage request passes before any compute, and the encoding of its reply.

`RequestFrames` belongs to one stage replica (node/replica/compute.py builds it) and is as
single-threaded as it, except `check_addressing`, which reads constants only and so may run on
the serving thread before a job is queued. Design choices:

- Every input is untrusted: run id, stage index, shapes, token range and finiteness are checked
  before any tensor reaches the stage, and a failure is an `InvalidRequest` whose message says
  what was expected and what was found (the worker answers INVALID_ARGUMENT and keeps serving).
  The bounds a request's declared sizes must respect before it is even read are the worker's
  (node/replica/bounds.py); these are the checks of what it carries.
- Frames are decoded into the runtime's (pinned) host buffers and copied to the device without
  waiting; a reply is read back to the host only where its bytes are needed.
- A result that is NaN/Inf or does not encode is the request's fault while the stage's weights
  are finite (its extreme but finite values overflowed the stage: a peer must not be able to
  make a worker look broken) and this replica's own `ComputeError` otherwise (`unusable`).
- Of a request's frames, a Forward's `wire` and a Backward's `output_grad` hold what another
  stage's worker computed (the trainer relays them unchanged); tokens and targets are the
  trainer's own, and ids in the vocabulary cannot overflow a stage. A refusal caused by the
  values of such a frame is an `ExtremeInput` naming the field, which the worker sends with the
  status (protos/stage_adapter.py `REFUSED_INPUT_METADATA`), so the trainer can hold the worker
  that produced them to account rather than this one.

The rejections (the worker maps each to one gRPC status, node/worker/service.py) live here too.
"""

from __future__ import annotations

import torch

from agora.pipeline.codec import WireCodec, WireFormatError, all_finite, decode_tokens
from agora.pipeline.config import RunConfig
from agora.pipeline.runtime import Runtime
from agora.pipeline.stages import Stage
from agora.protos.stage_adapter import PRODUCED_FIELDS, ForwardRequest

from agora.node.replica.work_ledger import MAX_WORK_KEY_CHARS

__all__ = [
    "RequestRejected",
    "InvalidRequest",
    "ExtremeInput",
    "PreconditionFailed",
    "ReportOutsideWindow",
    "UnknownMicrobatch",
    "NotOwner",
    "DuplicateMicrobatch",
    "ComputeError",
    "RequestFrames",
    "MAX_MICROBATCH_ID_CHARS",
]

MAX_MICROBATCH_ID_CHARS = 256


class RequestRejected(Exception):
    """The request cannot be served; the message is meant for the calling peer."""


class InvalidRequest(RequestRejected):
    """Malformed or mismatched input (INVALID_ARGUMENT)."""


class ExtremeInput(InvalidRequest):
    """The values of `field` (one of `PRODUCED_FIELDS`), which the previous stage's worker produced,
    are out of range: they overflowed this stage, or lie far beyond what it accepted lately
    (INVALID_ARGUMENT, with the field in the status's trailing metadata)."""

    def __init__(self, message: str, field: str):
        if field not in PRODUCED_FIELDS:
            raise ValueError(f"field must be one of {PRODUCED_FIELDS}, got {field!r}")
        super().__init__(message)
        self.field = field


class PreconditionFailed(RequestRejected):
    """Well-formed, but the worker's state does not allow it (FAILED_PRECONDITION)."""


class ReportOutsideWindow(PreconditionFailed):
    """A completed-batch report too far ahead of, or behind, the replica's count (node/replica/epoch.py).
    FAILED_PRECONDITION for now; its own class so the worker can give it a code a trainer may retry."""


class UnknownMicrobatch(PreconditionFailed):
    """A Backward for a microbatch whose forward input is not (or no longer) stashed."""


class NotOwner(RequestRejected):
    """A Backward or Abort of a microbatch another caller's Forward started (PERMISSION_DENIED)."""


class DuplicateMicrobatch(RequestRejected):
    """A Forward under an id whose earlier work is still pending (ALREADY_EXISTS)."""


class ComputeError(RuntimeError):
    """The stage itself produced something unusable (a NaN loss, an unencodable gradient) and its
    weights are not finite: this replica's failure, not the request's."""


class RequestFrames:
    """Decodes and checks one stage replica's requests, encodes its replies."""

    def __init__(self, config: RunConfig, run_id: str, codec: WireCodec, runtime: Runtime, stage: Stage):
        self.config, self.run_id, self.codec, self.runtime, self.stage = config, run_id, codec, runtime, stage

    def check_addressing(self, run_id: str, stage: int) -> None:
        """Cheap checks of a request's run and stage (safe from any thread: reads constants only)."""
        if run_id != self.run_id:
            raise InvalidRequest(f"run id {run_id!r} does not match this worker's run {self.run_id!r}")
        if stage != self.stage.index:
            raise InvalidRequest(
                f"request for stage {stage} reached a worker of stage {self.stage.index} "
                f"({self.stage.kind} of {self.stage.n_stages})")

    def check_microbatch_id(self, microbatch_id: str) -> None:
        if not microbatch_id or len(microbatch_id) > MAX_MICROBATCH_ID_CHARS:
            raise InvalidRequest(
                f"microbatch_id must be 1..{MAX_MICROBATCH_ID_CHARS} characters, got {len(microbatch_id)}")

    def decode_token_ids(self, frame: bytes, what: str, shape: tuple[int | None, ...]) -> torch.Tensor:
        if not frame:
            raise InvalidRequest(f"{what}: missing (empty frame)")
        try:
            ids = decode_tokens(frame, self.config.model.vocab_size, max_bytes=self.codec.max_bytes,
                                expected_shape=shape)
        except WireFormatError as error:
            raise InvalidRequest(f"{what}: {error}") from None
        if ids.shape[1] > self.config.model.max_seq_len:
            raise InvalidRequest(f"{what}: sequence length {ids.shape[1]} exceeds the model's "
                                 f"max_seq_len={self.config.model.max_seq_len}")
        return ids.to(self.runtime.device, non_blocking=True)

    def decode_floats(self, frame: bytes, what: str, shape: tuple[int, ...]) -> torch.Tensor:
        if not frame:
            raise InvalidRequest(f"{what}: missing (empty frame), expected shape {list(shape)}")
        try:
            # The codec refuses NaN/Inf payloads as well as any size or shape mismatch.
            host = self.codec.decode(frame, expected_shape=shape, out=self.runtime.host_buffer)
        except WireFormatError as error:
            raise InvalidRequest(f"{what}: {error}") from None
        return self.runtime.to_device(host)

    def unusable(self, message: str, produced: str | None = None) -> Exception:
        """The error for a result that is NaN/Inf or does not encode. Finite weights map inputs of
        sane magnitude to finite values, so with finite weights it is the request's values (finite,
        but the codec takes anything up to float32's max) that overflowed the stage: the caller's
        mistake, INVALID_ARGUMENT, an `ExtremeInput` when the values that can overflow came from
        another stage (`produced`: the request's frame that holds them, None when there is none).
        A non-finite weight makes it this replica's own failure."""
        if all(all_finite(p) for p in self.stage.parameters()):
            message = f"{message}; this stage's weights are finite, so the request's values overflowed it"
            return InvalidRequest(message) if produced is None else ExtremeInput(message, produced)
        return ComputeError(message)

    def encode(self, tensor: torch.Tensor, what: str, produced: str | None = None,
               codec: WireCodec | None = None) -> bytes:
        """`tensor` in this worker's wire encoding (`codec`: another one, e.g. fp32 for a probe's reply)."""
        try:
            return (codec or self.codec).encode(self.runtime.to_host(tensor))
        except WireFormatError as error:
            raise self.unusable(f"stage {self.stage.index} could not encode its {what}: {error}", produced) from None

    def check_finite(self, param_grads: list[torch.Tensor | None], source: str, produced: str | None = None) -> None:
        """Refuse parameter gradients that are not finite before they reach `.grad`. The codec takes
        any finite value up to float32's max, and on the head (no input gradient to encode, which
        would catch it elsewhere) an output gradient of 3e38 overflowed the embedding's gradient.
        One aminmax per gradient (codec.all_finite): isfinite().all() per gradient cost ~5% of a
        tiny stage's compute; a fused norm over all of them was cheaper per call, but its first
        call on a fresh worker costs milliseconds, which routing read as that replica being slow."""
        if self.runtime.is_cuda:  # one wait for all of them instead of one per gradient
            bounds = [torch.stack(torch.aminmax(grad.detach())) for grad in param_grads
                      if grad is not None and grad.numel()]
            finite = not bounds or bool(torch.isfinite(torch.stack(bounds)).all())
        else:
            finite = all(grad is None or all_finite(grad) for grad in param_grads)
        if not finite:
            raise self.unusable(f"{source}: stage {self.stage.index}'s parameter gradient is not finite; "
                                "nothing accumulated", produced)

    def decode_forward(self, request: ForwardRequest) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        self.check_addressing(request.run_id, request.stage)
        self.check_microbatch_id(request.microbatch_id)
        if len(request.work_key) > MAX_WORK_KEY_CHARS:
            raise InvalidRequest(f"work_key must be at most {MAX_WORK_KEY_CHARS} characters, got {len(request.work_key)}")
        tokens = self.decode_token_ids(request.tokens, "tokens", (None, None))
        batch, seq = tokens.shape
        if self.stage.is_head:
            if request.wire:
                raise InvalidRequest("wire: the head stage takes token ids only, but a wire frame was sent")
            wire = None
        else:
            wire = self.decode_floats(request.wire, "wire", (batch, seq, self.config.model.wire_dim))
        if self.stage.is_tail:
            targets = self.decode_token_ids(request.targets, "targets", (batch, seq))
        else:
            if request.targets:
                raise InvalidRequest(f"targets: only the tail takes targets; this is stage {self.stage.index}")
            targets = None
        return tokens, wire, targets
