"""The run config: one typed schema for model geometry, optimization, data, the schedule, the
averaging and where a process computes.

Every setting is declared once, here, with its type, default, bounds and help text (pydantic
validates it). From that one declaration come TOML loading, errors that name the field and the
offending value in one line (`ConfigError`), the command line's run flags
(node/run_flags.py: `--section.field`, plus a short name where the schema gives one), the argv a
demo hands its children, `agora-node config show`, and which settings the run fingerprint covers
(all but the machine-local ones). A preset name (`tiny`, `small`, `pythia-14m`, `pluralis-8b`)
is itself a valid config; code never reads raw dicts.

A config that exists is valid: construction and `dataclasses.replace` validate. Code that builds
one from a user's values goes through `config_from_dict` or `config_with`, which turn pydantic's
report into a `ConfigError` naming the first bad field.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter, ValidationError, \
    field_validator, model_validator
from pydantic.dataclasses import dataclass

from agora.pipeline.schema import (SECTION, ConfigError, Fraction, NoneOr, Positive, Setting, checked, explain, get,
                                   leaves, nested, setting)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from agora.pipeline.checkpoint_meta import CheckpointError, read_meta

__all__ = [
    "MAX_MATCHMAKING_S",
    "ConfigError",
    "ModelConfig",
    "OptimConfig",
    "DataConfig",
    "TrainConfig",
    "SyncConfig",
    "SYNC_METHODS",
    "RuntimeConfig",
    "COMPUTE_DTYPES",
    "EvalsConfig",
    "RunConfig",
    "PRESETS",
    "Setting",
    "load_config",
    "load_config_sources",
    "config_from_dict",
    "config_to_dict",
    "config_with",
    "config_to_toml",
    "checked",
    "explain",
    "flatten",
    "run_settings",
    "split_layers",
]


@dataclass(frozen=True, config=SECTION)
class ModelConfig:
    arch: Literal["llama", "neox"] = setting(
        "llama", "llama (RMSNorm, SwiGLU, GQA) or neox (Pythia: LayerNorm, GeLU, parallel residual)")
    vocab_size: StrictInt = setting(256, "tokens in the vocabulary", gt=0)
    d_model: StrictInt = setting(128, "width of the residual stream", gt=0)
    n_layers: StrictInt = setting(6, "transformer blocks, over all stages", gt=0)
    n_heads: StrictInt = setting(4, "attention heads (divides d_model)", gt=0)
    n_kv_heads: StrictInt = setting(2, "key/value heads, grouped-query attention (divides n_heads)", gt=0)
    d_ff: StrictInt = setting(352, "hidden width of the feed-forward block", gt=0)
    max_seq_len: StrictInt = setting(256, "longest sequence the position encoding covers", gt=0)
    rank: Annotated[StrictInt | None, NoneOr] = setting(
        16, "subspace rank k of the stage boundaries; null (or d_model) is the dense control", gt=0)
    rope_theta: StrictFloat = setting(10000.0, "RoPE base", gt=0)
    rotary_pct: StrictFloat = setting(1.0, "share of each head's dims that get RoPE (Pythia: 0.25)", gt=0, le=1)
    norm_eps: StrictFloat = setting(1e-5, "epsilon of the norms", gt=0)
    qk_norm: StrictBool = setting(False, "RMSNorm on queries and keys")
    sublayer_norm: StrictBool = setting(False, "weightless RMSNorm on each sublayer's output before the residual add")
    tie_embeddings: StrictBool = setting(False, "tie the output projection to the embedding (dense only)")
    bias: StrictBool = setting(False, "biases in the linear layers (Pythia has them)")
    parallel_residual: StrictBool = setting(True, "neox: attention and MLP read the same input")
    init_std: StrictFloat = setting(0.02, "std of the initial weights", gt=0)
    fixed_embedding_std: StrictFloat = setting(0.02, "std of the fixed token embedding T", gt=0)
    basis_seed: StrictInt = setting(0, "seed of U and T, generated identically on every node")
    layer_split: Annotated[tuple[Positive, ...] | None, NoneOr] = setting(
        None, "blocks per stage: head, bodies..., tail (default: one stage; --stages splits evenly)")

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

    @model_validator(mode="after")
    def _agree(self) -> "ModelConfig":
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads: {self.n_heads} does not divide d_model={self.d_model}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads: {self.n_kv_heads} does not divide n_heads={self.n_heads}")
        if self.rank is not None and self.rank > self.d_model:
            raise ValueError(f"rank: must be in 1..d_model={self.d_model} or null, got {self.rank}")
        if int(self.head_dim * self.rotary_pct) % 2:
            raise ValueError(f"rotary_pct: {self.rotary_pct} of head_dim={self.head_dim} gives an odd number of "
                             "rotary dims per head; it must be even")
        if self.layer_split is not None and sum(self.layer_split) != self.n_layers:
            raise ValueError(f"layer_split: {list(self.layer_split)} must sum to n_layers={self.n_layers}")
        return self


@dataclass(frozen=True, config=SECTION)
class OptimConfig:
    lr: StrictFloat = setting(1e-3, "peak learning rate (AdamW)", gt=0)
    betas: tuple[Fraction, Fraction] = setting((0.9, 0.95), "AdamW betas, two numbers in [0, 1)")
    eps: StrictFloat = setting(1e-8, "AdamW epsilon", gt=0)
    weight_decay: StrictFloat = setting(0.1, "AdamW weight decay", ge=0)
    warmup_steps: StrictInt = setting(20, "linear warm-up, in global batches", ge=0)
    total_steps: StrictInt = setting(
        1000, "length of the schedule in global batches: the cosine reaches min_lr_ratio * lr here",
        flag="--schedule-steps", gt=0)
    min_lr_ratio: StrictFloat = setting(0.1, "floor of the cosine, as a share of lr", ge=0, le=1)
    clip_norm: StrictFloat = setting(
        1.0, "global gradient-norm budget: each of S stages clips to clip_norm / sqrt(S), the tail to "
        "tail_clip_multiplier times that", gt=0)
    tail_clip_multiplier: StrictFloat = setting(2.0, "the tail stage's share of the clip budget", gt=0)


@dataclass(frozen=True, config=SECTION)
class DataConfig:
    source: StrictStr = setting(
        "stdlib", "stdlib, a path to .txt/.jsonl/.parquet files (or a folder), or hf:<dataset>", min_length=1)
    tokenizer: StrictStr = setting("bytes", "bytes, or a path to a tokenizers JSON file", min_length=1)
    text_field: StrictStr = setting("text", "the jsonl/parquet/hf column holding the text", min_length=1)
    heldout_fraction: StrictFloat = setting(0.02, "share of sequences held out for evaluation", gt=0, lt=1)
    seed: StrictInt = setting(0, "order of the sequences")
    cache_dir: Annotated[StrictStr | None, NoneOr] = setting(None, "token cache (default ~/.cache/agora-node)", local=True)


@dataclass(frozen=True, config=SECTION)
class TrainConfig:
    batch_size: StrictInt = setting(8, "sequences per global batch (one data work unit)", flag="--batch-size", gt=0)
    microbatches: StrictInt = setting(2, "a global batch is cut into this many microbatches",
                                      flag="--microbatches", gt=0)
    seq_len: StrictInt = setting(256, "tokens per sequence", gt=0)
    eval_every: StrictInt = setting(50, "global batches between held-out evaluations (0: none during the run)", ge=0)
    eval_batches: StrictInt = setting(4, "held-out batches per evaluation", gt=0)
    checkpoint_every: StrictInt = setting(100, "optimizer steps between checkpoints (0: only when leaving)", ge=0)

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.microbatches

    @model_validator(mode="after")
    def _agree(self) -> "TrainConfig":
        if self.batch_size % self.microbatches:
            raise ValueError(f"microbatches: {self.microbatches} does not divide batch_size={self.batch_size}")
        return self


SYNC_METHODS = ("sparta", "diloco", "none")
# The longest an averaging round may look for its group: its announcement in the DHT lives that long,
# and peers refuse announcements meant to live much longer (dht/key_families.py).
MAX_MATCHMAKING_S = 600.0
# How a reducer combines its group's contributions (the averager's rules: dht/robust.py).
AGGREGATIONS = ("centered_clip", "mean")


@dataclass(frozen=True, config=SECTION)
class SyncConfig:
    """How the replicas of a stage stay together (docs/design.md, AsyncSPARTA); defaults are the report's."""

    method: Literal["sparta", "diloco", "none"] = setting(
        "sparta", "sparta (a rotating sparse slice), diloco (streaming fragments) or none", flag="--averaging")
    every_steps: StrictInt = setting(20, "local optimizer steps between two averaging rounds",
                                     flag="--averaging-every", gt=0)
    fraction: StrictFloat = setting(
        0.05, "sparta: share of every tensor averaged per round (ceil(1/fraction) slices)",
        flag="--averaging-fraction", gt=0, le=1)
    fragments: StrictInt = setting(4, "diloco: fragments published in turn, one per round", gt=0)
    average_optimizer_state: StrictBool = setting(
        False, "sparta: also average the Adam moments of the slice", flag="--average-optimizer-state")
    matchmaking_s: StrictFloat = setting(40.0, "how long a round looks for its group", gt=0, le=MAX_MATCHMAKING_S)
    request_s: StrictFloat = setting(3.0, "one matchmaking request to a would-be leader", gt=0)
    sender_s: StrictFloat = setting(30.0, "a sender silent this long is dropped from the round", gt=0)
    reducer_s: StrictFloat = setting(60.0, "a reducer silent this long: its part keeps local values", gt=0)
    round_s: StrictFloat = setting(150.0, "the all-reduce once the group is formed", gt=0)
    part_size_bytes: StrictInt = setting(2 * 2**20, "all-reduce parts streamed to reducers", ge=1024)
    outer_lr: StrictFloat = setting(0.7, "diloco: outer Nesterov learning rate", gt=0)
    outer_momentum: StrictFloat = setting(0.9, "diloco: outer Nesterov momentum", ge=0, lt=1)
    quorum: StrictInt = setting(1, "participants (self included) a round needs to be applied", ge=1)
    aggregation: Literal["centered_clip", "mean"] = setting(
        "centered_clip", "centered_clip (agreed weight caps, outliers rejected, CenteredClip for 3+, bounded moves) "
        "or mean (hivemind's plain weighted mean, for trusted machines only)", flag="--aggregation")
    optimizer_sync_steps: StrictInt = setting(
        100, "a replica joining mid-run trains this many optimizer steps with weight 0 in averaging after its "
        "weight sync, to warm its Adam moments, before it is a member", flag="--optimizer-sync-steps", local=True,
        ge=0)

    @property
    def n_slices(self) -> int:
        """Slices (sparta) or fragments (diloco) in one rotation."""
        if self.method == "diloco":
            return self.fragments
        # round() first so that 1/0.05 = 20.000000000000004 is not taken for 21 slices
        return math.ceil(round(1.0 / self.fraction, 9))

    @model_validator(mode="after")
    def _agree(self) -> "SyncConfig":
        if self.request_s >= self.matchmaking_s:
            # hivemind's matchmaking breaks request deadlocks with request_s; it must fit in the window.
            raise ValueError(f"request_s: {self.request_s:g} must be below matchmaking_s={self.matchmaking_s:g}")
        if self.reducer_s <= self.sender_s:
            # Otherwise a reducer still waiting for a slow sender is itself dropped as silent.
            raise ValueError(f"reducer_s: {self.reducer_s:g} must exceed sender_s={self.sender_s:g}")
        if self.average_optimizer_state and self.method == "diloco":
            raise ValueError("average_optimizer_state: only for method 'sparta' (diloco keeps its own outer state)")
        return self


# Compute precision (pipeline/runtime.py): fp32 throughout, or bf16 autocast over fp32 master weights.
COMPUTE_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True, config=SECTION)
class RuntimeConfig:
    """Where and in what precision this process computes. Machine-local, like data.cache_dir: left
    out of the run fingerprint, so a CPU worker and a GPU worker can serve the same run; a process's
    own --device/--dtype override what a config (or the authorizer) says."""

    device: StrictStr = setting("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N",
                                flag="--device", local=True)
    dtype: Literal["fp32", "bf16"] = setting(
        "fp32", "compute precision: fp32, or bf16 (bf16 autocast over fp32 master weights and optimizer state)",
        flag="--dtype", local=True)
    weights: Literal["fp32", "bf16"] = setting(
        "fp32", "with dtype bf16: fp32 master weights, or bf16 weights with fp32 optimizer state (half the weight "
        "memory; updates below bf16's resolution are lost)", local=True)
    compile: StrictBool = setting(
        False, "compile each block's training forward and backward with torch.compile (fused kernels on a GPU; "
        "the first microbatch of each shape waits for the compiler; inference stays eager)", flag="--compile",
        local=True)

    @field_validator("device")
    @classmethod
    def _a_device(cls, device: str) -> str:
        kind, _, index = device.partition(":")
        if not (device in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit())):
            raise ValueError("expected auto, cpu, cuda or cuda:N")
        return device

    @model_validator(mode="after")
    def _agree(self) -> "RuntimeConfig":
        if self.weights == "bf16" and self.dtype != "bf16":
            raise ValueError("weights: bf16 weights need runtime.dtype = bf16 (fp32 compute keeps fp32 weights)")
        return self


@dataclass(frozen=True, config=SECTION)
class EvalsConfig:
    """Evaluations a trainer runs against the live swarm while it trains (node/trainer/evals.py),
    through the workers' inference path (scored Prefills), never stopping training. Machine-local: they
    read the model, they do not change it, so trainers with and without them serve one run."""

    every: StrictInt = setting(
        0, "global batches (of this trainer) between two evaluations against the live swarm (0: none)", ge=0,
        local=True)
    heldout_batches: StrictInt = setting(
        2, "held-out batches of train.batch_size sequences scored through the swarm per evaluation: held-out loss "
        "and perplexity (0: none)", ge=0, local=True)
    tasks: tuple[Annotated[StrictStr, Field(min_length=1)], ...] = setting(
        (), "lm-eval tasks run through the swarm per evaluation, by name (offline: their data must be local)",
        local=True)
    include_path: Annotated[StrictStr | None, NoneOr] = setting(
        None, "a folder of lm-eval task YAML files, besides lm-eval's own tasks", min_length=1, local=True)
    limit: StrictInt = setting(32, "examples of each lm-eval task per evaluation", gt=0, local=True)

    @model_validator(mode="after")
    def _agree(self) -> "EvalsConfig":
        if self.every and not (self.heldout_batches or self.tasks):
            raise ValueError("every: evaluations every {} global batches need heldout_batches > 0 or a task"
                             .format(self.every))
        if self.include_path is not None and not self.tasks:
            raise ValueError("include_path: given without tasks to run from it")
        return self


@dataclass(frozen=True, config=SECTION)
class RunConfig:
    name: StrictStr = setting("tiny", "the run's name (a preset's, or the file's)", min_length=1)
    seed: StrictInt = setting(0, "run seed")
    model: ModelConfig = setting(default_factory=ModelConfig)
    optim: OptimConfig = setting(default_factory=OptimConfig)
    data: DataConfig = setting(default_factory=DataConfig)
    train: TrainConfig = setting(default_factory=TrainConfig)
    sync: SyncConfig = setting(default_factory=SyncConfig)
    runtime: RuntimeConfig = setting(default_factory=RuntimeConfig)
    evals: EvalsConfig = setting(default_factory=EvalsConfig)

    @model_validator(mode="after")
    def _agree(self) -> "RunConfig":
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(f"train.seq_len: {self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
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




# ----------------------------------------------------------------------------- the schema as data


def run_settings() -> tuple[Setting, ...]:
    """Every leaf of the run config, in declaration order."""
    return leaves(RunConfig)


def flatten(config: RunConfig) -> dict[str, Any]:
    """Every leaf's value by its dotted path."""
    return {item.path: get(config, item.path) for item in run_settings()}


# ----------------------------------------------------------------------------- building configs


_RUN = TypeAdapter(RunConfig)


def config_to_dict(config: RunConfig, *, local: bool = True) -> dict:
    """Plain, JSON-friendly values (tuples as lists); `local=False` leaves out the machine-local
    settings (what the run fingerprint digests)."""
    return nested({item.path: get(config, item.path) for item in run_settings() if local or not item.local})


def _merged(base: dict, values: Mapping) -> dict:
    out = dict(base)
    for key, value in values.items():
        out[key] = _merged(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, Mapping) else value
    return out


def _validated(values: dict) -> RunConfig:
    try:
        return _RUN.validate_python(values)
    except ValidationError as error:
        raise explain(error, RunConfig) from None


def config_from_dict(values: Mapping, base: RunConfig | None = None) -> RunConfig:
    """Fill a RunConfig from plain values over `base` (default: the schema's defaults); a
    `preset` key picks the base."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"config: expected a table, got {values!r}")
    values = dict(values)
    preset = values.pop("preset", None)
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"preset: unknown preset {preset!r} (known: {', '.join(PRESETS)})")
        base = PRESETS[preset]
    return _validated(_merged(config_to_dict(base or RunConfig()), values))


def config_with(config: RunConfig, settings: Mapping[str, Any]) -> RunConfig:
    """`config` with dotted settings applied ({"sync.every_steps": 8}), validated as one whole."""
    return config_from_dict(nested(dict(settings)), base=config)


def load_config(spec: str | Path) -> RunConfig:
    """A preset name, a TOML file path, or a checkpoint folder (the config its run was trained with)."""
    return load_config_sources(spec)[0]


def load_config_sources(spec: str | Path) -> tuple[RunConfig, dict[str, str]]:
    """`load_config`, and where each setting's value comes from: "default", "preset NAME",
    "file PATH" or "checkpoint PATH"."""
    spec = str(spec)
    if spec in PRESETS:
        return PRESETS[spec], _sources(PRESETS[spec], f"preset {spec}")
    path = Path(spec)
    if not path.exists():
        raise ConfigError(f"config: {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing file")
    if path.is_dir():
        try:
            config = config_from_dict(read_meta(path)["config"])
        except CheckpointError as error:
            raise ConfigError(f"config: {error}") from None
        # The device is the training machine's, not this one's (a GPU run's checkpoint is served on
        # a CPU too); the precision recipe (dtype, weights) travels with the weights.
        config = replace(config, runtime=replace(config.runtime, device="auto"))
        return config, {key: f"checkpoint {path}" for key in flatten(config)} | {"runtime.device": "default"}
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config: {path}: invalid TOML: {error}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"config: cannot read {path}: {error}") from None
    config = config_from_dict(values)
    preset = values.get("preset")
    sources = _sources(config, f"preset {preset}" if preset in PRESETS else "default")
    for key, value in values.items():
        if isinstance(value, dict):
            sources.update({f"{key}.{leaf}": f"file {path}" for leaf in value})
        elif key != "preset":
            sources[key] = f"file {path}"
    return config, sources


def _sources(config: RunConfig, preset: str) -> dict[str, str]:
    defaults = flatten(RunConfig())
    return {key: preset if value != defaults[key] else "default" for key, value in flatten(config).items()}


def config_to_toml(config: RunConfig, sources: Mapping[str, str] | None = None) -> str:
    """The config as a TOML file that loads back to it (`load_config`), each line commented with
    where its value came from when `sources` says, and the machine-local settings marked."""
    def value(v: Any) -> str:
        if v is None:
            return '"none"'
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (tuple, list)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v) if isinstance(v, str) else repr(v)

    lines: list[str] = []
    section = ""
    rows = [(item, value(get(config, item.path))) for item in run_settings()]
    width = max(len(item.path.rpartition(".")[2]) + 3 + len(text) for item, text in rows)
    for item, text in rows:
        head, _, leaf = item.path.rpartition(".")
        if head != section:
            lines += ["", f"[{head}]"]
            section = head
        notes = [sources[item.path]] if sources and item.path in sources else []
        notes += ["this machine's"] if item.local else []
        line = f"{leaf} = {text}"
        lines.append(f"{line:<{width}}  # {'; '.join(notes)}" if notes else line)
    return "\n".join(lines) + "\n"
