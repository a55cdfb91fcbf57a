"""Exact conversion between our `SubspaceTransformer` and transformers' Llama / GPT-NeoX models,
and export of the Agora architecture (QK-norm, weightless sublayer output norms) to Qwen3 / Gemma 3.

Design choices:
- Exact or refused. Every import and export either reproduces the source's logits (up to float
  rounding) or raises `InteropError` naming the one field that cannot be represented: scaled or
  per-layer RoPE, sliding windows, a head_dim other than hidden/heads, another activation, GQA or
  partial rotary where the target family has none. Nothing is approximated silently.
- The export family follows the architecture: Llama; with `qk_norm` (per-head RMSNorm on queries
  and keys, before RoPE) Qwen3, which has exactly that; with `sublayer_norm` too (the pluralis-8b
  geometry: `h = x + norm(sublayer(norm(x)))`, the output norm weightless) Gemma 3's text model,
  the transformers architecture with both a norm before and after each sublayer and per-head
  q/k norms. Gemma 3 computes its RMSNorm as `x * (1 + w)`, so every norm weight is exported as
  `w - 1` (a weightless output norm as 0), and it scales the input embedding by sqrt(hidden), so the
  embedding is exported divided by it; its activation, attention scale, layer types (all full
  attention), RoPE base and soft-capping (none) are set to ours. These two are export-only: a
  model in either family imports as what it is not (Llama), so import refuses them.
- One dense name map per family. Both directions go through our *dense* parameter names
  (`layers.3.attn.q.weight`); a subspace model is first materialised exactly through
  `TokenEmbedding.dense_weight` (E = T + Z_E U^T) and `OutputProjection.dense_weight`
  (W = U Z^T, bias = U b_z), so export never depends on how the reparameterization is stored.
  An import always yields a dense model (rank None): a pretrained model has no subspace.
- GPT-NeoX fuses q/k/v into `query_key_value`, laid out per head as [heads, 3, head_dim]
  (not [3, heads, head_dim]); it is split and re-fused accordingly.
- Biases: our config has one `bias` flag for every linear layer. It is set from the source's
  structure, not its values: Llama gets bias = attention_bias or mlp_bias; NeoX always gets
  bias (HF's NeoX MLP always has biases, whatever attention_bias says). Biases the source
  lacks are zeros, which is exact. Exporting bias=False to NeoX writes zero MLP biases.
- The imported model is float32 (our parameters are); the exported one too.
- The export carries the run's tokenizer (`save_tokenizer`), so `AutoTokenizer` and tools built
  on it (lm-eval's `hf` model) read the directory alone. The byte tokenizer becomes a byte-level
  BPE with no merges whose vocabulary maps each byte's GPT-2 character to the byte's value:
  exactly our ids (id = byte), end-of-text id 0; a tokenizers JSON file is carried as it is.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from agora.pipeline.config import ConfigError, ModelConfig, checked
from agora.pipeline.model import SubspaceTransformer

__all__ = [
    "InteropError",
    "export_family",
    "from_transformers",
    "to_transformers",
    "save_pretrained",
    "save_tokenizer",
    "hf_config_from",
    "model_config_from",
    "dense_state",
]


class InteropError(ValueError):
    """A model (or config) cannot be converted exactly; the message names the field."""


# Our module path inside a block -> the HF module path inside a decoder layer.
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.o": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}
_NEOX_LAYER = {  # q/k/v are fused into attention.query_key_value (see _fuse_qkv)
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "attn.o": "attention.dense",
    "mlp.up": "mlp.dense_h_to_4h",
    "mlp.down": "mlp.dense_4h_to_h",
}
_LLAMA_TOP = {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head", "layers": "model.layers"}
_NEOX_TOP = {"embed": "gpt_neox.embed_in", "final_norm": "gpt_neox.final_layer_norm", "lm_head": "lm_head",
             "layers": "gpt_neox.layers"}
_NEOX_QKV = "attention.query_key_value"
_QWEN3_LAYER = {**_LLAMA_LAYER, "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
_GEMMA3_LAYER = {**_QWEN3_LAYER, "mlp_norm": "pre_feedforward_layernorm"}
# Gemma 3's norms after each sublayer; ours (sublayer_norm) carry no weight: exported as w - 1 = -1 + 1 = 0.
_GEMMA3_OUTPUT_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
_FAMILIES = {"llama": (LlamaForCausalLM, _LLAMA_TOP, _LLAMA_LAYER), "neox": (GPTNeoXForCausalLM, _NEOX_TOP, _NEOX_LAYER),
             "qwen3": (Qwen3ForCausalLM, _LLAMA_TOP, _QWEN3_LAYER), "gemma3": (Gemma3ForCausalLM, _LLAMA_TOP, _GEMMA3_LAYER)}


def _tables(family: str) -> tuple[dict[str, str], dict[str, str]]:
    _, top, layer = _FAMILIES[family]
    return top, layer


def export_family(config: ModelConfig) -> str:
    """The transformers family `config` exports to ("llama", "neox", "qwen3", "gemma3"; see the module
    docstring), or InteropError naming the field none of them can represent."""
    if config.arch == "neox":
        for field in ("qk_norm", "sublayer_norm"):
            if getattr(config, field):
                raise InteropError(f"model.{field}: transformers' gpt_neox has no query/key or sublayer output norm")
        return "neox"
    if config.sublayer_norm:
        if not config.qk_norm:
            raise InteropError("model.sublayer_norm: without qk_norm no transformers architecture has it (Gemma 3, "
                               "the one with norms after each sublayer, always normalises queries and keys)")
        if config.tie_embeddings:
            raise InteropError("model.tie_embeddings: Gemma 3 scales its input embedding by sqrt(hidden_size), so "
                               "a head tied to it would be scaled too")
        family = "gemma3"
    else:
        family = "qwen3" if config.qk_norm else "llama"
    if config.bias and family != "llama":
        raise InteropError(f"model.bias: transformers' {family} has no MLP biases")
    if config.rotary_pct != 1.0:
        raise InteropError(f"model.rotary_pct: {config.rotary_pct} (transformers' {family} rotates whole heads)")
    return family


# ---------------------------------------------------------------------------------------------
# Configs


def _rope_parameters(hf_config: PretrainedConfig) -> dict:
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):
        raise InteropError("rope_parameters: per-layer-type RoPE is not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise InteropError(f"rope_parameters.rope_type (rope_scaling): {rope_type!r} is not supported "
                           "(only 'default')")
    return rope


def model_config_from(hf_config: PretrainedConfig) -> ModelConfig:
    """A dense `ModelConfig` computing exactly what `hf_config`'s model computes, or InteropError."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in ("llama", "gpt_neox"):
        raise InteropError(f"model_type: {model_type!r} is not supported (llama or gpt_neox)")
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    if hidden % heads:
        raise InteropError(f"num_attention_heads: {heads} does not divide hidden_size={hidden}")
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is not None and head_dim != hidden // heads:
        raise InteropError(f"head_dim: {head_dim} != hidden_size / num_attention_heads = {hidden // heads}")
    if getattr(hf_config, "sliding_window", None) is not None or getattr(hf_config, "use_sliding_window", False):
        raise InteropError(f"sliding_window: {getattr(hf_config, 'sliding_window', None)!r} is not supported")
    rope = _rope_parameters(hf_config)
    common = dict(
        vocab_size=hf_config.vocab_size, d_model=hidden, n_layers=hf_config.num_hidden_layers, n_heads=heads,
        d_ff=hf_config.intermediate_size, max_seq_len=hf_config.max_position_embeddings, rank=None,
        rope_theta=float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
        tie_embeddings=bool(hf_config.tie_word_embeddings), init_std=float(hf_config.initializer_range),
    )
    if model_type == "llama":
        if hf_config.hidden_act not in ("silu", "swish"):
            raise InteropError(f"hidden_act: {hf_config.hidden_act!r} is not supported for llama (silu only)")
        fields = dict(arch="llama", n_kv_heads=hf_config.num_key_value_heads, norm_eps=float(hf_config.rms_norm_eps),
                      bias=bool(hf_config.attention_bias or hf_config.mlp_bias), **common)
    else:
        if hf_config.hidden_act != "gelu":
            raise InteropError(f"hidden_act: {hf_config.hidden_act!r} is not supported for gpt_neox (exact gelu only)")
        fields = dict(arch="neox", n_kv_heads=heads, norm_eps=float(hf_config.layer_norm_eps),
                      rotary_pct=float(rope.get("partial_rotary_factor", getattr(hf_config, "rotary_pct", 1.0))),
                      parallel_residual=bool(hf_config.use_parallel_residual), bias=True, **common)
    try:
        return checked(ModelConfig, "model", **fields)
    except ConfigError as error:
        raise InteropError(str(error)) from None


def hf_config_from(config: ModelConfig) -> PretrainedConfig:
    """The transformers config of `config`'s dense equivalent, in its `export_family`."""
    family = export_family(config)
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        max_position_embeddings=config.max_seq_len, initializer_range=config.init_std,
        tie_word_embeddings=config.tie_embeddings, attention_bias=config.bias,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # the tokenizer, not the model, knows these
    )
    rope = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if family == "llama":
        return LlamaConfig(
            num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim, hidden_act="silu",
            rms_norm_eps=config.norm_eps, mlp_bias=config.bias, rope_parameters=rope, **common,
        )
    if family == "qwen3":
        return Qwen3Config(num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim, hidden_act="silu",
                           rms_norm_eps=config.norm_eps, rope_parameters=rope, use_sliding_window=False, **common)
    if family == "gemma3":
        return Gemma3TextConfig(
            num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim, hidden_activation="silu",
            rms_norm_eps=config.norm_eps, query_pre_attn_scalar=config.head_dim,
            sliding_window=config.max_seq_len,  # built by Gemma 3 whatever its layers use; none does
            layer_types=["full_attention"] * config.n_layers,
            rope_parameters={"full_attention": dict(rope), "sliding_attention": dict(rope)},
            final_logit_softcapping=None, attn_logit_softcapping=None, **common,
        )
    if config.n_kv_heads != config.n_heads:
        raise InteropError(f"model.n_kv_heads: {config.n_kv_heads} != n_heads (transformers' gpt_neox has no GQA)")
    return GPTNeoXConfig(
        hidden_act="gelu", layer_norm_eps=config.norm_eps, use_parallel_residual=config.parallel_residual,
        rope_parameters={**rope, "partial_rotary_factor": float(config.rotary_pct)},
        attention_dropout=0.0, hidden_dropout=0.0, **common,
    )


# ---------------------------------------------------------------------------------------------
# Weights


@torch.no_grad()
def dense_state(model: SubspaceTransformer) -> dict[str, torch.Tensor]:
    """Our dense-mode parameter names -> the exactly equivalent dense tensors (subspace materialised)."""
    basis = model.basis
    state = {"embed.weight": model.embed.dense_weight(basis)}
    for name, module in model.named_modules():
        if hasattr(module, "dense_weight") and name != "embed":  # OutputProjection: W = U Z^T, bias = U b_z
            weight, bias = module.dense_weight(basis)
            state[f"{name}.weight"] = weight
            if bias is not None:
                state[f"{name}.bias"] = bias
    for name, tensor in model.state_dict().items():
        state.setdefault(name, tensor)  # everything else is already dense
    return {name: tensor.detach().clone().float().contiguous() for name, tensor in state.items()}


def _split_qkv(tensor: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NeoX's fused (3d, ...) rows are ordered [heads, 3, head_dim]."""
    per_head = tensor.reshape(n_heads, 3, -1, *tensor.shape[1:])
    return tuple(per_head[:, i].reshape(-1, *tensor.shape[1:]) for i in range(3))


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int) -> torch.Tensor:
    fused = torch.stack([t.reshape(n_heads, -1, *t.shape[1:]) for t in (q, k, v)], dim=1)
    return fused.reshape(-1, *q.shape[1:])


def _to_hf_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    family = export_family(config)
    top, layer = _tables(family)
    out = {}
    for name, tensor in state.items():
        module, param = name.rsplit(".", 1)
        if module.startswith("layers."):
            _, index, inner = module.split(".", 2)
            if inner in ("attn.q", "attn.k", "attn.v") and config.arch == "neox":
                continue  # fused below
            out[f"{top['layers']}.{index}.{layer[inner]}.{param}"] = tensor
        else:
            out[f"{top[module]}.{param}"] = tensor
    if config.arch == "neox":
        for index in range(config.n_layers):
            params = ("weight", "bias") if config.bias else ("weight",)
            for param in params:
                q, k, v = (state[f"layers.{index}.attn.{p}.{param}"] for p in "qkv")
                out[f"{top['layers']}.{index}.{_NEOX_QKV}.{param}"] = _fuse_qkv(q, k, v, config.n_heads)
            if not config.bias:  # HF's NeoX MLP always has biases: zero is exact
                for inner, width in (("mlp.up", config.d_ff), ("mlp.down", config.d_model)):
                    out[f"{top['layers']}.{index}.{layer[inner]}.bias"] = torch.zeros(width)
    if family == "gemma3":
        _as_gemma3(out, config)
    if config.tie_embeddings:
        out[f"{top['lm_head']}.weight"] = out[f"{top['embed']}.weight"]
    return out


def _as_gemma3(out: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Gemma 3's conventions (module docstring): norms `x * (1 + w)`, the output norms, the embedding scale."""
    for name in list(out):
        if name.endswith(("layernorm.weight", "_norm.weight")) or name == "model.norm.weight":
            out[name] = out[name] - 1.0
    for index in range(config.n_layers):
        for norm in _GEMMA3_OUTPUT_NORMS:
            out[f"model.layers.{index}.{norm}.weight"] = torch.zeros(config.d_model)
    out["model.embed_tokens.weight"] = out["model.embed_tokens.weight"] / config.d_model ** 0.5


def _from_hf_state(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename (and split NeoX's fused q/k/v); every HF tensor must find a place."""
    top, layer = _tables(config.arch)
    remaining = dict(hf_state)
    if config.tie_embeddings:
        remaining.pop(f"{top['lm_head']}.weight", None)  # the same tensor as the embedding
    modules = {ours: theirs for ours, theirs in top.items() if ours != "layers"}
    for index in range(config.n_layers):
        modules.update({f"layers.{index}.{ours}": f"{top['layers']}.{index}.{theirs}" for ours, theirs in layer.items()})
    out = {}
    for ours, theirs in modules.items():
        for param in ("weight", "bias"):
            if f"{theirs}.{param}" in remaining:
                out[f"{ours}.{param}"] = remaining.pop(f"{theirs}.{param}")
    if config.arch == "neox":
        for index in range(config.n_layers):
            for param in ("weight", "bias"):
                fused = remaining.pop(f"{top['layers']}.{index}.{_NEOX_QKV}.{param}", None)
                if fused is not None:
                    for name, tensor in zip("qkv", _split_qkv(fused, config.n_heads)):
                        out[f"layers.{index}.attn.{name}.{param}"] = tensor
    if remaining:
        raise InteropError(f"weights: no counterpart for {sorted(remaining)}")
    return out


@torch.no_grad()
def from_transformers(hf_model: PreTrainedModel) -> SubspaceTransformer:
    """A dense `SubspaceTransformer` computing the same logits as a Llama/GPT-NeoX causal LM."""
    if not isinstance(hf_model, (LlamaForCausalLM, GPTNeoXForCausalLM)):
        raise InteropError(f"model: {type(hf_model).__name__} is not supported "
                           "(LlamaForCausalLM or GPTNeoXForCausalLM)")
    config = model_config_from(hf_model.config)
    tensors = _from_hf_state(hf_model.state_dict(), config)
    model = SubspaceTransformer(config)
    for name, tensor in model.state_dict().items():
        if name not in tensors:
            if not name.endswith(".bias"):
                raise InteropError(f"weights: {name} has no counterpart in the transformers model")
            tensors[name] = torch.zeros_like(tensor)  # one bias flag for all linears: absent means zero
    model.load_state_dict(tensors, strict=True)
    return model.eval()


@torch.no_grad()
def to_transformers(model: SubspaceTransformer, attn_implementation: str | None = None) -> PreTrainedModel:
    """A transformers model computing the same logits (subspace materialised), of its `export_family`."""
    config = model.config
    hf_config = hf_config_from(config)
    family = _FAMILIES[export_family(config)][0]
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    hf_model = family._from_config(hf_config, dtype=torch.float32, **kwargs)
    state = _to_hf_state(dense_state(model), config)
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    if unexpected or missing:
        raise InteropError(f"weights: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    if config.tie_embeddings and hf_model.get_output_embeddings().weight is not hf_model.get_input_embeddings().weight:
        hf_model.tie_weights()
    return hf_model.eval()


def save_pretrained(model: SubspaceTransformer, out_dir: str | Path) -> Path:
    """Write config.json + model.safetensors loadable by `AutoModelForCausalLM.from_pretrained`."""
    out_dir = Path(out_dir)
    to_transformers(model).save_pretrained(out_dir)
    return out_dir



def _gpt2_byte_characters() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what a ByteLevel pre-tokenizer turns bytes into)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def save_tokenizer(spec: str, out_dir: str | Path) -> Path:
    """Write the run's tokenizer (`data.tokenizer`: "bytes" or a tokenizers JSON file) beside an export,
    loadable by `AutoTokenizer.from_pretrained` with the same ids and end-of-text token; ConfigError
    (one line) when the JSON file is not here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from agora.pipeline.tokenizer import load_tokenizer

    ours = load_tokenizer(spec)
    if spec == "bytes":
        characters = _gpt2_byte_characters()
        backend = Tokenizer(models.BPE(vocab={characters[b]: b for b in range(256)}, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        eos = characters[ours.eos_id]
    else:
        backend = Tokenizer.from_file(spec)
        eos = backend.id_to_token(ours.eos_id)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos).save_pretrained(out_dir)
    return Path(out_dir)
