"""`InferenceOptions`: a worker's bounds on inference sessions (a section of the settings schema,
pipeline/schema.py; `join`'s flags for them come from here). Light: the CLI imports it to build
its parser, before torch."""

from __future__ import annotations

from typing import Annotated

from pydantic import StrictFloat, StrictInt
from pydantic.dataclasses import dataclass

from agora.pipeline.config import ConfigError, RunConfig
from agora.pipeline.schema import SECTION, NoneOr, setting

__all__ = ["InferenceOptions"]


@dataclass(frozen=True, config=SECTION)
class InferenceOptions:
    max_sessions: StrictInt = setting(
        32, "inference sessions held at once; the least recently used is evicted beyond", flag="--max-sessions", gt=0)
    max_session_tokens: Annotated[StrictInt | None, NoneOr] = setting(
        None, "positions one session may hold (default: model.max_seq_len)", flag="--max-session-tokens", gt=0)
    session_ttl_s: StrictFloat = setting(300.0, "seconds an idle session is kept", flag="--session-ttl", gt=0)
    max_queue: StrictInt = setting(8, "inference calls in flight before RESOURCE_EXHAUSTED",
                                   flag="--max-inference-queue", gt=0)

    def session_tokens(self, config: RunConfig) -> int:
        return self.max_session_tokens or config.model.max_seq_len

    def validate(self, config: RunConfig) -> "InferenceOptions":
        """Within the run's model: a session holds at most model.max_seq_len positions."""
        if self.max_session_tokens is not None and self.max_session_tokens > config.model.max_seq_len:
            raise ConfigError(f"inference.max_session_tokens: must be in 1..{config.model.max_seq_len} "
                              f"(model.max_seq_len), got {self.max_session_tokens}")
        return self
