"""The memory plan: what one worker of one stage holds at its peak, before anything is allocated.

`plan_stage` answers, per stage and in bytes: parameters, gradients, optimizer state, pinned
weight versions, fixed buffers (U, T), the activation stash at the in-flight depth, the records
kept for Abort until a step, the inference sessions' attention caches at the worker's budget for
them, and the working set of the worst job (a forward, a backward recompute, the tail's fused
forward and backward, an optimizer step) on top of all that.
`agora-node plan` prints it; `join` runs it for its own stage and device before loading anything
and refuses, naming the shortfall, when it does not fit.

Design choices:
- Computed from the same module definitions the worker builds, not from a formula: the stage is
  built under torch's FakeTensorMode (CPU tensors backed by meta storage: shapes, dtypes and
  strides, no memory; plain meta tensors would not do, since autocast acts on CPU tensors and SDPA
  on meta falls back to a seq x seq matrix per head), placed as `Runtime.place_stage` places it
  (U and T in the compute dtype, weights in theirs), and each job runs on it under the same
  autocast, with `LiveBytes` counting the bytes of every tensor an operator creates and dropping
  them when their storage dies. So a change to the model (a norm, a projection, what autograd
  saves) changes the plan with it. Attention runs the kernel a CPU worker runs (flash attention
  for the CPU, which saves its output and log-sum-exp); a CUDA worker's flash or memory-efficient
  kernel saves tensors of the same shapes. Its first use imports torch's compiler stack (seconds),
  which building any torch optimizer does too, so a worker pays it once either way.
- The jobs mirror node/replica/compute.py (the plan's module may not import node/): forward under
  no_grad, backward as a recompute with autograd.grad into temporaries that are then added into
  the existing `.grad`, the tail's forward with its backward. tests/unit/test_memory_plan.py measures
  a real StageCompute on the CPU against this plan, and bench/gpu.py a pluralis-8b body stage on
  a GPU.
- The optimizer step's temporaries follow the update rule (its norms are data-dependent, which
  fake tensors cannot evaluate): torch's single-tensor AdamW holds two temporaries the size of
  the largest parameter (the square root of the second moment and its scaled copy), RoundedAdamW
  four in fp32 (the widened gradient and weight besides those two).
- Inference sessions keep their attention caches on the stage's device beside the training state
  (node/inference/engine.py), up to a budget in bytes the worker enforces
  (`inference.max_kv_cache_gib`; by default `max_sessions` sessions of the longest a session may
  be, one row each). The plan counts that budget as held, so a worker that fits its plan never
  lends training's memory to sessions. What a position costs is measured on the fake stage by
  caching one (pipeline/inference.py `cache_bytes_per_position`), as the worker measures it.
- Where things live: on a CUDA worker pinned weight versions and the Abort records are in host
  memory (node/replica/weight_versions.py, node/replica/compute.py), so they count in `host`, and a
  backward on a pinned version stages one copy of the trainable weights on the device. CUDA adds
  its context and the caching allocator's slack (`cuda_reserve`), an estimate that bench/gpu.py
  checks against a real device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

from agora.pipeline.config import RunConfig
from agora.pipeline.inference import cache_bytes_per_position
from agora.pipeline.optim import StageOptimizer
from agora.pipeline.runtime import Runtime
from agora.pipeline.stages import build_stage

__all__ = ["LiveBytes", "MemoryOptions", "StagePlan", "plan_stage", "plan_run", "format_plan", "GiB",
           "CUDA_CONTEXT_BYTES", "CUDA_ALLOCATOR_SLACK"]

GiB = 2**30
# What a CUDA process holds besides its tensors: the context (kernels, cuBLAS workspaces), and the
# caching allocator's rounding and fragmentation as a share of the peak. Measured on an H200 with
# CUDA 13 (bench/results/gpu.md): a context of about 0.7 GiB, and 2% over the tensors' peak with the
# expandable segments agora-node asks for (the default allocator's fixed blocks took 13-19%).
CUDA_CONTEXT_BYTES = 3 * GiB // 4
CUDA_ALLOCATOR_SLACK = 0.03


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of tensors operators create while active, and their peak.

    A tensor an operator returns is new unless its storage is one of the operator's inputs' (views
    and in-place results) or already counted; it stops counting when its storage is freed (a weak
    reference to the storage). Tensors that existed before (the weights, their `.grad`, the
    optimizer state) are never counted: this is the working set of what runs inside, on fake
    tensors as on real ones.

    Freed storages are swept out only when the count passes the peak: the count without a sweep
    is never below the live bytes, so an operator that does not pass the peak cannot raise it, and
    the peak is the one a sweep around every operator gives, at a fraction of the cost (the sweep
    is over every counted tensor, and a training step runs tens of thousands of operators). A freed
    storage's address is not reused while it waits for a sweep: the weak reference keeps it.
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.bytes = 0
        self.peak = 0

    def _sweep(self) -> None:
        for key in [key for key, (ref, _) in self._live.items() if ref.expired()]:
            self.bytes -= self._live.pop(key)[1]

    def held(self) -> int:
        """Bytes of the counted tensors still alive now."""
        self._sweep()
        return self.bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in inputs and ref.cdata not in self._live:
                    self._live[ref.cdata] = (ref, storage.nbytes())
                    self.bytes += storage.nbytes()
        if self.bytes > self.peak:
            self._sweep()
            self.peak = max(self.peak, self.bytes)
        return out


@dataclass(frozen=True)
class MemoryOptions:
    """What the plan assumes of the worker (node/plan.py fills it from the worker's options)."""

    microbatch: int  # samples per microbatch
    seq_len: int
    in_flight: int  # forwards stashed at once for their backward (head and bodies)
    pinned_versions: int  # earlier weight versions kept (head and bodies)
    applied: int  # microbatches accumulated before a step, whose Abort records are kept
    session_positions: int = 0  # positions the inference sessions hold at most by default (sessions x tokens)
    kv_cache_bytes: int | None = None  # the sessions' cache budget when set (inference.max_kv_cache_gib)


@dataclass(frozen=True)
class StagePlan:
    index: int
    kind: str
    device: str  # "cpu" or "cuda": where the plan's device bytes live
    dtype: str
    trainable: int  # trainable parameters (elements)
    parameters: int  # the rest in bytes
    gradients: int
    optimizer: int
    pinned: int  # pinned weight versions, wherever they live
    fixed: int  # U and T
    stash: int  # stashed forward inputs at the in-flight depth
    applied: int  # Abort records of accumulated microbatches
    kv_cache: int  # the inference sessions' attention caches, at the worker's budget for them
    kv_per_position: int  # what one position of one row costs in them
    working: int  # the worst job's working set on top of the state
    working_job: str  # which job that is
    reserve: int  # CUDA context and allocator slack (0 on the CPU)
    pinned_on_host: bool

    @property
    def state(self) -> int:
        """Device bytes held between jobs."""
        on_device = self.parameters + self.gradients + self.optimizer + self.fixed + self.stash + self.kv_cache
        return on_device + (0 if self.pinned_on_host else self.pinned + self.applied)

    @property
    def peak(self) -> int:
        """Device bytes at the worst moment."""
        return self.state + self.working + self.reserve

    @property
    def host(self) -> int:
        """Host bytes (page-locked) a CUDA worker holds for this stage beyond the device's."""
        return self.pinned + self.applied if self.pinned_on_host else 0

    def shortfall(self, available_bytes: int) -> int:
        """How many bytes beyond `available_bytes` the peak needs (0: it fits)."""
        return max(0, self.peak - available_bytes)

    def as_dict(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**values, "state": self.state, "peak": self.peak, "host": self.host}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_nbytes(optimizer: StageOptimizer) -> int:
    return sum(_nbytes(v for v in state.values() if isinstance(v, torch.Tensor))
               for state in optimizer.optimizer.state.values())


def _forward(stage, runtime, tokens, wire) -> None:
    """A head's or body's Forward: no_grad, its output encoded (read on the host) and dropped."""
    with torch.no_grad(), runtime.autocast():
        output = stage(tokens, wire)
    del output


def _backward(stage, runtime, parameters, tokens, wire, output_grad) -> None:
    """A head's or body's Backward: recompute with grad, gradients into temporaries, added to .grad."""
    leaf = wire.detach().requires_grad_(True) if wire is not None else None
    with torch.enable_grad():
        with runtime.autocast():
            output = stage(tokens, leaf)
        inputs = ([leaf] if leaf is not None else []) + parameters
        grads = torch.autograd.grad(output, inputs, grad_outputs=output_grad(), allow_unused=True)
    del output
    for parameter, grad in zip(parameters, grads[len(inputs) - len(parameters):]):
        if grad is not None:
            parameter.grad.add_(grad)


def _tail(stage, runtime, parameters, tokens, wire, targets) -> None:
    """The tail's Forward: the loss and its backward in one job, gradients added to .grad."""
    leaf = wire.detach().requires_grad_(True) if wire is not None else None
    with torch.enable_grad():
        with runtime.autocast():
            loss = stage(tokens, leaf, targets)
        inputs = ([leaf] if leaf is not None else []) + parameters
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    del loss
    for parameter, grad in zip(parameters, grads[len(inputs) - len(parameters):]):
        if grad is not None:
            parameter.grad.add_(grad)


def _step_transient(parameters: list[torch.Tensor]) -> int:
    """Temporaries of one optimizer step (see the module docstring)."""
    largest = max((p.numel() for p in parameters), default=0)
    if any(p.dtype == torch.bfloat16 for p in parameters):
        return 4 * largest * 4  # RoundedAdamW: fp32 gradient, weight, sqrt and its scaled copy
    return 2 * largest * max((p.element_size() for p in parameters), default=4)


def _measure(job) -> int:
    counter = LiveBytes()
    with counter:
        job()
    return counter.peak


def plan_stage(config: RunConfig, index: int, options: MemoryOptions, *, device_type: str, dtype: str,
               weights: str = "fp32") -> StagePlan:
    """The plan of stage `index` of `config` on a `device_type` ("cpu" or "cuda") device in `dtype`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = config.model
    runtime = Runtime(device=torch.device("cpu"), dtype=dtype, weights=weights)  # fake CPU tensors: see above
    with FakeTensorMode():
        stage = runtime.place_stage(build_stage(model, index))
        optimizer = StageOptimizer(stage, config.optim, stage.index, stage.n_stages)
        parameters = optimizer.parameters
        for parameter in parameters:
            parameter.grad = torch.zeros_like(parameter)
        for parameter in parameters:  # the moments, as a first step creates them
            moments = optimizer.optimizer.state[parameter]
            moments["step"] = torch.tensor(0.0)
            moments["exp_avg"] = torch.zeros_like(parameter, dtype=torch.float32 if weights == "bf16" else None)
            moments["exp_avg_sq"] = torch.zeros_like(moments["exp_avg"])
        rows, seq, width = options.microbatch, options.seq_len, model.wire_dim
        tokens = torch.randint(0, model.vocab_size, (rows, seq))
        wire = None if stage.is_head else torch.randn(rows, seq, width)
        jobs: dict[str, int] = {}
        if stage.is_tail:
            jobs["tail forward+backward"] = _measure(lambda: _tail(
                stage, runtime, parameters, torch.randint(0, model.vocab_size, (rows, seq)),
                None if stage.is_head else torch.randn(rows, seq, width),
                torch.randint(0, model.vocab_size, (rows, seq))))
        else:
            jobs["forward"] = _measure(lambda: _forward(
                stage, runtime, torch.randint(0, model.vocab_size, (rows, seq)),
                None if stage.is_head else torch.randn(rows, seq, width)))
            jobs["backward"] = _measure(lambda: _backward(stage, runtime, parameters, tokens, wire,
                                                          lambda: torch.randn(rows, seq, width)))
        pinned = 0 if stage.is_tail else options.pinned_versions * _nbytes(parameters)
        pinned_on_host = device_type == "cuda"
        if pinned and pinned_on_host:  # a backward on a pinned version stages its weights on the device
            jobs["backward on a pinned version"] = jobs["backward"] + _nbytes(parameters)
        jobs["optimizer step"] = _step_transient(parameters)
        token_bytes = rows * seq * 8
        wire_bytes = rows * seq * width * 4
        stash = 0 if stage.is_tail else options.in_flight * (token_bytes + (0 if stage.is_head else wire_bytes))
        # An Abort record: tokens, the input wire, and the output gradient (targets on the tail).
        record = token_bytes + (0 if stage.is_head else wire_bytes) + (token_bytes if stage.is_tail else wire_bytes)
        job, working = max(jobs.items(), key=lambda item: item[1])
        with runtime.autocast():
            kv_per_position = cache_bytes_per_position(stage, runtime.device)
        kv_cache = options.kv_cache_bytes if options.kv_cache_bytes is not None else \
            options.session_positions * kv_per_position
        state = _nbytes(stage.parameters()) + _nbytes(parameters) + _state_nbytes(optimizer) + \
            _nbytes(stage.buffers()) + stash + kv_cache
        plan = StagePlan(
            index=stage.index, kind=stage.kind, device=device_type, dtype=dtype,
            trainable=sum(p.numel() for p in parameters), parameters=_nbytes(stage.parameters()),
            gradients=_nbytes(parameters), optimizer=_state_nbytes(optimizer), pinned=pinned,
            fixed=_nbytes(stage.buffers()), stash=stash, applied=options.applied * record, kv_cache=kv_cache,
            kv_per_position=kv_per_position,
            working=working, working_job=job, reserve=0, pinned_on_host=pinned_on_host)
    if device_type == "cuda":
        slack = math.ceil(CUDA_ALLOCATOR_SLACK * (state + working))
        plan = replace(plan, reserve=CUDA_CONTEXT_BYTES + slack)
    return plan


def plan_run(config: RunConfig, options: MemoryOptions, *, device_type: str, dtype: str, weights: str = "fp32",
             stages: list[int] | None = None) -> list[StagePlan]:
    """Every stage's plan (or those in `stages`). Stages of one shape (the kind and the number of
    blocks: every block of a model has the same shapes) share one planning run, which takes seconds
    to minutes on a large model: a 7-stage split plans a head, a tail and one or two bodies."""
    split = config.layer_split
    indices = range(len(split)) if stages is None else stages
    by_shape: dict[tuple[bool, bool, int], StagePlan] = {}
    plans = []
    for index in indices:
        shape = (index == 0, index == len(split) - 1, split[index])
        if shape not in by_shape:
            by_shape[shape] = plan_stage(config, index, options, device_type=device_type, dtype=dtype, weights=weights)
        plans.append(replace(by_shape[shape], index=index))
    return plans


def format_plan(plans: list[StagePlan], memory_gb: float | None = None) -> str:
    """The table `agora-node plan` prints (GiB, or MiB for small models), with a fit verdict per
    stage for `memory_gb` (decimal GB)."""
    unit, scale = ("GiB", GiB) if max(plan.peak for plan in plans) >= GiB else ("MiB", 2**20)

    def size(value: int) -> str:
        return f"{value / scale:.2f}"

    columns = ["stage", "params", "grads", "optim", "pinned", "fixed", "stash", "abort", "kv cache", "working",
               "reserve", "peak", "host"]
    rows = []
    for plan in plans:
        where = " (host)" if plan.pinned_on_host else ""
        rows.append([f"{plan.index} {plan.kind}", size(plan.parameters), size(plan.gradients), size(plan.optimizer),
                     size(plan.pinned) + where, size(plan.fixed), size(plan.stash), size(plan.applied) + where,
                     size(plan.kv_cache), size(plan.working), size(plan.reserve), size(plan.peak), size(plan.host)])
    if memory_gb is not None:
        columns.append(f"fits {memory_gb:g} GB")
        for row, plan in zip(rows, plans):
            short = plan.shortfall(int(memory_gb * 1e9))
            row.append("yes" if not short else f"no, short {size(short)} {unit}")
    widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]
    lines = ["  ".join(str(cell).rjust(width) for cell, width in zip(line, widths)) for line in [columns, *rows]]
    jobs: dict[str, list[str]] = {}
    for plan in plans:
        jobs.setdefault(plan.working_job, []).append(str(plan.index))
    lines.append(f"{unit}; peak = the state plus the working set of the worst job ("
                 + "; ".join(f"{job}: stage {', '.join(indices)}" for job, indices in jobs.items())
                 + "), plus the CUDA reserve; kv cache = the inference sessions' budget; "
                 "host = page-locked host memory")
    return "\n".join(lines)

