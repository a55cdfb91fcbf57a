"""A stage replica driven into the steady state the memory plan describes, shared by
tests/unit/test_memory_plan.py (tensor bytes on the CPU) and tests/integration/test_cuda.py (the CUDA allocator)."""

from __future__ import annotations

from typing import Callable

import torch

from agora.node.replica.compute import StageCompute
from agora.node.replica.stash import ForwardStash
from agora.pipeline.codec import WireCodec, encode_tokens
from agora.pipeline.runtime import Runtime
from agora.protos.stage_adapter import BackwardRequest, ForwardRequest, StepRequest

CODEC = WireCodec("fp32", max_bytes=2**26)
IN_FLIGHT = 6
PINNED = 2


class Driver:
    """Feeds one stage replica microbatches the way trainers do (asynchronous mode)."""

    def __init__(self, compute: StageCompute, config):
        self.compute, self.config = compute, config
        self.rows, self.seq = config.train.microbatch_size, config.train.seq_len
        self.generator = torch.Generator().manual_seed(compute.index)
        self.batches = 0

    def _ints(self):
        return torch.randint(0, self.config.model.vocab_size, (self.rows, self.seq), generator=self.generator)

    def forward(self, microbatch_id: str) -> None:
        vocab = self.config.model.vocab_size
        wire = b"" if self.compute.stage.is_head else CODEC.encode(
            torch.randn(self.rows, self.seq, self.config.model.wire_dim, generator=self.generator))
        targets = encode_tokens(self._ints(), vocab) if self.compute.stage.is_tail else b""
        self.compute.forward(ForwardRequest(run_id="run", stage=self.compute.index, microbatch_id=microbatch_id,
                                            tokens=encode_tokens(self._ints(), vocab), wire=wire, targets=targets))

    def backward(self, microbatch_id: str) -> None:
        if self.compute.stage.is_tail:
            return  # its backward ran inside the forward
        grad = torch.randn(self.rows, self.seq, self.config.model.wire_dim, generator=self.generator)
        self.compute.backward(BackwardRequest(run_id="run", stage=self.compute.index, microbatch_id=microbatch_id,
                                              output_grad=CODEC.encode(grad)))

    def report(self) -> None:
        self.compute.step(StepRequest(run_id="run", stage=self.compute.index, microbatches=1,
                                      completed_batch=self.batches, replicas=1))
        self.batches += 1


def steady_state(config, index: int, runtime: Runtime, applied: int,
                 before_last_job: Callable[[], None]) -> StageCompute:
    """Build a real worker of stage `index` and drive it into the state the plan describes: PINNED
    weight versions kept for pending forwards, IN_FLIGHT forwards stashed, `applied` microbatches
    accumulated, Adam state built; `before_last_job` runs just before its worst job (a backward
    on the oldest pinned version; the tail's fused forward and backward). Returns the worker: what
    it holds is measured while the caller keeps it."""
    compute = StageCompute(config, index, run_id="run", codec=CODEC, stash=ForwardStash(IN_FLIGHT, 600.0),
                           synchronous=False, pinned_versions=PINNED, runtime=runtime)
    drive = Driver(compute, config)
    tail = compute.stage.is_tail
    for version in range(PINNED):  # a step while a forward is pending keeps its weights
        if not tail:
            drive.forward(f"pending{version}")
        drive.forward(f"done{version}")
        drive.backward(f"done{version}")
        drive.report()
    assert compute.pinned_weight_copies == (0 if tail else PINNED)
    for i in range(applied - 1):
        drive.forward(f"applied{i}")
        drive.backward(f"applied{i}")
    while not tail and len(compute.stash) < IN_FLIGHT:
        drive.forward(f"stashed{len(compute.stash)}")
    before_last_job()
    if tail:
        drive.forward("last")
    else:
        drive.backward("pending0")  # recomputed on the oldest pinned version
    assert compute.accumulated_microbatches == applied
    return compute
