"""The centralized reference trainer behind `agora-node train-local`.

It runs the model stage by stage through the same stage modules, wire codec and per-stage
optimizer as the swarm: every boundary tensor is encoded and decoded (forward coordinates and
backward gradients), each stage clips and steps on its own, and step s reads data unit s. The
swarm's synchronous mode is therefore the same computation, and its loss trace must match this
one line by line (`--log-json` writes the shared schema: step, loss, tokens, lr, ...).

Unlike a worker, it keeps the autograd graph of each stage between forward and backward instead
of recomputing: identical values, less compute, so it is the fair baseline for throughput.

It computes where `config.runtime` says (pipeline/runtime.py): every stage on that device, under
bf16 autocast with `dtype = "bf16"`; boundary tensors go through the codec on the host, as on a
worker, so the swarm on the same device and dtype sees the same values.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

import torch

from agora.pipeline.checkpoint import StageState, latest_checkpoint, load_checkpoint, restore_rng, save_checkpoint
from agora.pipeline.codec import WireCodec
from agora.pipeline.config import ConfigError, RunConfig
from agora.pipeline.model import basis_checksum
from agora.pipeline.optim import StageOptimizer
from agora.pipeline.runtime import CPU_FP32, Runtime
from agora.pipeline.stages import Stage, build_stage

__all__ = ["CentralizedTrainer", "StepRecord", "evaluate_stages"]

logger = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """One line of the shared JSON-lines schema (train-local and the swarm write the same)."""

    step: int
    loss: float
    tokens: int
    lr: float
    grad_norm: list[float]
    elapsed_s: float
    tokens_per_s: float
    eval_loss: float | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        values = {"step": self.step, "loss": self.loss, "tokens": self.tokens, "lr": self.lr,
                  "grad_norm": self.grad_norm, "elapsed_s": round(self.elapsed_s, 4),
                  "tokens_per_s": round(self.tokens_per_s, 2)}
        if self.eval_loss is not None:
            values["eval_loss"] = self.eval_loss
        values.update(self.extra)
        return json.dumps(values)


def _roundtrip(codec: WireCodec, tensor: torch.Tensor, runtime: Runtime = CPU_FP32) -> torch.Tensor:
    """What the next stage receives: the tensor after the wire (and back on the device)."""
    frame = codec.encode(runtime.to_host(tensor.detach()))
    return runtime.to_device(codec.decode(frame, out=runtime.host_buffer))


@torch.no_grad()
def evaluate_stages(stages: list[Stage], codec: WireCodec, batches: list[torch.Tensor],
                    runtime: Runtime = CPU_FP32) -> float:
    """Mean held-out loss through the same boundary path as training."""
    losses = []
    for batch in batches:
        batch = batch.to(runtime.device)
        tokens, targets = batch[:, :-1], batch[:, 1:]
        wire = None
        for stage in stages[:-1]:
            with runtime.autocast():
                output = stage(tokens, wire)
            wire = _roundtrip(codec, output, runtime)
        with runtime.autocast():
            losses.append(float(stages[-1](tokens, wire, targets)))
    return sum(losses) / max(1, len(losses))


class CentralizedTrainer:
    def __init__(self, config: RunConfig, data, *, wire_dtype: str = "fp32",
                 checkpoint_dir: str | Path | None = None, log_json: IO[str] | None = None,
                 progress: Callable[[StepRecord, int], None] | None = None):
        self.config = config
        self.data = data
        self.codec = WireCodec(dtype=wire_dtype)
        self.runtime = Runtime.from_config(config.runtime)
        split = config.layer_split
        self.stages = [build_stage(config.model, i) for i in range(len(split))]
        basis = self.stages[0].basis  # digested as generated, before it takes the compute dtype
        self.basis_checksum = basis_checksum(basis.U, basis.T) if basis is not None else "dense"
        self.stages = [self.runtime.compile_stage(self.runtime.place_stage(stage)) for stage in self.stages]
        self.optimizers = [StageOptimizer(s, config.optim, s.index, len(split)) for s in self.stages]
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.log_json = log_json
        self.progress = progress
        self.step = 0
        self.tokens = 0
        self.elapsed_s = 0.0

    # --- one global batch -------------------------------------------------------------------
    def _microbatch(self, batch: torch.Tensor) -> float:
        # Token ids cross the wire losslessly, so they need no round trip through the codec.
        runtime = self.runtime
        batch = batch.to(runtime.device)
        tokens, targets = batch[:, :-1], batch[:, 1:]
        inputs: list[torch.Tensor | None] = []
        outputs: list[torch.Tensor] = []
        wire = None
        for stage in self.stages[:-1]:
            if wire is not None:
                wire.requires_grad_(True)
            inputs.append(wire)
            with runtime.autocast():
                out = stage(tokens, wire)
            outputs.append(out)
            wire = _roundtrip(self.codec, out, runtime)
        if wire is not None:
            wire.requires_grad_(True)
        with runtime.autocast():
            loss = self.stages[-1](tokens, wire, targets)
        loss.backward()
        grad = None if wire is None else _roundtrip(self.codec, wire.grad, runtime)
        for i in reversed(range(len(self.stages) - 1)):
            outputs[i].backward(grad)
            if inputs[i] is not None:
                grad = _roundtrip(self.codec, inputs[i].grad, runtime)
        return float(loss.detach())

    def train_step(self) -> StepRecord:
        started = time.perf_counter()
        unit = self.data.train.unit(self.step)
        n_micro = self.config.train.microbatches
        losses = [self._microbatch(mb) for mb in unit.chunk(n_micro)]
        results = [opt.step(n_micro) for opt in self.optimizers]
        self.elapsed_s += time.perf_counter() - started
        step_tokens = unit.shape[0] * (unit.shape[1] - 1)
        self.tokens += step_tokens
        self.step += 1
        record = StepRecord(
            step=self.step, loss=sum(losses) / len(losses), tokens=self.tokens, lr=results[0]["lr"],
            grad_norm=[round(r["grad_norm"], 6) for r in results], elapsed_s=self.elapsed_s,
            tokens_per_s=self.tokens / max(self.elapsed_s, 1e-9),
        )
        train = self.config.train
        if train.eval_every and self.step % train.eval_every == 0:
            record.eval_loss = self.evaluate()
        return record

    def evaluate(self) -> float:
        train = self.config.train
        return evaluate_stages(self.stages, self.codec, self.data.heldout_batches(train.eval_batches,
                                                                                    train.batch_size), self.runtime)

    # --- run, checkpoint, resume -------------------------------------------------------------
    def run(self, steps: int) -> list[StepRecord]:
        """Train until `steps` optimizer steps in total (resumed steps count)."""
        records = []
        while self.step < steps:
            record = self.train_step()
            records.append(record)
            if self.log_json is not None:
                self.log_json.write(record.to_json() + "\n")
                self.log_json.flush()
            if self.progress is not None:
                self.progress(record, steps)
            every = self.config.train.checkpoint_every
            if self.checkpoint_dir and (self.step % every == 0 or self.step == steps):
                self.save()
        return records

    def save(self) -> Path:
        states = [StageState(s.index, s.state_dict(), o.state_dict()) for s, o in zip(self.stages, self.optimizers)]
        extra = {"tokens": self.tokens, "elapsed_s": self.elapsed_s, "basis_checksum": self.basis_checksum}
        return save_checkpoint(self.checkpoint_dir, self.step, self.config, states, extra)

    def resume(self) -> bool:
        """Continue from the newest checkpoint in checkpoint_dir; False when there is none."""
        if not self.checkpoint_dir or latest_checkpoint(self.checkpoint_dir) is None:
            return False
        step, config, states, extra = load_checkpoint(self.checkpoint_dir)
        if config.model != self.config.model or len(states) != len(self.stages):
            raise ConfigError(f"--resume: checkpoint in {self.checkpoint_dir} was made with another model "
                              "config or stage split")
        if extra.get("basis_checksum") != self.basis_checksum:
            raise ConfigError("--resume: checkpoint basis checksum differs from this run's basis")
        for stage, optimizer, state in zip(self.stages, self.optimizers, states):
            stage.load_state_dict(state.model)
            optimizer.load_state_dict(state.optimizer)
        restore_rng(states[0].rng)
        self.step, self.tokens, self.elapsed_s = step, int(extra["tokens"]), float(extra["elapsed_s"])
        return True
