"""The fields of `agora-node serve`'s requests, parsed and checked: `ApiError` (an error in OpenAI's
shape) naming the first bad field, or a `CompletionRequest` the server runs. Pure: no server, no swarm.
What each field does is in node/inference/openai_api.py's docstring.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

from agora.node.inference.text import CHAT_ROLES, ChatMessage, chat_stop_strings, render_chat
from agora.pipeline.inference import MAX_TOP_LOGPROBS, Sampling

__all__ = ["ApiError", "CompletionRequest", "Prompt", "parse_completion", "parse_chat", "MAX_CHOICES"]

_MAX_STOP_STRINGS = 4
MAX_CHOICES = 2048  # prompts x n in one request (OpenAI's bound on a prompt list)

Prompt = Union[str, tuple[int, ...]]  # text, or token ids


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None,
                 kind: str = "invalid_request_error", code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[Prompt, ...]
    max_tokens: int
    sampling: Sampling  # its seed is choice 0's; choice j of a prompt draws with seed + j
    stop: tuple[str, ...]
    stream: bool
    n: int = 1  # choices per prompt
    echo: bool = False  # the prompt leads each choice's text (and its logprobs)
    logprobs: Optional[int] = None  # alternatives per token (0: the chosen token's alone); None: no logprobs

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ApiError(400, f"{name}: expected a number in [{low:g}, {high:g}], got {value!r:.40}", param=name)
    return float(value)


def _integer(body: dict, name: str, default: Optional[int], low: int, high: int) -> Optional[int]:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(400, f"{name}: expected an integer in [{low}, {high}], got {value!r:.40}", param=name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and len(stop) <= _MAX_STOP_STRINGS and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise ApiError(400, f"stop: expected a string or a list of at most {_MAX_STOP_STRINGS} strings", param="stop")


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name}: expected true or false, got {value!r:.40}", param=name)
    return value


def _common(body: dict, prompts: tuple[Prompt, ...], max_tokens_field: str, max_tokens: int) -> CompletionRequest:
    n = _integer(body, "n", 1, 1, MAX_CHOICES)
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"n: {len(prompts)} prompts x {n} choices is over the {MAX_CHOICES} one request may ask",
                       param="n")
    seed = _integer(body, "seed", None, -(2**63), 2**63 - 1)
    sampling = Sampling(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                        top_p=max(_number(body, "top_p", 1.0, 0.0, 1.0), 1e-9),  # 0: only the likeliest token
                        seed=secrets.randbits(62) if seed is None else seed % 2**63)
    tokens = _integer(body, max_tokens_field, max_tokens, 0, 1 << 20)
    return CompletionRequest(prompts=prompts, max_tokens=tokens, sampling=sampling, stop=_stop(body),
                             stream=_flag(body, "stream"), n=n)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(values: list, vocab_size: int, where: str) -> tuple[int, ...]:
    if not values:
        raise ApiError(400, f"{where}: an empty list of token ids", param="prompt")
    if not all(_is_id(value) and 0 <= value < vocab_size for value in values):
        raise ApiError(400, f"{where}: token ids must be integers in [0, {vocab_size}) (this model's vocabulary)",
                       param="prompt")
    return tuple(values)


def _prompts(prompt: Any, vocab_size: int) -> tuple[Prompt, ...]:
    """A string, a list of strings, a list of token ids, or a list of lists of them."""
    shapes = "a non-empty string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(prompt, str) and prompt:
        return (prompt,)
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(400, f"prompt: expected {shapes}", param="prompt")
    if len(prompt) > MAX_CHOICES:
        raise ApiError(400, f"prompt: {len(prompt)} prompts, at most {MAX_CHOICES} in one request", param="prompt")
    if all(_is_id(value) for value in prompt):
        return (_ids(prompt, vocab_size, "prompt"),)
    if all(isinstance(value, str) for value in prompt):
        if not all(prompt):
            raise ApiError(400, f"prompt[{prompt.index('')}]: an empty string", param="prompt")
        return tuple(prompt)
    if all(isinstance(value, list) for value in prompt):
        return tuple(_ids(value, vocab_size, f"prompt[{index}]") for index, value in enumerate(prompt))
    raise ApiError(400, f"prompt: expected {shapes}, not a mix", param="prompt")


def parse_completion(body: Any, vocab_size: int) -> CompletionRequest:
    """/v1/completions' fields (see openai_api.py's docstring); ApiError naming the first bad one."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    request = _common(body, _prompts(body.get("prompt"), vocab_size), "max_tokens", 16)
    logprobs = _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    return replace(request, echo=_flag(body, "echo"), logprobs=logprobs)


def parse_chat(body: Any) -> tuple[CompletionRequest, int]:
    """/v1/chat/completions' fields: the rendered prompt, and how many messages it holds."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: expected a non-empty list of {role, content}", param="messages")
    parsed = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):  # content parts: the text ones, joined
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict)
                              and part.get("type") == "text")
        if role not in CHAT_ROLES or not isinstance(content, str):
            raise ApiError(400, f"messages[{index}]: expected a role in {', '.join(CHAT_ROLES)} and text content",
                           param=f"messages[{index}]")
        parsed.append(ChatMessage(role, content))
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    request = _common(body, (render_chat(parsed),), field, 256)
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not _flag(body, "logprobs"):
        raise ApiError(400, "top_logprobs: only with logprobs: true", param="top_logprobs")
    return replace(request, stop=request.stop + chat_stop_strings(),
                   logprobs=(top or 0) if _flag(body, "logprobs") else None), len(parsed)
