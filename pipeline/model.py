"""Decoder-only transformers with the subspace reparameterization (SSN) of the Agora report.

Two families share one set of building blocks: Llama (RMSNorm, RoPE, SwiGLU, grouped-query
attention) and GPT-NeoX / Pythia (LayerNorm, GeLU, parallel residual, partial rotary).

Subspace mode (config.rank = k < d):
- `U` (d x k, orthonormal) and the token embedding `T` (vocab x d) are fixed buffers generated
  from `basis_seed`, identically on every node; they are never trained nor checkpointed.
- The trainable embedding is `T + Z_E U^T` and every block's attention-output and MLP-down
  projection is `x Z U^T` (+ `b_z U^T` with biases). Every write into the residual stream
  therefore lies in span(U), so `h = T[tokens] + U c` exactly and a stage boundary needs only
  the k coordinates `c` plus the token ids (see `stages.py`).
Dense mode (rank None or == d) is the same code without the constraint: the control.

Parameters are initialised from seeds derived from their *global names* (`layers.7.mlp.up.weight`),
so a worker that builds only its own stage gets exactly the tensors the full model would have.
"""

from __future__ import annotations

import hashlib
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from agora.pipeline.config import ModelConfig

__all__ = [
    "SubspaceBasis",
    "Block",
    "KVCache",
    "TokenEmbedding",
    "SubspaceTransformer",
    "make_basis",
    "make_fixed_embedding",
    "basis_checksum",
    "init_module",
]


def _seed(*parts: object) -> int:
    return zlib.crc32("/".join(str(p) for p in parts).encode())


def _generator(*parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(*parts))


def make_basis(config: ModelConfig) -> torch.Tensor:
    """The run's fixed orthonormal basis U (d x k), a deterministic function of basis_seed."""
    gaussian = torch.randn(config.d_model, config.rank, generator=_generator(config.basis_seed, "U"),
                           dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # unique QR: positive diagonal of R
    return q.to(torch.float32).contiguous()


def make_fixed_embedding(config: ModelConfig) -> torch.Tensor:
    """The run's fixed token embedding T (vocab x d)."""
    gaussian = torch.randn(config.vocab_size, config.d_model, generator=_generator(config.basis_seed, "T"))
    return gaussian * config.fixed_embedding_std


def basis_checksum(basis: torch.Tensor | None, fixed_embedding: torch.Tensor | None) -> str:
    """A short digest of U and T, recorded in run state so a node with another basis is refused."""
    digest = hashlib.sha256()
    for tensor in (basis, fixed_embedding):
        if tensor is not None:
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class SubspaceBasis(nn.Module):
    """Holds U and T (non-persistent buffers: regenerated from the seed, never checkpointed)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.register_buffer("U", make_basis(config), persistent=False)
        self.register_buffer("T", make_fixed_embedding(config), persistent=False)

    def fixed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """T[tokens] in fp32: T may be stored in the compute dtype (pipeline/runtime.py), the residual
        stream stays fp32 (a no-op when T is fp32)."""
        return F.embedding(tokens, self.T).float()

    def basis_for(self, values: torch.Tensor) -> torch.Tensor:
        """U to multiply `values` by: as stored under autocast (which casts both), else in `values`'
        dtype (a full-precision held-out forward of a bf16 runtime, whose U is stored in bf16)."""
        if self.U.dtype == values.dtype or torch.is_autocast_enabled(values.device.type):
            return self.U
        return self.U.to(values.dtype)

    def encode(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """c = U^T (h - T[tokens]): (..., d) -> (..., k)."""
        return (hidden - self.fixed_rows(tokens)) @ self.basis_for(hidden)

    def decode(self, coords: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """h = T[tokens] + U c: (..., k) -> (..., d)."""
        return self.fixed_rows(tokens) + coords @ self.basis_for(coords).T


class OutputProjection(nn.Module):
    """A projection into the residual stream: dense `Linear`, or `x Z U^T` in subspace mode."""

    def __init__(self, in_features: int, config: ModelConfig):
        super().__init__()
        self.subspace = config.subspace
        width = config.rank if config.subspace else config.d_model
        # Stored (width x in) like nn.Linear.weight so that dense mode is an ordinary Linear.
        self.weight = nn.Parameter(torch.empty(width, in_features))
        self.bias = nn.Parameter(torch.zeros(width)) if config.bias else None

    def forward(self, x: torch.Tensor, basis: SubspaceBasis | None) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out @ basis.basis_for(out).T if self.subspace else out

    def dense_weight(self, basis: SubspaceBasis | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The equivalent dense (d x in) weight and (d,) bias: exactly W = U Z^T."""
        if not self.subspace:
            return self.weight, self.bias
        bias = None if self.bias is None else basis.U @ self.bias
        return basis.U @ self.weight, bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm is one fused kernel on CUDA (computing in fp32 inside), where the widen,
        # square, mean, scale and narrow written out are five passes over the residual stream.
        x = F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return x * self.weight if self.weight is not None else x


def _norm(config: ModelConfig, dim: int) -> nn.Module:
    if config.arch == "neox":
        return nn.LayerNorm(dim, eps=config.norm_eps)
    return RMSNorm(dim, config.norm_eps)


def rotary_tables(config: ModelConfig, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (seq, rotary_dims), recomputed on each stage: nothing positional travels."""
    rotary_dims = int(config.head_dim * config.rotary_pct)
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, rotary_dims, 2, dtype=torch.int64, device=device)
                                             .float() / rotary_dims))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); rotates the first cos.shape[-1] dims of each head."""
    rotary_dims = cos.shape[-1]
    # In x's dtype: fp32 tables would widen bf16 queries and keys, for SDPA to narrow them again.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotated, passed = x[..., :rotary_dims], x[..., rotary_dims:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated


class KVCache:
    """One attention layer's keys and values for one inference session: (batch, kv_heads, length,
    head_dim), RoPE already applied, kept before the GQA repeat (n_heads / n_kv_heads times smaller).

    Grown by concatenation: a session's cache is small next to the weights, and a fixed
    preallocation would charge every short session the longest one's memory.
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """The memory its keys and values hold: their storages, so a cache cut back (a view) still
        counts what it keeps alive until it grows again."""
        if self.keys is None:
            return 0
        return self.keys.untyped_storage().nbytes() + self.values.untyped_storage().nbytes()

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions; every position's keys and values so far."""
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat((self.keys, keys), dim=2)
            self.values = torch.cat((self.values, values), dim=2)
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (a retried or rewound call recomputes them)."""
        if self.keys is not None and length < self.length:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


def _cached_attention_mask(queries: int, past: int, device: torch.device) -> torch.Tensor | None:
    """Query i (position past + i) sees keys 0..past + i; None where SDPA's own masks do."""
    if queries == 1:
        return None  # the newest position sees every key
    return torch.ones(queries, past + queries, dtype=torch.bool, device=device).tril(diagonal=past)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        d = config.d_model
        self.q = nn.Linear(d, self.n_heads * self.head_dim, bias=config.bias)
        self.k = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=config.bias)
        self.v = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=config.bias)
        self.o = OutputProjection(self.n_heads * self.head_dim, config)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                basis: SubspaceBasis | None, cache: KVCache | None = None) -> torch.Tensor:
        """`cache` (inference): `x` holds the positions after the cached ones, `rotary` their
        tables; their keys and values are appended to it."""
        batch, seq, _ = x.shape
        q = self.q(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.extend(k, v)
        # Grouped keys and values go to SDPA as they are (no per-head copies of them).
        gqa = self.n_kv_heads != self.n_heads
        if past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=_cached_attention_mask(seq, past, x.device),
                                                 enable_gqa=gqa)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1), basis)


class FeedForward(nn.Module):
    """SwiGLU (llama) or GeLU MLP (neox)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gated = config.arch == "llama"
        self.up = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.gate = nn.Linear(config.d_model, config.d_ff, bias=config.bias) if self.gated else None
        self.down = OutputProjection(config.d_ff, config)

    def forward(self, x: torch.Tensor, basis: SubspaceBasis | None) -> torch.Tensor:
        hidden = F.silu(self.gate(x)) * self.up(x) if self.gated else F.gelu(self.up(x))
        return self.down(hidden, basis)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.parallel = config.arch == "neox" and config.parallel_residual
        self.attn_norm = _norm(config, config.d_model)
        self.attn = Attention(config)
        self.mlp_norm = _norm(config, config.d_model)
        self.mlp = FeedForward(config)
        # Weightless RMSNorm on sublayer outputs (Agora): only rescales, so outputs stay in span(U).
        self.out_norm = RMSNorm(config.d_model, config.norm_eps, affine=False) if config.sublayer_norm else None

    def _post(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_norm(x) if self.out_norm is not None else x

    def forward(self, h: torch.Tensor, rotary, basis: SubspaceBasis | None,
                cache: KVCache | None = None) -> torch.Tensor:
        if self.parallel:
            return h + self._post(self.attn(self.attn_norm(h), rotary, basis, cache)) \
                + self._post(self.mlp(self.mlp_norm(h), basis))
        h = h + self._post(self.attn(self.attn_norm(h), rotary, basis, cache))
        return h + self._post(self.mlp(self.mlp_norm(h), basis))


class TokenEmbedding(nn.Module):
    """Dense: a (vocab x d) table. Subspace: T + Z_E U^T with Z_E (vocab x k) trainable."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.subspace = config.subspace
        width = config.rank if config.subspace else config.d_model
        self.weight = nn.Parameter(torch.empty(config.vocab_size, width))

    def forward(self, tokens: torch.Tensor, basis: SubspaceBasis | None) -> torch.Tensor:
        rows = F.embedding(tokens, self.weight)
        return basis.fixed_rows(tokens) + rows @ basis.basis_for(rows).T if self.subspace else rows

    def dense_weight(self, basis: SubspaceBasis | None) -> torch.Tensor:
        return basis.T + self.weight @ basis.U.T if self.subspace else self.weight


def init_module(module: nn.Module, prefix: str, config: ModelConfig, layer_index: int | None = None) -> None:
    """Initialise every parameter of `module` from a seed derived from its global name."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            full = f"{prefix}.{name}"
            if name.rsplit(".", 1)[-1] == "bias":
                param.zero_()
                continue
            if param.dim() == 1:  # norm gains
                param.fill_(1.0)
                continue
            std = config.init_std
            if layer_index is not None and (".o." in f".{name}" or ".down." in f".{name}"):
                std = config.init_std / math.sqrt(2 * (layer_index + 1))
            param.copy_(torch.randn(param.shape, generator=_generator(config.basis_seed, full)) * std)


class SubspaceTransformer(nn.Module):
    """The whole model in one process: used for tests, export and as the stages' parameter owner."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.basis = SubspaceBasis(config) if config.subspace else None
        self.embed = TokenEmbedding(config)
        self.layers = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layers)})
        self.final_norm = _norm(config, config.d_model)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        init_module(self.embed, "embed", config)
        for i, block in self.layers.items():
            init_module(block, f"layers.{i}", config, layer_index=int(i))
        init_module(self.final_norm, "final_norm", config)
        if self.lm_head is not None:
            init_module(self.lm_head, "lm_head", config)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.final_norm(hidden)
        if self.lm_head is None:
            return hidden @ self.embed.dense_weight(self.basis).T
        return self.lm_head(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab)."""
        rotary = rotary_tables(self.config, tokens.shape[1], tokens.device)
        h = self.embed(tokens, self.basis)
        for block in self.layers.values():
            h = block(h, rotary, self.basis)
        return self.logits(h)
