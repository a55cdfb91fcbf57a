"""Log-probabilities in the shapes of OpenAI's APIs, from what the swarm scored. Pure functions.

A `TokenLogprob` is one token of a choice's text: its id, its log-probability given the tokens
before it (None for a prompt's first token, which nothing predicts), and the likeliest tokens at
its place. The numbers are the model's (pipeline/inference.score_positions: log-softmax of the
logits, not of a sampling temperature), as OpenAI's and vLLM's are.

Shapes:
- completions (OpenAI's legacy `logprobs`): `tokens` (each token's text), `token_logprobs`,
  `top_logprobs` (a map text -> log-probability per token; null for the first prompt token),
  `text_offset` (where each token's text starts in the choice's text: after the prompt when it is
  not echoed). As vLLM does, a token's map always holds the token itself, so `logprobs: 0` still
  names it and a token that was not the likeliest shows beside the ones that were. Two ids can read
  as the same text (a byte cut from a multi-byte character reads as U+FFFD): the map keeps the
  likelier.
- chat (`choices[].logprobs.content`): per token `{token, logprob, bytes, top_logprobs: [{token,
  logprob, bytes}]}`, the alternatives likeliest first, `bytes` the token text's UTF-8.
A token's text is the tokenizer's decoding of that one id, so the texts of a choice's tokens add
up to its text wherever no character spans two tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from agora.pipeline.inference import PositionScores

__all__ = ["TokenLogprob", "prompt_logprobs", "generated_logprobs", "completion_logprobs", "chat_logprobs"]

DecodeToken = Callable[[int], str]


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: Optional[float]  # None: a prompt's first token
    top: Optional[tuple[tuple[int, float], ...]]  # (id, log-probability), likeliest first; None with logprob


def _top(scores: PositionScores, position: int) -> tuple[tuple[int, float], ...]:
    return tuple(zip(scores.top_ids[0, position].tolist(), scores.top_logprobs[0, position].tolist()))


def prompt_logprobs(prompt: Sequence[int], scores: PositionScores) -> list[TokenLogprob]:
    """The prompt's tokens (`scores`: rows 1, the prompt's positions): token i is scored at position i-1."""
    entries = [TokenLogprob(int(prompt[0]), None, None)]
    for index in range(1, len(prompt)):
        entries.append(TokenLogprob(int(prompt[index]), float(scores.token_logprobs[0, index - 1]),
                                    _top(scores, index - 1)))
    return entries


def generated_logprobs(tokens: Sequence[int], scores: Sequence[PositionScores]) -> list[TokenLogprob]:
    """Generated tokens, each with the scores of the one position that drew it (rows 1, n 1)."""
    return [TokenLogprob(int(token), float(score.token_logprobs[0, 0]), _top(score, 0))
            for token, score in zip(tokens, scores)]


def _top_map(entry: TokenLogprob, decode: DecodeToken) -> Optional[dict[str, float]]:
    if entry.top is None:
        return None
    shown: dict[str, float] = {}
    for token, logprob in ((entry.token, entry.logprob), *entry.top):
        text = decode(token)
        if text not in shown or logprob > shown[text]:
            shown[text] = logprob
    return dict(sorted(shown.items(), key=lambda item: -item[1]))


def completion_logprobs(entries: Sequence[TokenLogprob], decode: DecodeToken, text_start: int = 0) -> dict:
    """OpenAI's legacy completions `logprobs` object; `text_start`: where the first token's text begins."""
    texts = [decode(entry.token) for entry in entries]
    offsets, at = [], text_start
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [_top_map(entry, decode) for entry in entries], "text_offset": offsets}


def _chat_token(token: int, logprob: float, decode: DecodeToken) -> dict:
    text = decode(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob], decode: DecodeToken) -> dict:
    """Chat completions' `logprobs` object: `{"content": [...]}` (see the module docstring)."""
    return {"content": [{**_chat_token(entry.token, entry.logprob, decode),
                         "top_logprobs": [_chat_token(token, logprob, decode) for token, logprob in entry.top or ()]}
                        for entry in entries]}
