"""A worker's compute: one stage replica, its optimizer, and the forward-input stash.

Everything here runs on the worker's single compute thread (node/worker/worker.py submits to it); this
module knows nothing of gRPC, so it is tested and reused (checkpoints, averaging) without sockets.
It speaks the Stage service's dataclasses and codec frames. Design choices:

- Every input is untrusted: run id, stage index, shapes, token range and finiteness are checked
  before any compute, and a failure is an `InvalidRequest` whose message says what was expected
  and what was found (the worker answers INVALID_ARGUMENT and keeps serving). Those checks, the
  decoding of frames and the encoding of replies, and the rejections themselves are
  node/replica/request_frames.py's; this module owns the stage's state.
- Forward runs under `torch.no_grad` and stashes its *input*; Backward recomputes the forward
  with grad on that input (with `keep_graphs > 0`, up to that many forwards run with grad and keep
  their graph, and their Backward skips the recompute while the weights are unchanged:
  node/replica/kept_graphs.py). Weights may change between the two (a step for the previous global
  batch, an averaging round's delta), and a backward through the new weights would pair the
  downstream gradient with an output the next stage never saw. So the recompute runs on the
  weights the forward used (PipeDream's weight stashing): every write to the weights bumps
  `weights_version`, and the version a stashed forward still needs is copied first
  (`weights_changing`). At most `pinned_versions` copies are kept (one copy of the stage's
  trainable parameters each: 3.4 GiB in fp32 for a pluralis-8b body stage, none on the tail,
  whose backward runs inside its forward); a microbatch whose version was dropped, or every
  microbatch with `pinned_versions=0`, recomputes on the current weights. Where the copies live
  (host memory on a GPU) and how their buffers are reused: node/replica/weight_versions.py.
- Device and precision (`runtime`, pipeline/runtime.py): the stage lives on the runtime's device;
  frames are decoded into (pinned) host buffers and copied over without waiting, results are
  read back where the reply needs their bytes, and every stage call runs under the runtime's
  autocast (bf16, or nothing for fp32, which is then exactly what it always computed). A job's
  compute time comes from the runtime's `JobTimer` (CUDA events on a GPU), which waits for the
  job's last kernels, so the worker's wall-clock compute times are true on a GPU as well.
- Nothing is half-applied: gradients are computed with `torch.autograd.grad` into temporaries
  and added to `.grad` only once the reply is known to be encodable; a NaN loss or an unencodable
  output or gradient fails the call without touching the accumulated gradients: an `InvalidRequest`
  while the stage's weights are finite (the request's extreme but finite values overflowed it: a
  peer must not be able to make a worker look broken), a `ComputeError` otherwise. The stash
  entry is popped only after the output gradient has been validated.
- A Forward marked `evaluate` (held-out loss) stashes nothing and computes no gradient.
- Microbatches are bound to their owner, the identity of the caller that ran the forward (the
  credential's peer id; node/rpc/auth_check.py): the stashed input and the accumulated gradient
  record it, and a Backward or Abort from anyone else is refused (`NotOwner`) before anything
  changes. A Forward under an id that is still stashed or accumulated is refused
  (`DuplicateMicrobatch`) instead of replacing that work; an id may be used again once a step
  has consumed it. In-process callers (tests, tools) act as `LOCAL_OWNER`.
- A worker never applies a unit's gradient twice: every attempt of a unit's microbatch carries the
  same `work_key`, and a repeat (a reclaimed unit a dead trainer had started) is computed for the
  stages around it but not accumulated (node/replica/work_ledger.py); its reply says `repeat`.
- The tail's Forward is forward + backward in one call: it accumulates its gradients at once and
  returns the loss and dL/d(input wire), the seed of the backward pass.
- Abort (the trainer abandoned a microbatch's route): its stashed input is dropped and, if its
  gradient was accumulated since the last step, the same gradient is recomputed and subtracted
  (on the weights it came from while those are pinned; after an averaging write that released
  them, on the current weights, which differ from them by that write), so an abandoned route
  leaves nothing half-applied. Once a step has consumed it, it stays
  (reported as "stepped"): that gradient came from a correct forward, it is only a duplicate sample.
- Stepping, once per global batch in both modes. Synchronous mode steps only on the Step
  barrier, which is idempotent per step number (a retried barrier gets the recorded reply
  instead of a second step). Asynchronous mode steps when a trainer reports a global batch done
  (`StepRequest.completed_batch`): every replica of a stage hears every report, so the replicas
  share one epoch counter, each stepping on its own share of the batch with the learning rate
  of the swarm's batch count. This is the Agora run's
  collective batch; stepping on a full batch of one's own samples instead would give R replicas
  1/R of the steps each and leave their schedules behind the swarm's. The gradient sum is divided
  by the replica's expected share of the batch (microbatches / replicas, from the report), not by
  what it happened to receive: trainers balance shares among equally fast replicas, but a slower
  replica, a reroute or a replica joining mid-batch still makes them uneven, and a replica
  that got one microbatch of eight must not step as far as one that got seven (in-process, 2
  replicas with random shares: 1.059 of train-local's held-out loss dividing by the own count,
  1.048 by the expected share, 1.040 with equal shares). A report is counted once (by batch id);
  a replica that accumulated nothing since its last step advances its count without an update.
  A replica that joins (or restarts) mid-run adopts the epoch from the first report it counts, so
  its learning rate is the swarm's, not a second warmup; after that a report must lie within a
  window of its own count or it is refused, not applied, and one trainer's reports move the count
  only as far as its credit there reaches (node/replica/epoch.py has the rules and the bounds on
  Step's `microbatches` and `replicas`). A synchronous barrier must name its step.
  `local_batch` (when set) makes a replica step on its own every that many samples instead, for
  runs whose trainers do not report.
- A gradient that is not finite (a finite but huge output gradient overflows the head's parameter
  gradients) is refused before it touches `.grad`, on every stage: one bad Backward would
  otherwise make the next step skip or, worse, poison the weights.
- A finite output gradient far beyond the ones this replica accepted lately (`output_grad_scale`,
  pipeline/wire_scale.py: the median largest |value| of the recent ones, a generous factor, none
  refused during a warm-up) is refused too, before any compute: whoever relays it (a hostile
  trainer, or an honest one relaying a lying worker's input gradient) must not make this stage
  train on it. It is an `ExtremeInput` naming `output_grad`; the stashed input is kept (the owner
  may send a sane gradient, or its Abort drops it), and only gradients of committed backwards
  enter the scale.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from agora.pipeline.codec import WireCodec
from agora.pipeline.config import RunConfig
from agora.pipeline.optim import StageOptimizer
from agora.pipeline.runtime import JobTimer, Runtime
from agora.pipeline.stages import Stage, build_stage
from agora.pipeline.wire_scale import WireScale
from agora.protos.stage_adapter import (
    AbortReply,
    AbortRequest,
    BackwardReply,
    BackwardRequest,
    ForwardReply,
    ForwardRequest,
    StepReply,
    StepRequest,
)

from agora.node.replica.epoch import (
    EPOCH_CATCH_UP_BATCHES,
    MAX_COMPLETED_BATCH,
    ReportCredits,
    ReportWindow,
    check_step_fields,
    judge_report,
    prune_counted,
)
from agora.node.replica.kept_graphs import KeptGraph, KeptGraphs
from agora.node.replica.stash import ForwardStash
from agora.node.replica.request_frames import (
    DuplicateMicrobatch,
    ExtremeInput,
    InvalidRequest,
    NotOwner,
    PreconditionFailed,
    ReportOutsideWindow,
    RequestFrames,
    UnknownMicrobatch,
)
from agora.node.replica.work_ledger import WorkLedger
from agora.node.replica.weight_versions import WeightCopies
from agora.node.worker.options import DEFAULT_PINNED_VERSIONS

__all__ = [
    "LOCAL_OWNER",
    "StashedInput",
    "StageCompute",
    "THROUGHPUT_SMOOTHING",
    "DEFAULT_PINNED_VERSIONS",
    "MAX_COMPLETED_BATCH",
    "EPOCH_CATCH_UP_BATCHES",
]

logger = logging.getLogger("agora.node.worker")

# The owner of work submitted in-process, without a gRPC caller.
LOCAL_OWNER = "local"
# Weight of the newest job in the throughput average: ~10 jobs of memory, steady under jitter.
THROUGHPUT_SMOOTHING = 0.1
# How far completed-batch reports may stray from a replica's count: node/replica/epoch.py.




@dataclass(frozen=True)
class StashedInput:
    tokens: torch.Tensor
    wire: torch.Tensor | None  # None on the head
    output_shape: tuple[int, ...]
    weights_version: int = 0  # StageCompute.weights_version when the forward ran
    owner: str = LOCAL_OWNER  # who ran the forward: only they may send its backward or abort it
    work_key: str = ""  # the work it trains on (node/replica/work_ledger.py)


@dataclass(frozen=True)
class AppliedMicrobatch:
    """What it takes to recompute a microbatch's gradient contribution until the next step."""

    tokens: torch.Tensor
    wire: torch.Tensor | None
    output_grad: torch.Tensor | None  # head/body: dL/d(output); None on the tail
    targets: torch.Tensor | None  # tail only
    weights_version: int = 0  # the weights its gradient was computed on
    owner: str = LOCAL_OWNER
    work_key: str = ""


class StageCompute:
    """One stage replica. Not thread-safe: call it from one thread only."""

    def __init__(self, config: RunConfig, index: int, *, run_id: str, codec: WireCodec, stash: ForwardStash,
                 synchronous: bool, local_batch: int | None = None, stage: Stage | None = None,
                 optimizer: StageOptimizer | None = None, pinned_versions: int = DEFAULT_PINNED_VERSIONS,
                 report_window: ReportWindow = ReportWindow(), keep_graphs: int = 0, runtime: Runtime | None = None,
                 output_grad_scale: WireScale | None = None):
        """`runtime`: where and in what precision to compute; default `config.runtime` resolved.
        `output_grad_scale`: the bound on Backward's output gradients (module docstring); None: none."""
        if local_batch is not None and local_batch <= 0:
            raise ValueError(f"local_batch must be positive, got {local_batch}")
        if pinned_versions < 0:
            raise ValueError(f"pinned_versions must be >= 0, got {pinned_versions}")
        self.config = config
        self.run_id = run_id
        self.codec = codec
        self.stash = stash
        self.synchronous = synchronous
        self.local_batch = local_batch
        self.runtime = runtime if runtime is not None else Runtime.from_config(config.runtime)
        self.stage = self.runtime.compile_stage(self.runtime.place_stage(
            stage if stage is not None else build_stage(config.model, index)))
        self.index = self.stage.index
        self.frames = RequestFrames(config, run_id, codec, self.runtime, self.stage)
        self._fp32_codec = WireCodec("fp32", max_bytes=codec.max_bytes)  # full-precision held-out replies
        self.n_stages = self.stage.n_stages
        self.optimizer = optimizer or StageOptimizer(self.stage, config.optim, self.index, self.n_stages)
        self.samples_total = 0  # every sample whose gradient this replica applied (averaging weights)
        # Microbatches whose gradients are in `.grad` now, for Abort; cleared by every step.
        self.applied: dict[str, AppliedMicrobatch] = {}
        self.work = WorkLedger()  # which units' microbatches this replica applied, across steps
        # Applied, then consumed by the last step: id -> owner (for Abort's answer).
        self.stepped_ids: dict[str, str] = {}
        self.last_step: StepReply | None = None
        self.report_window = report_window
        # Asynchronous reports counted and still inside the window (node/replica/epoch.py).
        self._counted_batches: OrderedDict[int, StepReply] = OrderedDict()
        self._joined_epoch = False  # a report has been counted since this replica started
        self.report_credits = ReportCredits(report_window.ahead)  # each trainer's, for jumps: epoch.py
        # The median step count the stage's other replicas announce (set by the join daemon from
        # their DHT records; None when it knows of none): node/replica/epoch.py.
        self.stage_step: int | None = None
        self.throughput = 0.0  # tokens/s of compute, moving average; 0 until the first job
        # Called on this thread right after every step (or advance), with this object: the averaging
        # loop snapshots a round's slice at the exact step it is due. A hook must not raise.
        self.step_hooks: list[Callable[["StageCompute"], None]] = []
        # Weight versions (see the module docstring): bumped by every write to the weights.
        self.weights_version = 0
        self._pinned = WeightCopies(self.runtime, pinned_versions)
        self.kept = KeptGraphs(keep_graphs)  # forward graphs kept for Backward (none by default)
        self.output_grad_scale = output_grad_scale
        self._parameter_names = [name for name, p in self.stage.named_parameters() if p.requires_grad]
        if len(self._parameter_names) != len(self.optimizer.parameters):
            raise ValueError("the optimizer's parameters are not the stage's trainable parameters")

    @property
    def accumulated_microbatches(self) -> int:
        """Microbatches whose gradients are in `.grad` now (since the last step)."""
        return len(self.applied)

    @property
    def epoch_joined(self) -> bool:
        """Whether this replica has counted a completed-batch report (and so follows the stage's epoch)."""
        return self._joined_epoch

    @property
    def accumulated_samples(self) -> int:
        return sum(applied.tokens.shape[0] for applied in self.applied.values())

    def _observe(self, tokens: int, timer: JobTimer) -> None:
        # The job's compute time (measurement only, so not the injected clock; see the docstring).
        rate = tokens / max(timer.seconds(), 1e-9)
        self.throughput = rate if self.throughput == 0 else (
            (1 - THROUGHPUT_SMOOTHING) * self.throughput + THROUGHPUT_SMOOTHING * rate)

    # ------------------------------------------------------------------ checks

    def check_addressing(self, run_id: str, stage: int) -> None:
        """Cheap checks of a request's run and stage (safe from any thread: reads constants only)."""
        self.frames.check_addressing(run_id, stage)

    def _check_new_microbatch(self, microbatch_id: str) -> None:
        if microbatch_id in self.stash or microbatch_id in self.applied:
            raise DuplicateMicrobatch(
                f"microbatch {microbatch_id!r} is already pending on stage {self.index}; a Forward never replaces "
                "earlier work: use a fresh random id for every attempt")

    @staticmethod
    def _check_owner(microbatch_id: str, owner: str, caller: str) -> None:
        if owner != caller:
            raise NotOwner(f"microbatch {microbatch_id!r} belongs to another trainer; only the trainer that ran "
                           "its forward may send its backward or abort it")


    # ------------------------------------------------------------------ compute

    def _gradients(self, output: torch.Tensor, wire: torch.Tensor | None, output_grad: torch.Tensor | None,
                   params: list[torch.Tensor] | None = None) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """dL/d(wire) and dL/d(parameters) (or of `params`, pinned copies), without touching `.grad`."""
        params = self.optimizer.parameters if params is None else params
        inputs = ([wire] if wire is not None else []) + params
        grads = torch.autograd.grad(output, inputs, grad_outputs=output_grad, allow_unused=True)
        if wire is not None:
            return grads[0], list(grads[1:])
        return None, list(grads)

    def _abort_record(self, tokens: torch.Tensor, wire: torch.Tensor | None, output_grad: torch.Tensor | None,
                      targets: torch.Tensor | None, version: int, owner: str, work_key: str = "") -> AppliedMicrobatch:
        """What an Abort of this microbatch would recompute, kept until the next step: in host memory on
        a GPU (a global batch's worth of them would otherwise sit on the device for a rare Abort)."""
        keep = self.runtime.keep_on_host
        return AppliedMicrobatch(keep(tokens), keep(wire), keep(output_grad), keep(targets), version, owner, work_key)

    def _accumulate(self, param_grads: list[torch.Tensor | None], microbatch_id: str,
                    applied: AppliedMicrobatch) -> bool:
        """Add a microbatch's gradient; False (nothing added) for a repeat of work applied before."""
        if not self.work.apply(applied.work_key):
            logger.info("stage %d: %s repeats work %s applied here before; computed, not applied again",
                        self.index, microbatch_id, applied.work_key)
            return False
        for param, grad in zip(self.optimizer.parameters, param_grads):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        self.applied[microbatch_id] = applied
        self.samples_total += applied.tokens.shape[0]
        if not self.synchronous and self.local_batch is not None and self.accumulated_samples >= self.local_batch:
            self._step(self.accumulated_microbatches)
        return True

    def forward(self, request: ForwardRequest, owner: str = LOCAL_OWNER) -> ForwardReply:
        timer = self.runtime.timer()
        timer.start()
        tokens, wire, targets = self.frames.decode_forward(request)
        if not request.evaluate:  # a held-out forward stores nothing, so it replaces nothing
            self._check_new_microbatch(request.microbatch_id)
        step = self.optimizer.steps
        produced = None if wire is None else "wire"  # what may overflow this stage: the previous one's output
        if request.evaluate:
            return self._held_out(tokens, wire, targets, step, produced, request.full_precision)
        if self.stage.is_tail:
            reply = self._forward_tail(tokens, wire, targets, step, request.microbatch_id, owner, request.work_key)
        else:
            self.kept.retain_only(self.stash)
            leaf = None
            if self.kept.has_room():  # keep this forward's graph: its Backward skips the recompute
                leaf = wire.detach().requires_grad_(True) if wire is not None else None
                with torch.enable_grad(), self.runtime.autocast():
                    output = self.stage(tokens, leaf)
            else:
                with torch.no_grad(), self.runtime.autocast():
                    output = self.stage(tokens, wire)
            reply = ForwardReply(wire=self.frames.encode(output.detach(), "output", produced), step=step,
                                 weights_version=self.weights_version)
            evicted = self.stash.put(request.microbatch_id,
                                     StashedInput(tokens, wire, tuple(output.shape), self.weights_version, owner,
                                                  request.work_key),
                                     owner=owner)
            for microbatch_id in evicted:
                self.kept.drop(microbatch_id)
            if output.requires_grad:
                self.kept.keep(request.microbatch_id, KeptGraph(output, leaf, self.weights_version))
        self._observe(tokens.numel(), timer)
        return reply

    def _held_out(self, tokens: torch.Tensor, wire: torch.Tensor | None, targets: torch.Tensor | None, step: int,
                  produced: str | None, full_precision: bool) -> ForwardReply:
        """A held-out forward: nothing stashed, no gradient. `full_precision` (finite-difference probes,
        node/trainer/gradient_checks.py): in float32 without autocast, the reply encoded in fp32, when
        the weights are float32; bf16 weights compute as usual and the reply says so."""
        precise = full_precision and self.runtime.weights == "fp32"
        with torch.no_grad(), (contextlib.nullcontext() if precise else self.runtime.autocast()):
            output = self.stage(tokens, wire, targets)
        if self.stage.is_tail:
            if not torch.isfinite(output):
                raise self.frames.unusable(f"tail produced a non-finite held-out loss ({float(output)})", produced)
            return ForwardReply(loss=float(output), step=step, weights_version=self.weights_version,
                                full_precision=precise)
        encoded = self.frames.encode(output, "output", produced, codec=self._fp32_codec if precise else None)
        return ForwardReply(wire=encoded, step=step, weights_version=self.weights_version, full_precision=precise)

    def _forward_tail(self, tokens: torch.Tensor, wire: torch.Tensor | None, targets: torch.Tensor,
                      step: int, microbatch_id: str, owner: str, work_key: str) -> ForwardReply:
        produced = None if wire is None else "wire"
        if wire is not None:
            wire.requires_grad_(True)
        with torch.enable_grad():
            with self.runtime.autocast():
                loss = self.stage(tokens, wire, targets)
            loss_value = float(loss.detach())
            if not torch.isfinite(loss.detach()):
                raise self.frames.unusable(f"tail produced a non-finite loss ({loss_value}); no gradient accumulated",
                                           produced)
            wire_grad, param_grads = self._gradients(loss, wire, None)
        self.frames.check_finite(param_grads, "the request's wire", produced)
        input_grad = self.frames.encode(wire_grad, "input gradient", produced) if wire_grad is not None else b""
        version = self.weights_version  # the gradient's weights (an asynchronous step may follow it)
        applied = self._accumulate(param_grads, microbatch_id,
                                   self._abort_record(tokens, None if wire is None else wire.detach(), None, targets,
                                                      version, owner, work_key))
        return ForwardReply(loss=loss_value, input_grad=input_grad, step=step, repeat=not applied,
                            weights_version=version)

    def backward(self, request: BackwardRequest, owner: str = LOCAL_OWNER) -> BackwardReply:
        timer = self.runtime.timer()
        timer.start()
        self.frames.check_addressing(request.run_id, request.stage)
        self.frames.check_microbatch_id(request.microbatch_id)
        if self.stage.is_tail:
            raise PreconditionFailed("the tail runs its backward inside Forward; Backward is for head and bodies")
        try:
            stashed = self.stash.get(request.microbatch_id)
        except KeyError:
            raise UnknownMicrobatch(
                f"no forward input stashed for microbatch {request.microbatch_id!r} on stage {self.index}: "
                f"never forwarded here, older than {self.stash.ttl_s:g} s, or evicted "
                f"(capacity {self.stash.capacity}); rerun the microbatch") from None
        self._check_owner(request.microbatch_id, stashed.owner, owner)
        output_grad = self.frames.decode_floats(request.output_grad, "output_grad", stashed.output_shape)
        largest = self._check_output_grad_scale(request.output_grad)
        version = self._available_version(stashed.weights_version)
        kept = self.kept.take(request.microbatch_id, self.weights_version)
        if kept is not None:  # built on these very weights: back-propagate through it
            with torch.enable_grad():
                wire_grad, param_grads = self._gradients(kept.output, kept.wire, output_grad)
        else:
            wire_grad, param_grads = self._recompute(version, stashed.tokens, stashed.wire, None, output_grad)
        self.frames.check_finite(param_grads, "output_grad", "output_grad")
        input_grad = self.frames.encode(wire_grad, "input gradient", "output_grad") if wire_grad is not None else b""
        self.stash.pop(request.microbatch_id)  # validated: this backward is now committed
        if largest is not None:
            self.output_grad_scale.accept(largest)
        step = self.optimizer.steps
        applied = self._accumulate(param_grads, request.microbatch_id,
                                   self._abort_record(stashed.tokens, stashed.wire, output_grad, None, version, owner,
                                                      stashed.work_key))
        self._unpin_unused()
        self._observe(stashed.tokens.numel(), timer)
        return BackwardReply(input_grad=input_grad, step=step, repeat=not applied, weights_version=version)

    def _check_output_grad_scale(self, frame: bytes) -> float | None:
        """The frame's largest |value| once the scale allows it (None without a scale); ExtremeInput beyond."""
        scale = self.output_grad_scale
        if scale is None:
            return None
        largest = self.codec.inspect(frame).largest_magnitude
        bound = scale.refuses(largest)
        if bound is not None:
            raise ExtremeInput(f"output_grad: values up to {largest:.3g}, beyond {bound:.3g} ({scale.factor:g} times the "
                               f"median largest value of the output gradients stage {self.index} accepted lately); "
                               "nothing applied, the stashed input is kept", "output_grad")
        return largest

    # ------------------------------------------------------------------ weight versions

    def weights_changing(self) -> None:
        """Call on this thread right before anything writes the stage's trainable weights."""
        current = self.weights_version
        self.kept.clear()  # built on the weights about to change (their backwards recompute)
        if self.pinned_versions and current not in self._pinned and current in self._needed_versions():
            # Beyond pinned_versions the oldest goes: its microbatches recompute on current weights.
            self._pinned.keep(current, self.optimizer.parameters)
        self.weights_version = current + 1
        self._unpin_unused()

    def _needed_versions(self) -> set[int]:
        """Versions a pending backward would recompute on. An Abort uses its gradient's version
        while that is still pinned for a backward, else the current weights: pinning for aborts,
        which are rare, would hold a copy of the stage after every averaging round."""
        return {entry.weights_version for entry in self.stash.values()}

    def _unpin_unused(self) -> None:
        if self._pinned:
            needed = self._needed_versions()
            for version in [v for v in self._pinned.versions() if v not in needed]:
                self._pinned.drop(version)

    def _available_version(self, version: int) -> int:
        """`version` if its weights are the current ones or pinned, else the current version."""
        return version if version == self.weights_version or version in self._pinned else self.weights_version

    def _recompute(self, version: int, tokens: torch.Tensor, wire: torch.Tensor | None,
                   targets: torch.Tensor | None, output_grad: torch.Tensor | None):
        """The forward on the weights of `version` (current or pinned) and its gradients:
        (dL/d(wire), dL/d(parameters)), touching no `.grad`."""
        wire = wire.detach().requires_grad_(True) if wire is not None else None
        inputs = (tokens, wire, targets) if self.stage.is_tail else (tokens, wire)
        with torch.enable_grad():
            if version == self.weights_version:
                with self.runtime.autocast():
                    output = self.stage(*inputs)
                return self._gradients(output, wire, output_grad)
            weights = self._pinned.weights(version)
            with self.runtime.autocast():
                output = torch.func.functional_call(self.stage, dict(zip(self._parameter_names, weights)), inputs)
            return self._gradients(output, wire, output_grad, weights)

    @property
    def pinned_versions(self) -> int:
        """How many earlier weight versions may be kept (settable)."""
        return self._pinned.capacity

    @pinned_versions.setter
    def pinned_versions(self, count: int) -> None:
        self._pinned.resize(count)

    @property
    def pinned_weight_copies(self) -> int:
        """Copies of earlier weights held for pending backwards (memory: one stage's parameters each)."""
        return len(self._pinned)

    # ------------------------------------------------------------------ stepping

    def abort(self, request: AbortRequest, owner: str = LOCAL_OWNER) -> AbortReply:
        """Take an abandoned microbatch back out (see the module docstring); only its owner may."""
        self.frames.check_addressing(request.run_id, request.stage)
        self.frames.check_microbatch_id(request.microbatch_id)
        applied = self.applied.get(request.microbatch_id)
        if applied is None:
            try:
                stashed = self.stash.get(request.microbatch_id)
            except KeyError:
                stepped_owner = self.stepped_ids.get(request.microbatch_id)
                if stepped_owner is None:
                    return AbortReply(reverted=False, outcome="unknown")
                self._check_owner(request.microbatch_id, stepped_owner, owner)
                return AbortReply(reverted=False, outcome="stepped")
            self._check_owner(request.microbatch_id, stashed.owner, owner)
            self.stash.pop(request.microbatch_id)
            self.kept.drop(request.microbatch_id)
            self._unpin_unused()  # its forward's weights may have been pinned for it alone
            return AbortReply(reverted=False, outcome="dropped")
        self._check_owner(request.microbatch_id, applied.owner, owner)
        del self.applied[request.microbatch_id]
        self.work.forget(applied.work_key)
        version = self._available_version(applied.weights_version)
        on_device = self.runtime.to_device
        _, param_grads = self._recompute(version, *(None if t is None else on_device(t) for t in (
            applied.tokens, applied.wire, applied.targets, applied.output_grad)))
        for param, grad in zip(self.optimizer.parameters, param_grads):
            if grad is not None and param.grad is not None:
                param.grad.sub_(grad)
        self.samples_total -= applied.tokens.shape[0]
        return AbortReply(reverted=True, outcome="reverted")

    def work_in_weights(self) -> list[str]:
        """The applied work keys whose gradient is in the parameters: the ledger's, less those of the
        microbatches still accumulating (a checkpoint holds the weights, not the pending gradient)."""
        pending = {applied.work_key for applied in self.applied.values() if applied.work_key}
        return [key for key in self.work.keys() if key not in pending]

    def _step(self, microbatches: float) -> StepReply:
        """Step on the accumulated gradient sum divided by `microbatches`."""
        accumulated = self.accumulated_microbatches
        self.weights_changing()
        result = self.optimizer.step(microbatches)
        self.stepped_ids = {microbatch_id: applied.owner for microbatch_id, applied in self.applied.items()}
        self.applied.clear()
        self.last_step = StepReply(step=self.optimizer.steps, grad_norm=result["grad_norm"], lr=result["lr"],
                                   skipped=bool(result["skipped"]), accumulated=accumulated)
        self._after_step()
        return self.last_step

    def _after_step(self) -> None:
        for hook in self.step_hooks:
            try:
                hook(self)
            except Exception:  # a bug in a hook must not fail the step the trainer asked for
                logger.exception("stage %d: step hook %r failed", self.index, hook)

    def step(self, request: StepRequest, owner: str = LOCAL_OWNER) -> StepReply:
        """The synchronous-mode barrier, or an asynchronous report of a completed global batch.

        A barrier closes a batch whose microbatches passed this stage: only a trainer that owns one
        of the microbatches accumulated since the last step may close it (a retried barrier of a
        step already taken gets its recorded reply from anyone)."""
        self.frames.check_addressing(request.run_id, request.stage)
        if request.completed_batch is not None:
            return self._batch_done(request.completed_batch, request.microbatches, request.replicas, owner)
        if not self.synchronous:
            raise PreconditionFailed("this worker is in asynchronous mode: it steps when trainers report "
                                     "completed global batches (completed_batch), not on a Step barrier")
        self._check_step_fields(request.microbatches, None)
        current = self.optimizer.steps
        if request.step is None:  # the trainer always names it: without, any stray Step would step
            raise InvalidRequest(f"step: a synchronous Step barrier must name the step it closes "
                                 f"(this worker is at step {current}), got none")
        if self.last_step is not None and request.step == current - 1:
            return self.last_step  # a retried barrier: already stepped
        if request.step != current:
            raise PreconditionFailed(f"Step barrier for step {request.step}, but this worker is at step {current}")
        if not self.applied:
            raise PreconditionFailed(f"Step barrier for step {current}, but no microbatch has passed this stage "
                                     "since the last step")
        if all(applied.owner != owner for applied in self.applied.values()):
            raise NotOwner(f"the microbatches of step {current} on stage {self.index} belong to another trainer; "
                           "only a trainer with work in it may close a Step barrier")
        return self._step(request.microbatches)

    def _check_step_fields(self, microbatches: int, replicas: int | None) -> None:
        refusal = check_step_fields(microbatches=microbatches, replicas=replicas,
                                    configured_microbatches=self.config.train.microbatches, window=self.report_window)
        if refusal is not None:
            raise InvalidRequest(refusal)

    def _batch_done(self, batch: int, microbatches: int, replicas: int, owner: str) -> StepReply:
        """Trainer `owner` reports global batch `batch` done: one local step (see the module docstring)."""
        if self.synchronous:
            raise PreconditionFailed("this worker is in synchronous mode: it steps on the Step barrier only, "
                                     "not on completed-batch reports")
        if self.local_batch is not None:
            raise PreconditionFailed(f"this worker steps on its own every {self.local_batch} samples "
                                     "(--local-batch), not on completed-batch reports")
        if batch >= MAX_COMPLETED_BATCH:
            raise InvalidRequest(f"completed_batch must be below 2**53, got {batch}")
        counted = self._counted_batches.get(batch)
        if counted is not None:
            return counted  # a retried report, or one already counted
        self._check_step_fields(microbatches, replicas)
        decision = judge_report(batch, self.optimizer.steps, joined=self._joined_epoch, window=self.report_window,
                                stage_step=self.stage_step, credit=self.report_credits.of(owner))
        if decision.refusal is not None:
            raise ReportOutsideWindow(decision.refusal)
        if decision.adopt is not None:
            logger.info("stage %d: global batch %d reported at local step %d (the stage's other replicas "
                        "announce %s); adopting the stage's epoch at %d (learning rate and averaging rounds follow "
                        "the swarm's batch count)", self.index, batch, self.optimizer.steps, self.stage_step,
                        decision.adopt)
            self.optimizer.steps = decision.adopt
        if self.accumulated_microbatches:
            reply = self._step(microbatches / replicas)
        else:
            # Nothing routed here since the last step: keep the swarm's count, change no weights.
            lr = self.optimizer.advance()
            self.stepped_ids = {}
            self._after_step()
            reply = StepReply(step=self.optimizer.steps, grad_norm=0.0, lr=lr, skipped=False, accumulated=0)
        self._counted_batches[batch] = reply
        self.report_credits.counted(owner, decision.spent)
        self._joined_epoch = True
        prune_counted(self._counted_batches, self.optimizer.steps, self.report_window)
        return reply
