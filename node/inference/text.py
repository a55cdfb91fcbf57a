"""Text around generation: a plain chat template, and streaming detokenization with stop strings.

Design choices:
- The chat template is plain text, one line per message (`role: content`) and `assistant:` to
  open the reply, because the byte tokenizer has no special tokens. A `tokenizers` JSON file
  carries no chat template either (Hugging Face keeps those in tokenizer_config.json, which this
  project does not read), so every tokenizer gets this one; the reply stops at the next turn
  (`\\n<role>:` of any role) or the end-of-text id.
- `TextStream` turns ids into text deltas: it decodes everything so far and hands out what is
  new. Text that may still change is held back: a trailing replacement character (a multi-byte
  UTF-8 character cut by the stream) and a tail that begins a stop string (it may become one). A
  stop string ends the text before it (OpenAI's `stop`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from agora.pipeline.tokenizer import Tokenizer

__all__ = ["ChatMessage", "CHAT_ROLES", "render_chat", "chat_stop_strings", "TextStream"]

CHAT_ROLES = ("system", "user", "assistant")
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def render_chat(messages: Sequence[ChatMessage]) -> str:
    """The prompt for a conversation: its messages, then the opening of the assistant's reply."""
    return "".join(f"{message.role}: {message.content}\n" for message in messages) + "assistant:"


def chat_stop_strings() -> tuple[str, ...]:
    """Where a reply ends: the start of the next message of any role."""
    return tuple(f"\n{role}:" for role in CHAT_ROLES)


class TextStream:
    """Ids in, text out as it becomes final (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._emitted = 0
        self.text = ""  # everything handed out so far
        self.stopped = False  # a stop string was reached: nothing more will come

    def _decoded(self) -> str:
        return self._tokenizer.decode(self._ids)

    def _release(self, text: str, final: bool) -> str:
        for stop in self._stop:
            at = text.find(stop)
            if at >= 0:
                text, final = text[:at], True
                self.stopped = True
        if not final:
            text = text.rstrip(_REPLACEMENT)
            text = text[:max(self._emitted, len(text) - self._stop_prefix(text))]
        delta = text[self._emitted:]
        self._emitted = max(self._emitted, len(text))
        self.text += delta
        return delta

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest tail of `text` that begins a stop string (it may yet become one)."""
        return max((n for stop in self._stop for n in range(len(stop) - 1, 0, -1) if text.endswith(stop[:n])),
                   default=0)

    def add(self, token: int) -> str:
        """The text this token makes final (often empty); nothing after a stop string."""
        if self.stopped:
            return ""
        self._ids.append(token)
        return self._release(self._decoded(), final=False)

    def finish(self) -> str:
        """Whatever was held back, once the generation has ended."""
        if self.stopped:
            return ""
        return self._release(self._decoded(), final=True)
