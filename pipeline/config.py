"""Typed run configuration: model geometry, optimization, data and the training schedule.

Config files (TOML) only fill these dataclasses; code never reads raw dicts. A preset name
(`tiny`, `small`, `pythia-14m`, `pluralis-8b`) is itself a valid config. Every error names
the offending field in one readable line (`ConfigError`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "ModelConfig",
    "OptimConfig",
    "DataConfig",
    "TrainConfig",
    "SyncConfig",
    "SYNC_METHODS",
    "RuntimeConfig",
    "COMPUTE_DTYPES",
    "RunConfig",
    "PRESETS",
    "load_config",
    "config_from_dict",
    "config_to_dict",
    "split_layers",
]


class ConfigError(ValueError):
    """A user's config is wrong; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "llama"  # "llama" (RMSNorm, SwiGLU, GQA) or "neox" (Pythia: LayerNorm, GeLU, parallel residual)
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 352
    max_seq_len: int = 256
    # Subspace rank k; None (or k == d_model) is the dense control without the reparameterization.
    rank: int | None = 16
    rope_theta: float = 10000.0
    rotary_pct: float = 1.0  # fraction of each head's dims that get RoPE (Pythia: 0.25)
    norm_eps: float = 1e-5
    qk_norm: bool = False
    # Agora's weightless RMSNorm on each sublayer output before the residual add.
    sublayer_norm: bool = False
    tie_embeddings: bool = False
    bias: bool = False  # linear biases (Pythia has them)
    parallel_residual: bool = True  # neox only
    init_std: float = 0.02
    fixed_embedding_std: float = 0.02  # std of the fixed token embedding T
    basis_seed: int = 0  # generates U and T identically on every node
    layer_split: tuple[int, ...] | None = None  # blocks per stage: head, bodies..., tail

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def subspace(self) -> bool:
        return self.rank is not None and self.rank < self.d_model

    @property
    def wire_dim(self) -> int:
        """Channels per token crossing a stage boundary."""
        return self.rank if self.subspace else self.d_model

    def validate(self) -> None:
        if self.arch not in ("llama", "neox"):
            raise ConfigError(f"model.arch: expected 'llama' or 'neox', got {self.arch!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name}: must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.n_heads: {self.n_heads} does not divide d_model={self.d_model}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_kv_heads: {self.n_kv_heads} does not divide n_heads={self.n_heads}")
        if self.rank is not None and not 0 < self.rank <= self.d_model:
            raise ConfigError(f"model.rank: must be in 1..d_model={self.d_model} or null, got {self.rank}")
        if not 0.0 < self.rotary_pct <= 1.0:
            raise ConfigError(f"model.rotary_pct: must be in (0, 1], got {self.rotary_pct}")
        if int(self.head_dim * self.rotary_pct) % 2:
            raise ConfigError("model.rotary_pct: rotary dims per head must be even")
        if self.layer_split is not None:
            if any(n <= 0 for n in self.layer_split) or sum(self.layer_split) != self.n_layers:
                raise ConfigError(
                    f"model.layer_split: {list(self.layer_split)} must be positive and sum to n_layers={self.n_layers}"
                )


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 20
    total_steps: int = 1000  # schedule length; the cosine decays to min_lr_ratio * lr here
    min_lr_ratio: float = 0.1
    # Global gradient-norm budget; each of S stages clips to clip_norm / sqrt(S), the tail to twice that.
    clip_norm: float = 1.0
    tail_clip_multiplier: float = 2.0

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr: must be positive, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas: expected two numbers in [0, 1), got {self.betas}")
        if self.warmup_steps < 0 or self.total_steps <= 0:
            raise ConfigError("optim.warmup_steps/total_steps: must be >= 0 and > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if self.clip_norm <= 0:
            raise ConfigError(f"optim.clip_norm: must be positive, got {self.clip_norm}")


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # "stdlib", a path to .txt/.jsonl/.parquet files (or a folder), or "hf:<dataset>"
    tokenizer: str = "bytes"  # "bytes" or a path to a `tokenizers` JSON file
    text_field: str = "text"  # jsonl/parquet/hf column holding the text
    heldout_fraction: float = 0.02
    seed: int = 0  # order of sequences
    cache_dir: str | None = None  # token cache; default ~/.cache/agora-node

    def validate(self) -> None:
        if not 0 < self.heldout_fraction < 1:
            raise ConfigError(f"data.heldout_fraction: must be in (0, 1), got {self.heldout_fraction}")


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 8  # sequences per global batch (= one data work unit)
    microbatches: int = 2  # a global batch is cut into this many microbatches
    seq_len: int = 256
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 100

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.microbatches

    def validate(self) -> None:
        if self.batch_size <= 0 or self.microbatches <= 0 or self.seq_len <= 0:
            raise ConfigError("train.batch_size/microbatches/seq_len: must be positive")
        if self.batch_size % self.microbatches:
            raise ConfigError(
                f"train.microbatches: {self.microbatches} does not divide batch_size={self.batch_size}"
            )


SYNC_METHODS = ("sparta", "diloco", "none")
# How a reducer combines its group's contributions (the averager's rules: dht/robust.py).
AGGREGATIONS = ("centered_clip", "mean")


@dataclass(frozen=True)
class SyncConfig:
    """How the replicas of a stage stay together (docs/design.md, AsyncSPARTA); defaults are the report's."""

    method: str = "sparta"  # "sparta" (rotating sparse slice), "diloco" (streaming fragments) or "none"
    every_steps: int = 20  # local optimizer steps between two rounds
    fraction: float = 0.05  # sparta: share of every tensor averaged per round -> ceil(1/fraction) slices
    fragments: int = 4  # diloco: fragments published in turn, one per round
    average_optimizer_state: bool = False  # sparta: also average Adam exp_avg/exp_avg_sq of the slice
    matchmaking_s: float = 40.0  # how long a round looks for its group
    request_s: float = 3.0  # one matchmaking request to a would-be leader
    sender_s: float = 30.0  # a sender silent this long is dropped from the round
    reducer_s: float = 60.0  # a reducer silent this long: its part keeps local values
    round_s: float = 150.0  # the all-reduce once the group is formed
    part_size_bytes: int = 2 * 2**20  # all-reduce parts streamed to reducers
    outer_lr: float = 0.7  # diloco outer Nesterov
    outer_momentum: float = 0.9
    quorum: int = 1  # participants (self included) a round needs to be applied
    # "centered_clip": agreed weight caps, outliers rejected, CenteredClip for 3+, a bounded pull
    # for pairs, averages beyond the recent bound dropped; "mean": hivemind's plain weighted mean.
    aggregation: str = "centered_clip"
    # A replica joining mid-run trains this many optimizer steps with weight 0 in averaging after its
    # weight sync, to warm its Adam moments, before it counts as a member (node/worker/phases.py).
    optimizer_sync_steps: int = 100

    @property
    def n_slices(self) -> int:
        """Slices (sparta) or fragments (diloco) in one rotation."""
        if self.method == "diloco":
            return self.fragments
        # round() first so that 1/0.05 = 20.000000000000004 is not taken for 21 slices
        return math.ceil(round(1.0 / self.fraction, 9))

    def validate(self) -> None:
        if self.method not in SYNC_METHODS:
            raise ConfigError(f"sync.method: expected one of {', '.join(SYNC_METHODS)}, got {self.method!r}")
        if self.every_steps <= 0:
            raise ConfigError(f"sync.every_steps: must be positive, got {self.every_steps}")
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"sync.fraction: must be in (0, 1], got {self.fraction}")
        if self.fragments <= 0:
            raise ConfigError(f"sync.fragments: must be positive, got {self.fragments}")
        for name in ("matchmaking_s", "request_s", "sender_s", "reducer_s", "round_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"sync.{name}: must be positive, got {getattr(self, name)}")
        if self.request_s >= self.matchmaking_s:
            # hivemind's matchmaking breaks request deadlocks with request_s; it must fit in the window.
            raise ConfigError(f"sync.request_s: {self.request_s} must be below matchmaking_s={self.matchmaking_s}")
        if self.reducer_s <= self.sender_s:
            # Otherwise a reducer still waiting for a slow sender is itself dropped as silent.
            raise ConfigError(f"sync.reducer_s: {self.reducer_s} must exceed sender_s={self.sender_s}")
        if self.part_size_bytes < 1024:
            raise ConfigError(f"sync.part_size_bytes: must be at least 1024, got {self.part_size_bytes}")
        if not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            raise ConfigError("sync.outer_lr/outer_momentum: need outer_lr > 0 and 0 <= outer_momentum < 1")
        if self.quorum < 1:
            raise ConfigError(f"sync.quorum: must be at least 1, got {self.quorum}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"sync.aggregation: expected one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        if self.optimizer_sync_steps < 0:
            raise ConfigError(f"sync.optimizer_sync_steps: must be >= 0, got {self.optimizer_sync_steps}")
        if self.average_optimizer_state and self.method == "diloco":
            raise ConfigError("sync.average_optimizer_state: only for method 'sparta' (diloco keeps its own "
                              "outer state)")


# Compute precision (pipeline/runtime.py): fp32 throughout, or bf16 autocast over fp32 master weights.
COMPUTE_DTYPES = ("fp32", "bf16")
_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and in what precision this process computes. Machine-local, like data.cache_dir: left
    out of the run fingerprint, so a CPU worker and a GPU worker can serve the same run; a process's
    own --device/--dtype override what a config (or the authorizer) says."""

    device: str = "auto"  # "auto" (cuda when available, else cpu), "cpu", "cuda" or "cuda:N"
    dtype: str = "fp32"  # "fp32", or "bf16": bf16 autocast for compute, fp32 master weights and optimizer state
    # With dtype bf16: "fp32" master weights (the default), or "bf16" weights with fp32 optimizer
    # state (half the weight memory; updates below bf16's resolution are lost: bench/precision.py).
    weights: str = "fp32"

    def validate(self) -> None:
        if not isinstance(self.device, str) or not _DEVICE_PATTERN.fullmatch(self.device):
            raise ConfigError(f"runtime.device: expected auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"runtime.dtype: expected one of {', '.join(COMPUTE_DTYPES)}, got {self.dtype!r}")
        if self.weights not in COMPUTE_DTYPES:
            raise ConfigError(f"runtime.weights: expected one of {', '.join(COMPUTE_DTYPES)}, got {self.weights!r}")
        if self.weights == "bf16" and self.dtype != "bf16":
            raise ConfigError("runtime.weights: bf16 weights need runtime.dtype = bf16 (fp32 compute keeps fp32 "
                              "weights)")


@dataclass(frozen=True)
class RunConfig:
    name: str = "tiny"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def validate(self) -> "RunConfig":
        self.model.validate()
        self.optim.validate()
        self.data.validate()
        self.train.validate()
        self.sync.validate()
        self.runtime.validate()
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"train.seq_len: {self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        return self

    def with_stages(self, n_stages: int) -> "RunConfig":
        """The same run with the model's blocks split evenly over `n_stages` stages."""
        return replace(self, model=replace(self.model, layer_split=split_layers(self.model.n_layers, n_stages)))

    @property
    def layer_split(self) -> tuple[int, ...]:
        return self.model.layer_split or split_layers(self.model.n_layers, 1)


def split_layers(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """Split blocks over stages as evenly as possible, earlier stages taking the remainder."""
    if not 1 <= n_stages <= n_layers:
        raise ConfigError(f"stages: need 1..{n_layers} stages for {n_layers} blocks, got {n_stages}")
    base, extra = divmod(n_layers, n_stages)
    return tuple(base + (1 if i < extra else 0) for i in range(n_stages))


def _llama_ffn(d_model: int, multiplier: float, multiple_of: int) -> int:
    hidden = int(2 * 4 * d_model / 3 * multiplier)
    return multiple_of * math.ceil(hidden / multiple_of)


PRESETS: dict[str, RunConfig] = {
    "tiny": RunConfig(
        name="tiny",
        model=ModelConfig(d_model=128, n_layers=6, n_heads=4, n_kv_heads=2, d_ff=352, max_seq_len=256, rank=16),
        optim=OptimConfig(lr=2e-3, warmup_steps=10, total_steps=400),
        train=TrainConfig(batch_size=8, microbatches=4, seq_len=128, eval_every=50),
        # CPU tests and the demo: a few local steps per round, a rotation of 4 slices, timeouts in
        # seconds, parts small enough that a slice is split over the group's reducers; a joiner's
        # optimizer sync half a rotation (the report's is a quarter of 400 steps, but Adam's second
        # moment, beta2 0.95, needs some 20 steps to warm).
        sync=SyncConfig(every_steps=8, fraction=0.25, matchmaking_s=3.0, request_s=1.0, sender_s=3.0,
                        reducer_s=6.0, round_s=15.0, part_size_bytes=64 * 1024, optimizer_sync_steps=16),
    ),
    "small": RunConfig(
        name="small",
        model=ModelConfig(d_model=256, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=704, max_seq_len=512, rank=32),
        optim=OptimConfig(lr=1e-3, warmup_steps=20, total_steps=1000),
        train=TrainConfig(batch_size=16, microbatches=4, seq_len=256, eval_every=100),
        sync=SyncConfig(every_steps=10, fraction=0.1, matchmaking_s=5.0, request_s=1.0, sender_s=5.0,
                        reducer_s=10.0, round_s=30.0, optimizer_sync_steps=25),
    ),
    "pythia-14m": RunConfig(
        name="pythia-14m",
        model=ModelConfig(
            arch="neox", vocab_size=50304, d_model=128, n_layers=6, n_heads=4, n_kv_heads=4, d_ff=512,
            max_seq_len=2048, rank=None, rotary_pct=0.25, bias=True, parallel_residual=True,
        ),
        optim=OptimConfig(lr=1e-3, warmup_steps=100, total_steps=10000),
        train=TrainConfig(batch_size=8, microbatches=2, seq_len=512),
    ),
    "pluralis-8b": RunConfig(
        name="pluralis-8b",
        model=ModelConfig(
            d_model=5120, n_layers=32, n_heads=40, n_kv_heads=8, d_ff=_llama_ffn(5120, 1.3, 1024),
            vocab_size=128256, max_seq_len=4096, rank=int(5120 / 100), rope_theta=500000.0,
            qk_norm=True, sublayer_norm=True, layer_split=(6, 4, 4, 4, 4, 4, 6),
        ),
        optim=OptimConfig(lr=3e-4, warmup_steps=4000, total_steps=154900, min_lr_ratio=0.01,
                          clip_norm=1.0, tail_clip_multiplier=2.0),
        train=TrainConfig(batch_size=2048, microbatches=2048, seq_len=4096),
    ),
}


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = args[0]
        return tuple(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def _fill(base: Any, values: dict, where: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a table, got {values!r}")
    hints = typing.get_type_hints(type(base))
    known = {f.name for f in fields(base)}
    changes = {}
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        if key not in known:
            raise ConfigError(f"{path}: unknown field (known: {', '.join(sorted(known))})")
        current = getattr(base, key)
        if is_dataclass(current):
            changes[key] = _fill(current, value, path)
        else:
            changes[key] = _coerce(value, hints[key], path)
    return replace(base, **changes)


def config_from_dict(values: dict, base: RunConfig | None = None) -> RunConfig:
    """Fill a RunConfig from plain values; a `preset` key picks the base."""
    values = dict(values)
    preset = values.pop("preset", None)
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"preset: unknown preset {preset!r} (known: {', '.join(PRESETS)})")
        base = PRESETS[preset]
    return _fill(base or RunConfig(), values, "").validate()


def config_to_dict(config: RunConfig) -> dict:
    """Plain, JSON/TOML-friendly values (tuples as lists, no None-valued keys dropped)."""
    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v
    return {k: plain(v) if not isinstance(v, dict) else {kk: plain(vv) for kk, vv in v.items()}
            for k, v in dataclasses.asdict(config).items()}


def load_config(spec: str | Path) -> RunConfig:
    """A preset name, a TOML file path, or a checkpoint folder (the config its run was trained with)."""
    spec = str(spec)
    if spec in PRESETS:
        return PRESETS[spec].validate()
    path = Path(spec)
    if not path.exists():
        raise ConfigError(f"config: {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing file")
    if path.is_dir():
        from agora.pipeline.checkpoint import CheckpointError, read_meta  # checkpoint.py imports this module

        try:
            config = config_from_dict(read_meta(path)["config"])
        except CheckpointError as error:
            raise ConfigError(f"config: {error}") from None
        # The device is the training machine's, not this one's (a GPU run's checkpoint is served on
        # a CPU too); the precision recipe (dtype, weights) travels with the weights.
        return dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, device="auto"))
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config: {path}: invalid TOML: {error}") from None
    return config_from_dict(values)
