"""Exact interop with transformers: logits match in both directions, refusals name the field."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close
import dataclasses
import json

from transformers import (AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig,
                          LlamaForCausalLM, Qwen3ForCausalLM)

from agora.pipeline.config import PRESETS, ModelConfig
from agora.pipeline.interop import (
    InteropError,
    dense_state,
    export_family,
    from_transformers,
    hf_config_from,
    model_config_from,
    save_pretrained,
    save_tokenizer,
    to_transformers,
)
from agora.pipeline.model import SubspaceTransformer

pytestmark = pytest.mark.timeout(60)

VOCAB = 101
TOLERANCE = dict(atol=1e-4, rtol=0)


def _llama_config(**changes) -> LlamaConfig:
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    return LlamaConfig(**{**values, **changes})


def _neox_config(**changes) -> GPTNeoXConfig:
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, layer_norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    return GPTNeoXConfig(**{**values, **changes})


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    """Perturb every parameter (norm gains and biases included) so no mapping hides behind 1s and 0s."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


def _hf(family, config, attn_implementation: str = "eager", seed: int = 0):
    torch.manual_seed(seed)
    return _randomize(family._from_config(config, attn_implementation=attn_implementation), seed)


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))


def _hf_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(tokens).logits


def _our_logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


# --- transformers -> ours -------------------------------------------------------------------------


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_llama_gqa_import_matches(tokens, attn_implementation):
    hf_model = _hf(LlamaForCausalLM, _llama_config(), attn_implementation)
    model = from_transformers(hf_model)
    assert model.config.arch == "llama" and model.config.n_kv_heads == 2 and not model.config.subspace
    assert model.config.rope_theta == 500.0 and model.config.norm_eps == 1e-5
    assert_close(_our_logits(model, tokens), _hf_logits(hf_model, tokens), **TOLERANCE)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("parallel_residual", [True, False])
def test_neox_import_matches(tokens, parallel_residual, attn_implementation):
    hf_model = _hf(GPTNeoXForCausalLM, _neox_config(use_parallel_residual=parallel_residual), attn_implementation)
    model = from_transformers(hf_model)
    assert model.config.arch == "neox" and model.config.bias and model.config.rotary_pct == 0.25
    assert model.config.parallel_residual is parallel_residual
    assert_close(_our_logits(model, tokens), _hf_logits(hf_model, tokens), **TOLERANCE)


def test_neox_without_attention_bias_and_tied_embeddings(tokens):
    hf_model = _hf(GPTNeoXForCausalLM, _neox_config(attention_bias=False, tie_word_embeddings=True))
    model = from_transformers(hf_model)
    assert model.config.bias and model.config.tie_embeddings and model.lm_head is None
    assert not model.layers["0"].attn.q.bias.any()  # absent biases become exact zeros
    assert_close(_our_logits(model, tokens), _hf_logits(hf_model, tokens), **TOLERANCE)


def test_llama_with_biases_and_tied_embeddings(tokens):
    hf_model = _hf(LlamaForCausalLM, _llama_config(attention_bias=True, mlp_bias=True, tie_word_embeddings=True))
    model = from_transformers(hf_model)
    assert model.config.bias and model.config.tie_embeddings
    assert_close(_our_logits(model, tokens), _hf_logits(hf_model, tokens), **TOLERANCE)


def test_neox_fused_qkv_is_split_per_head():
    hf_model = _hf(GPTNeoXForCausalLM, _neox_config())
    fused = hf_model.gpt_neox.layers[0].attention.query_key_value.weight
    ours = from_transformers(hf_model).layers["0"].attn
    head_dim = 16
    # Rows of head h are [q_h, k_h, v_h], each head_dim long.
    assert torch.equal(ours.k.weight[head_dim:2 * head_dim], fused[4 * head_dim:5 * head_dim])
    assert torch.equal(ours.v.weight[:head_dim], fused[2 * head_dim:3 * head_dim])


# --- ours -> transformers -------------------------------------------------------------------------

OUR_CONFIGS = {
    "llama-subspace": ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                                  max_seq_len=64, rank=8, rope_theta=500.0),
    "llama-subspace-bias-tied": ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                            d_ff=96, max_seq_len=64, rank=8, bias=True, tie_embeddings=True),
    "llama-dense": ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                               max_seq_len=64, rank=None),
    "neox-subspace": ModelConfig(arch="neox", vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                                 d_ff=256, max_seq_len=64, rank=8, rotary_pct=0.25, bias=True),
    "neox-dense-sequential-nobias-tied": ModelConfig(
        arch="neox", vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=256, max_seq_len=64,
        rank=None, rotary_pct=0.25, bias=False, parallel_residual=False, tie_embeddings=True),
}


def _ours(name: str) -> SubspaceTransformer:
    return _randomize(SubspaceTransformer(OUR_CONFIGS[name]), seed=7)


@pytest.mark.parametrize("name", list(OUR_CONFIGS))
def test_export_matches(tokens, name):
    model = _ours(name)
    expected = _our_logits(model, tokens)
    for attn_implementation in ("eager", "sdpa"):
        hf_model = to_transformers(model, attn_implementation=attn_implementation)
        assert_close(_hf_logits(hf_model, tokens), expected, **TOLERANCE)
    if model.config.tie_embeddings:
        assert hf_model.get_output_embeddings().weight is hf_model.get_input_embeddings().weight


@pytest.mark.parametrize("name", ["llama-subspace", "neox-subspace", "neox-dense-sequential-nobias-tied"])
def test_save_pretrained_loads_with_auto_class(tmp_path, tokens, name):
    model = _ours(name)
    save_pretrained(model, tmp_path)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is (LlamaForCausalLM if model.config.arch == "llama" else GPTNeoXForCausalLM)
    assert_close(_hf_logits(loaded, tokens), _our_logits(model, tokens), **TOLERANCE)


def test_subspace_export_is_the_dense_equivalent(tokens):
    model = _ours("llama-subspace")
    dense = from_transformers(to_transformers(model))
    assert not dense.config.subspace
    state = dense_state(model)
    for name, tensor in dense.state_dict().items():
        assert_close(tensor, state[name], atol=0, rtol=0)
    assert_close(_our_logits(dense, tokens), _our_logits(model, tokens), **TOLERANCE)


@pytest.mark.parametrize("family,config", [
    (LlamaForCausalLM, _llama_config()),
    (GPTNeoXForCausalLM, _neox_config(use_parallel_residual=False)),
])
def test_round_trip_transformers_ours_transformers(tokens, family, config):
    hf_model = _hf(family, config)
    back = to_transformers(from_transformers(hf_model), attn_implementation="eager")
    assert type(back) is family
    original, returned = hf_model.state_dict(), back.state_dict()
    assert original.keys() == returned.keys()
    for name in original:
        assert torch.equal(original[name], returned[name]), name
    assert_close(_hf_logits(back, tokens), _hf_logits(hf_model, tokens), **TOLERANCE)


def test_hf_config_round_trip():
    for config in OUR_CONFIGS.values():
        dense = ModelConfig(**{**config.__dict__, "rank": None})
        again = model_config_from(hf_config_from(config))
        ignore = {"rank", "basis_seed", "fixed_embedding_std", "layer_split"}
        if config.arch == "neox":
            ignore.add("bias")  # HF's NeoX MLP always has biases
        for field in dense.__dataclass_fields__:
            if field not in ignore:
                assert getattr(again, field) == getattr(dense, field), field


# --- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("hf_config,field", [
    (_llama_config(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}), "rope_type"),
    (_llama_config(head_dim=32), "head_dim"),
    (_llama_config(hidden_act="gelu"), "hidden_act"),
    (_neox_config(hidden_act="gelu_new"), "hidden_act"),
    (_neox_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0,
                                   "partial_rotary_factor": 0.25}), "rope_type"),
    (_neox_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.0625}), "rotary_pct"),
])
def test_import_refuses_what_we_cannot_represent(hf_config, field):
    with pytest.raises(InteropError, match=field):
        model_config_from(hf_config)


def test_import_refuses_sliding_window_and_other_models():
    config = _llama_config()
    config.sliding_window = 8
    with pytest.raises(InteropError, match="sliding_window"):
        model_config_from(config)
    with pytest.raises(InteropError, match="model"):
        from_transformers(nn.Linear(2, 2))
    with pytest.raises(InteropError, match="rope_type"):
        from_transformers(LlamaForCausalLM(_llama_config(
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})))


@pytest.mark.parametrize("changes,field", [
    (dict(sublayer_norm=True), "sublayer_norm"),  # without qk_norm: no architecture has it
    (dict(qk_norm=True, sublayer_norm=True, tie_embeddings=True), "tie_embeddings"),  # Gemma 3 scales its embedding
    (dict(qk_norm=True, bias=True), "bias"),  # Qwen3's MLP has no biases
    (dict(arch="neox", qk_norm=True, n_kv_heads=4, d_ff=256), "qk_norm"),
    (dict(rotary_pct=0.5), "rotary_pct"),
    (dict(arch="neox", n_kv_heads=2, d_ff=256), "n_kv_heads"),
])
def test_export_refuses_what_transformers_cannot_represent(changes, field):
    config = ModelConfig(**{**OUR_CONFIGS["llama-subspace"].__dict__, **changes})
    with pytest.raises(InteropError, match=field):
        hf_config_from(config)
    with pytest.raises(InteropError, match=field):
        to_transformers(SubspaceTransformer(config))


# --- the Agora architecture (pluralis-8b's QK-norm and weightless sublayer output norms) --------------

# pluralis-8b's architecture on a scaled-down geometry: subspace, GQA, RoPE base 500000, untied head.
PLURALIS_SHAPED = dataclasses.replace(PRESETS["pluralis-8b"].model, vocab_size=VOCAB, d_model=64, n_layers=3,
                                      n_heads=4, n_kv_heads=2, d_ff=160, max_seq_len=64, rank=8, layer_split=(1, 1, 1))
AGORA_CONFIGS = {"gemma3": PLURALIS_SHAPED,  # qk_norm and sublayer_norm
                 "qwen3": dataclasses.replace(PLURALIS_SHAPED, sublayer_norm=False)}  # qk_norm only
AGORA_FAMILIES = {"gemma3": Gemma3ForCausalLM, "qwen3": Qwen3ForCausalLM}


@pytest.mark.parametrize("family", list(AGORA_CONFIGS))
def test_the_agora_architecture_exports_exactly_to_its_closest_transformers_family(tmp_path, tokens, family):
    config = AGORA_CONFIGS[family]
    assert config.qk_norm and export_family(config) == family
    model = _randomize(SubspaceTransformer(config), seed=3)  # norm gains away from 1: the w - 1 mapping shows
    expected = _our_logits(model, tokens)
    for attn_implementation in ("eager", "sdpa"):
        hf_model = to_transformers(model, attn_implementation=attn_implementation)
        assert type(hf_model) is AGORA_FAMILIES[family]
        assert_close(_hf_logits(hf_model, tokens), expected, **TOLERANCE)
    save_pretrained(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is AGORA_FAMILIES[family]
    assert_close(_hf_logits(loaded, tokens), expected, **TOLERANCE)


def test_every_preset_has_an_export_family():
    families = {name: export_family(preset.model) for name, preset in PRESETS.items()}
    assert families == {"tiny": "llama", "small": "llama", "pythia-14m": "neox", "pluralis-8b": "gemma3"}
    hf = hf_config_from(PRESETS["pluralis-8b"].model)  # the real geometry's config, without its 8.6B weights
    assert (hf.model_type, hf.hidden_size, hf.num_hidden_layers, hf.head_dim, hf.num_key_value_heads) == \
        ("gemma3_text", 5120, 32, 128, 8)
    assert hf.layer_types == ["full_attention"] * 32 and hf.hidden_activation == "silu"
    assert hf.rope_parameters["full_attention"]["rope_theta"] == 500000.0


def test_export_hf_of_a_pluralis_shaped_checkpoint_from_the_command_line(tmp_path, tokens):
    from agora.node.cli import main
    from agora.pipeline.checkpoint import load_checkpoint
    from agora.pipeline.stages import assemble_model

    toml = tmp_path / "pluralis-shaped.toml"
    toml.write_text('preset = "pluralis-8b"\n[model]\nvocab_size = 256\nd_model = 64\nn_layers = 3\nn_heads = 4\n'
                    'n_kv_heads = 2\nd_ff = 160\nmax_seq_len = 64\nrank = 8\nlayer_split = [1, 1, 1]\n'
                    '[train]\nbatch_size = 2\nmicrobatches = 1\nseq_len = 32\n')
    checkpoint = tmp_path / "ckpt"
    assert main(["train-local", "--config", str(toml), "--steps", "2", "--checkpoint-dir", str(checkpoint)]) == 0
    assert main(["export-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "gemma3_text"
    _, config, states, _ = load_checkpoint(checkpoint)
    ours = assemble_model(config.model, [s.model for s in states]).eval()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    inputs = tokens % 256
    assert_close(_hf_logits(loaded, inputs), _our_logits(ours, inputs), **TOLERANCE)


def test_the_byte_tokenizer_exports_as_one_transformers_reads_with_our_ids(tmp_path):
    from agora.pipeline.tokenizer import ByteTokenizer

    text = "héllo  wörld\n\tx = 1\x00 ✓"
    loaded = AutoTokenizer.from_pretrained(save_tokenizer("bytes", tmp_path))
    assert loaded(text, add_special_tokens=False)["input_ids"] == ByteTokenizer().encode(text).tolist()
    assert loaded.eos_token_id == ByteTokenizer.eos_id and loaded.decode(list(text.encode())) == text


def test_a_tokenizer_file_that_is_not_here_is_one_line_naming_the_setting(tmp_path):
    from agora.pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="data.tokenizer"):
        save_tokenizer(str(tmp_path / "missing.json"), tmp_path / "out")
