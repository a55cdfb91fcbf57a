"""The model and its stage split: composition equals the whole model, forward and backward."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from agora.pipeline.config import PRESETS, ConfigError
from agora.pipeline.model import SubspaceTransformer, basis_checksum, make_basis
from agora.pipeline.stages import assemble_model, build_stage, stages_of

VARIANTS = [
    pytest.param(dict(arch="llama", rank=16), id="llama-ssn"),
    pytest.param(dict(arch="llama", rank=None), id="llama-dense"),
    pytest.param(dict(arch="neox", rank=16, n_kv_heads=4, bias=True, rotary_pct=0.25), id="neox-ssn"),
    pytest.param(dict(arch="neox", rank=None, n_kv_heads=4, bias=True, parallel_residual=False), id="neox-dense"),
    pytest.param(dict(arch="llama", rank=16, qk_norm=True, sublayer_norm=True), id="llama-ssn-agora-norms"),
]


def _config(**overrides):
    return replace(PRESETS["tiny"].model, layer_split=(2, 1, 3), **overrides)


def _batch(seed=0, batch=2, seq=24, vocab=256):
    data = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return data[:, :-1], data[:, 1:]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_stage_composition_equals_whole_model(overrides):
    config = _config(**overrides)
    model = SubspaceTransformer(config)
    tokens, targets = _batch()
    reference = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    reference.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    stages = [build_stage(config, i) for i in range(3)]
    wire = None
    inputs, outputs = [], []
    for stage in stages[:-1]:
        wire = None if wire is None else wire.detach().requires_grad_(True)
        inputs.append(wire)
        out = stage(tokens, wire)
        outputs.append(out)
        wire = out
    wire = wire.detach().requires_grad_(True)
    loss = stages[-1](tokens, wire, targets)
    torch.testing.assert_close(loss, reference, rtol=0, atol=1e-5)
    loss.backward()
    grad = wire.grad
    for i in (1, 0):
        outputs[i].backward(grad)
        grad = inputs[i].grad if inputs[i] is not None else None
    got = {}
    for stage in stages:
        got.update({name: p.grad for name, p in stage.named_parameters()})
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("overrides", VARIANTS)
def test_standalone_stage_has_the_whole_models_tensors(overrides):
    config = _config(**overrides)
    model = SubspaceTransformer(config)
    views = stages_of(model)
    for view in views:
        alone = build_stage(config, view.index)
        a, b = view.state_dict(), alone.state_dict()
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
    rebuilt = assemble_model(config, [v.state_dict() for v in views])
    tokens, _ = _batch()
    torch.testing.assert_close(rebuilt(tokens), model(tokens), rtol=0, atol=0)


def test_subspace_wire_is_lossless_and_k_wide():
    config = _config(rank=16)
    head = build_stage(config, 0)
    tokens, _ = _batch()
    hidden = head.hidden(tokens)
    coords = head.encode(hidden, tokens)
    assert coords.shape == (2, 24, 16)
    torch.testing.assert_close(head.decode(coords, tokens), hidden, rtol=0, atol=1e-6)


def test_basis_is_orthonormal_seeded_and_checksummed():
    config = _config(rank=16)
    basis = make_basis(config)
    torch.testing.assert_close(basis.T @ basis, torch.eye(16), rtol=0, atol=1e-5)
    assert torch.equal(basis, make_basis(config))
    other = make_basis(replace(config, basis_seed=1))
    assert not torch.allclose(basis, other)
    assert basis_checksum(basis, None) == basis_checksum(make_basis(config), None)
    assert basis_checksum(basis, None) != basis_checksum(other, None)


def test_rank_equal_to_width_is_the_dense_control():
    dense = SubspaceTransformer(_config(rank=128))
    assert dense.basis is None and dense.config.wire_dim == 128
    assert dense.embed.weight.shape == (256, 128)


def test_subspace_parameters_are_the_factors():
    model = SubspaceTransformer(_config(rank=16))
    assert model.embed.weight.shape == (256, 16)                 # Z_E: vocab x k
    assert model.layers["0"].attn.o.weight.shape == (16, 128)     # Z^T: k x in
    assert model.layers["0"].mlp.down.weight.shape == (16, 352)
    assert not any("basis" in name for name, _ in model.named_parameters())
    assert not any(key.startswith("basis") for key in model.state_dict())


def test_tied_embeddings_refuse_multi_stage():
    with pytest.raises(ConfigError, match="tie_embeddings"):
        build_stage(_config(tie_embeddings=True), 0)


def test_pluralis_geometry():
    config = PRESETS["pluralis-8b"].model
    assert (config.d_model, config.rank, config.d_ff, config.head_dim) == (5120, 51, 18432, 128)
    assert config.layer_split == (6, 4, 4, 4, 4, 4, 6)
