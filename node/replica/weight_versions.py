"""`WeightCopies`: the copies of earlier weight versions a worker keeps for pending backwards.

Which versions to keep is StageCompute's rule (node/replica/compute.py: the versions its stashed
forwards ran on, at most `capacity`); this module decides where the copies live and what they cost.

Design choices:
- Where they cost least: on a CUDA worker the copies live in page-locked host memory, so pinning
  costs no accelerator memory; a version is written with non_blocking copies (ordered on the
  compute stream before the step that overwrites the weights, so no wait is needed) and a backward
  on it stages it back onto the device for its recompute, which then holds one transient copy of
  the stage there (the memory plan's "pinned staging"; the copy cost is measured by bench/gpu.py).
  On the CPU the copies are ordinary tensors.
- No allocation per step: the buffers of a dropped version are kept (at most `capacity` sets in
  all) and the next version is copied into them, so an asynchronous worker, which pins at nearly
  every step and every averaging write, allocates its copies once and then only overwrites them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from agora.pipeline.runtime import Runtime

__all__ = ["WeightCopies"]


class WeightCopies:
    def __init__(self, runtime: Runtime, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.runtime = runtime
        self.on_host = runtime.is_cuda
        self._copies: OrderedDict[int, list[torch.Tensor]] = OrderedDict()
        self._spare: list[list[torch.Tensor]] = []

    def resize(self, capacity: int) -> None:
        """Keep at most `capacity` versions from now on (the oldest beyond it go at once)."""
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        del self._spare[max(0, capacity - len(self._copies)):]
        while len(self._copies) > capacity:
            self._release(next(iter(self._copies)))

    def __contains__(self, version: int) -> bool:
        return version in self._copies

    def __len__(self) -> int:
        return len(self._copies)

    def versions(self) -> list[int]:
        return list(self._copies)

    def _buffers(self, parameters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self._spare:
            return self._spare.pop()
        if self.on_host:
            return [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in parameters]
        return [torch.empty_like(p, memory_format=torch.contiguous_format) for p in parameters]

    def keep(self, version: int, parameters: Sequence[torch.Tensor]) -> None:
        """Copy the current `parameters` as `version`; beyond `capacity` the oldest copy goes."""
        if self.capacity == 0 or version in self._copies:
            return
        buffers = self._buffers(parameters)
        with torch.no_grad():
            for buffer, parameter in zip(buffers, parameters):
                buffer.copy_(parameter.detach(), non_blocking=self.on_host)
        self._copies[version] = buffers
        while len(self._copies) > self.capacity:
            self._release(next(iter(self._copies)))

    def drop(self, version: int) -> None:
        if version in self._copies:
            self._release(version)

    def _release(self, version: int) -> None:
        buffers = self._copies.pop(version)
        if len(self._copies) + len(self._spare) < self.capacity:
            self._spare.append(buffers)

    def weights(self, version: int) -> list[torch.Tensor]:
        """`version`'s weights on the compute device, as leaves a recompute may differentiate."""
        return [self.runtime.to_device(w).detach().requires_grad_(True) for w in self._copies[version]]

    @property
    def nbytes(self) -> int:
        """Bytes held, the spare buffers included."""
        held = list(self._copies.values()) + self._spare
        return sum(t.numel() * t.element_size() for buffers in held for t in buffers)
