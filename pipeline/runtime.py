"""Where a stage computes and in what precision: the device, autocast, host<->device copies, timing.

Design choices:
- `auto` takes CUDA when torch sees a device, else the CPU. A device that cannot be had (`cuda` on
  a CPU-only torch, `cuda:3` on a one-GPU machine, bf16 on a GPU without it) is a `ConfigError`
  naming the flag and the field: the CLI prints it as one line and exits 2, before anything loads.
- bf16 is mixed precision the way the field does it: parameters, gradients and optimizer state
  stay fp32 (master weights) and `autocast` runs matmuls and attention in bf16. fp32 runs no
  autocast at all, so it computes exactly what it computed before this module existed.
  `runtime.weights = "bf16"` stores the weights themselves in bf16 (pipeline/optim.py keeps the
  Adam moments in fp32 and rounds each update into them): the variant measured against it.
- The fixed buffers U and T are stored in the compute dtype (`place_stage`): every matmul with U
  under autocast casts it to bf16 anyway, and rows of T are widened to fp32 as they are gathered
  (pipeline/model.py), so the residual stream stays fp32 while the largest fixed buffer (T:
  2.45 GiB in fp32 on pluralis-8b) halves. Workers of one run should share the compute dtype: a
  bf16 worker's T is the fp32 one rounded, so a boundary between an fp32 and a bf16 stage is off by
  that rounding (about 2^-9 of T, the size of bf16 compute's own error).
- Host<->device: frames are decoded into page-locked (pinned) host memory (`host_buffer`) and
  copied with non_blocking=True; results go back into pinned memory and are waited for only where
  their bytes are needed (the encoder reads them). torch's caching host allocator keeps a pinned
  block from reuse until the copy reading it has finished, so a staging buffer may be dropped once
  its copy is queued. On the CPU the same calls run with plain tensors and copy nothing.
- Timing (`JobTimer`): on CUDA, kernels run after Python returns, so wall time measures launches.
  CUDA events around a job are read at its end, where the job has synchronised already (its
  reply needed the result), so the compute times a worker reports and routing's throughput
  estimates stay true. On the CPU it is perf_counter.
- Device memory (`device_memory`) is read in one place, for the memory plan's fit check
  (pipeline/memory.py) and for the hardware an admission reports (auth/admission.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from agora.pipeline.config import ConfigError, RuntimeConfig, checked

__all__ = ["Runtime", "resolve_device", "DeviceMemory", "device_memory", "JobTimer", "CPU_FP32"]

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_device(spec: str) -> torch.device:
    """The torch device `spec` names (auto, cpu, cuda, cuda:N), or a ConfigError saying why not."""
    checked(RuntimeConfig, "runtime", device=spec)
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    where = "--device / runtime.device"
    if not torch.backends.cuda.is_built():
        raise ConfigError(f"{where}: {spec} requested, but this torch ({torch.__version__}) is built without CUDA; "
                          "install a CUDA build of torch, or pass --device cpu")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise ConfigError(f"{where}: {spec} requested, but no CUDA device is visible{hint}; pass --device cpu")
    count = torch.cuda.device_count()
    index = int(spec.partition(":")[2] or torch.cuda.current_device())
    if index >= count:
        raise ConfigError(f"{where}: {spec} requested, but only {count} CUDA device(s) are visible "
                          f"(cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


@dataclass(frozen=True)
class DeviceMemory:
    name: str  # "cpu", or the accelerator's name
    total_bytes: int  # the accelerator's memory, or the machine's RAM for the CPU
    free_bytes: int  # what is free now (equal to total where it cannot be read without cost)
    accelerator: bool


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return 0


def _available_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return _ram_bytes()


def device_memory(device: torch.device, *, free: bool = False) -> DeviceMemory:
    """The memory of `device`. `free=True` also reads what is free now (on CUDA this creates the
    process's CUDA context, which a worker about to compute there needs anyway)."""
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        total = int(properties.total_memory)
        available = int(torch.cuda.mem_get_info(device)[0]) if free else total
        return DeviceMemory(properties.name, total, available, accelerator=True)
    total = _ram_bytes()
    return DeviceMemory("cpu", total, _available_ram_bytes() if free else total, accelerator=False)


class JobTimer:
    """Seconds of compute of one job on `device` (see the module docstring); one job at a time."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._device = device
        self._started: float | torch.cuda.Event = 0.0

    def start(self) -> None:
        if self._cuda:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record(torch.cuda.current_stream(self._device))
        else:
            self._started = time.perf_counter()

    def seconds(self) -> float:
        """Since `start()`: the job's kernels included (waits for them on CUDA)."""
        if not self._cuda:
            return time.perf_counter() - self._started
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self._device))
        end.synchronize()
        return self._started.elapsed_time(end) / 1000.0


@dataclass(frozen=True)
class Runtime:
    """A resolved `[runtime]`: the device, the compute dtype and the weights' dtype."""

    device: torch.device = torch.device("cpu")
    dtype: str = "fp32"
    weights: str = "fp32"
    compile: bool = False

    @classmethod
    def from_config(cls, config: RuntimeConfig) -> "Runtime":
        device = resolve_device(config.device)
        if config.dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"--dtype / runtime.dtype: bf16 requested, but {torch.cuda.get_device_name(device)} "
                              "does not support it; pass --dtype fp32")
        return cls(device=device, dtype=config.dtype, weights=config.weights, compile=config.compile)

    @property
    def compute_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]

    @property
    def weights_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.weights]

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def pins_host_memory(self) -> bool:
        """Whether host staging buffers are page-locked: only where a device copies from them."""
        return self.is_cuda

    def describe(self) -> str:
        weights = "" if self.dtype == "fp32" else ", fp32 master weights" if self.weights == "fp32" else \
            f", {self.weights} weights"
        return f"{self.device} {self.dtype}{weights}{', compiled' if self.compile else ''}"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The compute context of a stage's forward and backward: bf16 autocast, or nothing."""
        if self.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def place_stage(self, stage: nn.Module) -> nn.Module:
        """Move a freshly built stage here: fixed buffers in the compute dtype, weights in theirs."""
        with torch.no_grad():
            for module in stage.modules():
                for name, buffer in list(module.named_buffers(recurse=False)):
                    if buffer is not None and buffer.is_floating_point() and buffer.dtype != self.compute_dtype:
                        setattr(module, name, buffer.to(self.compute_dtype))
            if self.weights != "fp32":
                for parameter in stage.parameters():
                    parameter.data = parameter.data.to(self.weights_dtype)
        tensors = [*stage.parameters(), *stage.buffers()]
        if all(t.device == self.device for t in tensors):
            return stage  # (also what lets the memory plan place a stage of fake tensors)
        return stage.to(self.device)

    def compile_stage(self, stage: nn.Module) -> nn.Module:
        """`stage` with its blocks' training path compiled when this runtime compiles (after `place_stage`)."""
        if self.compile:
            stage.compile_blocks()
        return stage

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised host tensor to decode into: pinned where a device copies from it."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.pins_host_memory)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor (from `host_buffer`) on this device, copied asynchronously."""
        if not self.is_cuda:
            return host
        return host.to(self.device, non_blocking=True)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` readable on the host: copied into pinned memory and waited for (CPU: itself)."""
        if tensor.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(tensor.device))
        done.synchronize()  # the one wait: the encoder reads these bytes next
        return host

    def keep_on_host(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """A copy of `tensor` in pinned host memory, not waited for (CPU: itself): for what a worker
        keeps but rarely reads. Reading it back through `to_device` is ordered after the copy."""
        if tensor is None or tensor.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host

    def timer(self) -> JobTimer:
        return JobTimer(self.device)


# What every process ran before [runtime] existed, and what tests and tools get by default.
CPU_FP32 = Runtime()
