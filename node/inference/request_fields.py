"""The fields of `agora-node serve`'s requests, parsed and checked: `ApiError` (an error in OpenAI's
shape) naming the first bad field, or a `CompletionRequest` the server runs. Pure: no server, no swarm.
What each field does is in node/inference/openai_api.py's docstring.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any, Optional

from agora.node.inference.text import CHAT_ROLES, ChatMessage, chat_stop_strings, render_chat
from agora.pipeline.inference import Sampling

__all__ = ["ApiError", "CompletionRequest", "parse_completion", "parse_chat"]

_MAX_STOP_STRINGS = 4


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
    prompt: str
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool


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


def _common(body: dict, prompt: str, max_tokens_field: str, max_tokens: int) -> CompletionRequest:
    if _integer(body, "n", 1, 1, 1_000_000) != 1:
        raise ApiError(400, "n: only 1 choice per request is supported", param="n")
    seed = _integer(body, "seed", None, -(2**63), 2**63 - 1)
    sampling = Sampling(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                        top_p=max(_number(body, "top_p", 1.0, 0.0, 1.0), 1e-9),  # 0: only the likeliest token
                        seed=secrets.randbits(62) if seed is None else seed % 2**63)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream: expected true or false, got {stream!r:.40}", param="stream")
    tokens = _integer(body, max_tokens_field, max_tokens, 0, 1 << 20)
    return CompletionRequest(prompt=prompt, max_tokens=tokens, sampling=sampling, stop=_stop(body), stream=stream)


def parse_completion(body: Any) -> CompletionRequest:
    """/v1/completions' fields (see the module docstring); ApiError naming the first bad one."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt: expected a non-empty string (or a list of one)", param="prompt")
    return _common(body, prompt, "max_tokens", 16)


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
    request = _common(body, render_chat(parsed), field, 256)
    return CompletionRequest(request.prompt, request.max_tokens, request.sampling,
                             request.stop + chat_stop_strings(), request.stream), len(parsed)
