"""Pipeline stages: head / bodies / tail, each a module whose forward maps wire input to wire output.

- head:  `stage(tokens)` -> wire (batch, seq, wire_dim)
- body:  `stage(tokens, wire)` -> wire
- tail:  `stage(tokens, wire, targets)` -> scalar mean cross-entropy loss
- a single stage is head and tail at once: `stage(tokens, targets=targets)` -> loss

In subspace mode the wire is the k coordinates `c = U^T (h - T[tokens])` and the receiving stage
rebuilds `h = T[tokens] + U c`: lossless because every residual write lies in span(U). Token ids
travel beside the wire; RoPE is recomputed on each stage. In dense mode the wire is `h` itself.

A stage is built either standalone (`build_stage`: only that stage's parameters exist, as on a
worker) or as a view over a whole model (`stages_of`: shares its modules, for tests and export).
Both give identical tensors because parameters are initialised from their global names.
State-dict keys are global (`layers.7.attn.q.weight`), so the union of the stages' state dicts is
the whole model's state dict.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agora.pipeline.config import ConfigError, ModelConfig
from agora.pipeline.model import (
    Block,
    SubspaceBasis,
    SubspaceTransformer,
    TokenEmbedding,
    _norm,
    init_module,
    rotary_tables,
)

__all__ = ["Stage", "build_stage", "stages_of", "stage_layer_ids", "assemble_model"]


def stage_layer_ids(layer_split: tuple[int, ...], index: int) -> range:
    if not 0 <= index < len(layer_split):
        raise ConfigError(f"stage: index {index} out of range for {len(layer_split)} stages")
    first = sum(layer_split[:index])
    return range(first, first + layer_split[index])


class Stage(nn.Module):
    def __init__(self, config: ModelConfig, index: int, *, owner: SubspaceTransformer | None = None):
        super().__init__()
        self.config = config
        self.layer_split = config.layer_split or (config.n_layers,)
        self.index = index
        self.n_stages = len(self.layer_split)
        self.layer_ids = stage_layer_ids(self.layer_split, index)
        self._compiled_blocks: tuple[nn.Module, ...] = ()  # (a tuple: not registered as submodules)
        if config.tie_embeddings and self.n_stages > 1:
            raise ConfigError("model.tie_embeddings: tied embeddings need the embedding on the tail; "
                              "use a single stage or untied embeddings")
        if owner is not None:
            self.basis = owner.basis
            self.embed = owner.embed if self.is_head else None
            self.layers = nn.ModuleDict({str(i): owner.layers[str(i)] for i in self.layer_ids})
            self.final_norm = owner.final_norm if self.is_tail else None
            self.lm_head = owner.lm_head if self.is_tail else None
            return
        self.basis = SubspaceBasis(config) if config.subspace else None
        self.embed = TokenEmbedding(config) if self.is_head else None
        self.layers = nn.ModuleDict({str(i): Block(config) for i in self.layer_ids})
        self.final_norm = _norm(config, config.d_model) if self.is_tail else None
        self.lm_head = (nn.Linear(config.d_model, config.vocab_size, bias=False)
                        if self.is_tail and not config.tie_embeddings else None)
        if self.embed is not None:
            init_module(self.embed, "embed", config)
        for i, block in self.layers.items():
            init_module(block, f"layers.{i}", config, layer_index=int(i))
        if self.final_norm is not None:
            init_module(self.final_norm, "final_norm", config)
        if self.lm_head is not None:
            init_module(self.lm_head, "lm_head", config)

    @property
    def is_head(self) -> bool:
        return self.index == 0

    @property
    def is_tail(self) -> bool:
        return self.index == self.n_stages - 1

    @property
    def kind(self) -> str:
        if self.is_head and self.is_tail:
            return "full"
        return "head" if self.is_head else "tail" if self.is_tail else "body"

    def encode(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.basis.encode(hidden, tokens) if self.basis is not None else hidden

    def decode(self, wire: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.basis.decode(wire, tokens) if self.basis is not None else wire

    def residual_input(self, tokens: torch.Tensor, wire: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream entering this stage's blocks: the embedding (head) or the decoded wire."""
        if self.is_head:
            return self.embed(tokens, self.basis)
        if wire is None:
            raise ValueError(f"stage {self.index} ({self.kind}) needs wire input")
        return self.decode(wire, tokens)

    def hidden(self, tokens: torch.Tensor, wire: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream after this stage's blocks."""
        h = self.residual_input(tokens, wire)
        rotary = rotary_tables(self.config, tokens.shape[1], tokens.device)
        for block in self._compiled_blocks or self.layers.values():
            h = block(h, rotary, self.basis)
        return h

    def compile_blocks(self, backend: str = "inductor") -> None:
        """Run training's forward and backward through each block compiled by torch.compile. The
        compiled wrappers share the blocks' parameters; blocks of one shape share compiled code, so
        the compiler runs once per microbatch shape, not once per block. Inference calls the blocks
        with a KV cache whose length changes every token, so it keeps the eager ones. (`backend`:
        tests trace with "aot_eager", which skips inductor's kernel compiler on the CPU.)"""
        self._compiled_blocks = tuple(torch.compile(block, backend=backend) for block in self.layers.values())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.final_norm(hidden)
        if self.lm_head is None:
            return hidden @ self.embed.dense_weight(self.basis).T
        return self.lm_head(hidden)

    def forward(self, tokens: torch.Tensor, wire: torch.Tensor | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.hidden(tokens, wire)
        if not self.is_tail:
            # fp32 on the wire side whatever the compute dtype (a no-op in fp32): the codec and the
            # next stage take float32, and the gradient that comes back is float32.
            return self.encode(h, tokens).float()
        if targets is None:
            raise ValueError("the tail stage needs targets")
        logits = self.logits(h)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def extra_repr(self) -> str:
        return f"index={self.index}/{self.n_stages}, kind={self.kind}, layers={list(self.layer_ids)}"


def build_stage(config: ModelConfig, index: int) -> Stage:
    """Only stage `index`'s parameters, as a worker holds them."""
    return Stage(config, index)


def stages_of(model: SubspaceTransformer) -> list[Stage]:
    """Views over a whole model, split by model.config.layer_split, sharing its parameters."""
    split = model.config.layer_split or (model.config.n_layers,)
    return [Stage(model.config, i, owner=model) for i in range(len(split))]


def assemble_model(config: ModelConfig, stage_states: list[dict[str, torch.Tensor]]) -> SubspaceTransformer:
    """The whole model from every stage's state dict (global keys), e.g. for export."""
    model = SubspaceTransformer(config)
    merged: dict[str, torch.Tensor] = {}
    for state in stage_states:
        overlap = merged.keys() & state.keys()
        if overlap:
            raise ValueError(f"stage states overlap on {sorted(overlap)[:3]}")
        merged.update(state)
    model.load_state_dict(merged, strict=True)
    return model
