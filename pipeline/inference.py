"""Inference on pipeline stages: KV-cached incremental forward, sampling, and generation in one process.

Design choices:
- A session's state on a stage is a `StageCache`: one `KVCache` (pipeline/model.py) per block of
  the stage, every one holding the same positions. A call feeds the positions after the cached
  ones and appends theirs; RoPE is evaluated at their absolute positions (the tables are sliced
  from the whole sequence's, so a position's angles are bit-identical to a full forward's). GQA
  caches keep n_kv_heads heads, before the repeat.
- What crosses a stage boundary is what training sends: the subspace coordinates `c` of the new
  positions plus their token ids (a decode step: k floats and one id per boundary). The tail
  returns logits, of the last position by default: sampling happens where the generation loop
  runs (the client), so a seeded generation does not depend on which replica served a step.
- A call may start before the cache's end (`position`): the cache is cut back to it first. A
  retried step whose first attempt did reach the stage then recomputes the same positions
  instead of appending them twice.
- Scoring (`PositionScores`, `score_positions`) happens where the logits are, on the tail: a
  prompt's per-token log-probabilities and top-k alternatives are n * (1 + 2k) numbers, where the
  logits they come from are n * vocab. Log-probabilities are the model's own (log-softmax of the
  logits in float32), not those of a sampling temperature, as OpenAI's and vLLM's `logprobs` are.
- `TokenChooser` is the one sampling rule (greedy at temperature 0; else temperature, nucleus
  top-p, a seeded torch.Generator), shared by the in-process `LocalGenerator` and the swarm's
  client, so both draw the same tokens from the same logits.
- Everything runs under `torch.no_grad` on the stage's own parameters, in their dtype and device:
  nothing here touches gradients or optimizer state.
- What a position costs in a cache (`cache_bytes_per_position`) is measured by caching one, not
  computed from a formula: keys leave RoPE in float32 while values keep the autocast dtype, and
  the model's options (GQA, qk-norm, partial rotary) change the shapes. The memory plan measures
  it on fake tensors, a worker on its own stage, so the budget both count is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from agora.pipeline.config import ConfigError
from agora.pipeline.model import KVCache, rotary_tables
from agora.pipeline.stages import Stage

__all__ = [
    "StageCache",
    "SessionTooLong",
    "cache_bytes_per_position",
    "cached_forward",
    "Sampling",
    "GREEDY",
    "TokenChooser",
    "new_token_budget",
    "PositionScores",
    "score_positions",
    "score_next",
    "MAX_TOP_LOGPROBS",
    "LocalGenerator",
]

MAX_TOP_LOGPROBS = 20  # alternatives per position at most (vLLM's default bound; OpenAI's chat allows 20)


class SessionTooLong(ValueError):
    """A call would take a session past the model's longest sequence (or the cache's limit)."""


class StageCache:
    """One session's attention caches on one stage (every block's, same length), and its rows."""

    def __init__(self, stage: Stage):
        self.layers = {name: KVCache() for name in stage.layers}
        self.rows: int | None = None  # fixed by the first call

    @property
    def length(self) -> int:
        return next(iter(self.layers.values())).length  # every stage has a block (config.layer_split)

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self.layers.values())

    def truncate(self, length: int) -> None:
        for cache in self.layers.values():
            cache.truncate(length)


def cache_bytes_per_position(stage: Stage, device: torch.device) -> int:
    """Bytes one position of one row adds to a session's cache on `stage` (every block's keys and
    values), measured by caching one position of zeros; call it under the stage's autocast."""
    tokens = torch.zeros((1, 1), dtype=torch.long, device=device)
    wire = None if stage.is_head else torch.zeros((1, 1, stage.config.wire_dim), device=device)
    cache = StageCache(stage)
    cached_forward(stage, tokens, wire, cache)
    return cache.nbytes


def cached_forward(stage: Stage, tokens: torch.Tensor, wire: torch.Tensor | None, cache: StageCache,
                   *, position: int | None = None, last_only: bool = True) -> torch.Tensor:
    """Run `stage` on the positions `position`.. (default: the cache's end) of one session.

    tokens (rows, n) ids of those positions; wire (rows, n, wire_dim) the previous stage's output
    for them (None on the head). Returns the head/body's output wire (rows, n, wire_dim), or the
    tail's logits (rows, 1, vocab) of the last position (`last_only=False`: (rows, n, vocab))."""
    past = cache.length if position is None else position
    if not 0 <= past <= cache.length:
        raise ValueError(f"position {past}: the session holds {cache.length} positions on stage {stage.index}")
    rows, new = tokens.shape
    if cache.rows is not None and rows != cache.rows:
        raise ValueError(f"tokens: {rows} rows, this session has {cache.rows}")
    if past + new > stage.config.max_seq_len:
        raise SessionTooLong(f"tokens: positions {past}..{past + new - 1} exceed the model's longest sequence "
                             f"({stage.config.max_seq_len}, model.max_seq_len)")
    cache.truncate(past)
    with torch.no_grad():
        h = stage.residual_input(tokens, wire)
        cos, sin = rotary_tables(stage.config, past + new, tokens.device)
        rotary = (cos[past:], sin[past:])
        for name, block in stage.layers.items():
            h = block(h, rotary, stage.basis, cache.layers[name])
        cache.rows = rows
        if not stage.is_tail:
            return stage.encode(h, tokens)
        return stage.logits(h[:, -1:] if last_only else h)


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn: temperature 0 is greedy (argmax); else softmax(logits / T)
    restricted to the smallest set of tokens whose probability reaches `top_p`, drawn with a
    generator seeded by `seed`."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> "Sampling":
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise ConfigError(f"temperature: must be in [0, 100], got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed: must be in [0, 2**63), got {self.seed}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


class TokenChooser:
    """Draws tokens from logits by one `Sampling`; one per generated sequence (it owns the RNG)."""

    def __init__(self, sampling: Sampling = GREEDY):
        self.sampling = sampling.validate()
        self._generator = torch.Generator().manual_seed(sampling.seed)

    def choose(self, logits: torch.Tensor) -> int:
        """logits (vocab,) -> a token id."""
        logits = logits.detach().float().cpu()
        if self.sampling.greedy:
            return int(torch.argmax(logits))
        probabilities = torch.softmax(logits / self.sampling.temperature, dim=-1)
        if self.sampling.top_p < 1.0:
            ordered, order = torch.sort(probabilities, descending=True)
            before = torch.cumsum(ordered, dim=-1) - ordered  # mass of the tokens ranked above each
            ordered[before >= self.sampling.top_p] = 0.0  # the first token is always kept
            probabilities = torch.zeros_like(probabilities).scatter_(0, order, ordered)
        return int(torch.multinomial(probabilities, 1, generator=self._generator))


@dataclass(frozen=True)
class PositionScores:
    """What the model says about n positions of one sequence (or `rows` of them).

    token_logprobs (rows, n): at position i < n-1, log p(token i+1 | tokens ..i); the last: 0 (its
    next token is not part of the call). top_logprobs, top_ids (rows, n, k): the k likeliest next
    tokens at each position, likeliest first."""

    token_logprobs: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor

    def row(self, index: int, length: int) -> "PositionScores":
        """Row `index`'s first `length` positions (a batch's rows are right-padded to one length)."""
        logprobs = self.token_logprobs[index:index + 1, :length].clone()
        logprobs[:, -1] = 0.0  # the position after `length` is padding, not the row's next token
        return PositionScores(logprobs, self.top_logprobs[index:index + 1, :length],
                              self.top_ids[index:index + 1, :length])


def score_next(logits: torch.Tensor, next_tokens: torch.Tensor, top_k: int) -> PositionScores:
    """logits (rows, n, vocab) -> the log-probability of `next_tokens` (rows, n) at each position, and
    the `top_k` likeliest there."""
    logprobs = torch.log_softmax(logits.detach().float(), dim=-1)
    token_logprobs = logprobs.gather(-1, next_tokens.to(logprobs.device).unsqueeze(-1)).squeeze(-1)
    if not top_k:
        empty = logprobs.new_zeros((*next_tokens.shape, 0))
        return PositionScores(token_logprobs, empty, empty.long())
    top = torch.topk(logprobs, top_k, dim=-1)
    return PositionScores(token_logprobs, top.values, top.indices)


def score_positions(logits: torch.Tensor, tokens: torch.Tensor, top_k: int) -> PositionScores:
    """logits (rows, n, vocab) of the positions whose ids are `tokens` (rows, n) -> their scores."""
    following = torch.zeros_like(tokens)
    following[:, :-1] = tokens[:, 1:]
    scores = score_next(logits, following, top_k)
    scores.token_logprobs[:, -1] = 0.0
    return scores


def new_token_budget(prompt_tokens: int, max_new_tokens: int, max_seq_len: int) -> int:
    """How many tokens a generation may add: `max_new_tokens`, cut at the model's longest sequence
    (the last token needs no forward of its own). ConfigError when the prompt leaves no room."""
    if prompt_tokens < 1:
        raise ConfigError("prompt: empty (at least one token is needed)")
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens: must be >= 0, got {max_new_tokens}")
    if prompt_tokens >= max_seq_len and max_new_tokens > 0:
        raise ConfigError(f"prompt: {prompt_tokens} tokens, the model takes at most {max_seq_len} "
                          "(model.max_seq_len) including the generated ones")
    return min(max_new_tokens, max_seq_len - prompt_tokens + 1)


class LocalGenerator:
    """Generation with every stage in this process: the reference the swarm's output must equal.

    Stages pass their wire to the next exactly as in the swarm (without the codec: fp32 frames
    are lossless)."""

    def __init__(self, stages: Sequence[Stage]):
        if not stages or not stages[0].is_head or not stages[-1].is_tail:
            raise ValueError("LocalGenerator needs every stage of the model, head to tail")
        self.stages = list(stages)
        for stage in self.stages:
            stage.eval()

    def _logits(self, caches: list[StageCache], tokens: torch.Tensor) -> torch.Tensor:
        wire = None
        for stage, cache in zip(self.stages, caches):
            wire = cached_forward(stage, tokens, wire, cache)
        return wire[0, -1]

    def stream(self, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = GREEDY,
               stop_ids: Sequence[int] = ()) -> Iterator[int]:
        """The generated token ids one by one; a stop id ends it (and is not yielded)."""
        budget = new_token_budget(len(prompt), max_new_tokens, self.stages[0].config.max_seq_len)
        caches = [StageCache(stage) for stage in self.stages]
        chooser = TokenChooser(sampling)
        tokens = torch.tensor([list(prompt)], dtype=torch.long)
        for _ in range(budget):
            token = chooser.choose(self._logits(caches, tokens))
            if token in stop_ids:
                return
            yield token
            tokens = torch.tensor([[token]], dtype=torch.long)

    def generate(self, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = GREEDY,
                 stop_ids: Sequence[int] = ()) -> list[int]:
        return list(self.stream(prompt, max_new_tokens, sampling, stop_ids))

    def score(self, prompt: Sequence[int], top_k: int = 0) -> PositionScores:
        """The prompt's scores (rows 1) from one forward of every stage."""
        tokens = torch.tensor([list(prompt)], dtype=torch.long)
        wire = None
        for stage in self.stages:
            wire = cached_forward(stage, tokens, wire, StageCache(stage), last_only=False)
        return score_positions(wire, tokens, top_k)
