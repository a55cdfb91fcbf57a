"""`InferenceOptions`: a worker's bounds on inference sessions; `ServeOptions`: who may use `agora-node
serve`'s HTTP API and how much of it at once. Sections of the settings schema (pipeline/schema.py):
`join`'s and `serve`'s flags for them come from here. Light: the CLI imports it to build its
parser, before torch."""

from __future__ import annotations

from typing import Annotated

from pydantic import StrictFloat, StrictInt, StrictStr, model_validator
from pydantic.dataclasses import dataclass

from agora.pipeline.config import ConfigError, RunConfig
from agora.pipeline.schema import SECTION, NoneOr, setting

__all__ = ["InferenceOptions", "ServeOptions"]


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


@dataclass(frozen=True, config=SECTION)
class ServeOptions:
    api_key_file: Annotated[StrictStr | None, NoneOr] = setting(
        None, "a file of API keys, one per line ('#' starts a comment, blank lines are skipped; a key is 16 to 256 "
        "printable characters without spaces); each request must then carry one as 'Authorization: Bearer KEY', "
        "else 401 (default: none, and the API is open to anyone who reaches --host:--port)",
        flag="--api-key-file", min_length=1)
    max_concurrent_requests: StrictInt = setting(
        16, "completions served at once (streams included, each a session on every stage); 429 with Retry-After "
        "beyond", flag="--max-concurrent-requests", gt=0)
    max_requests_per_key: Annotated[StrictInt | None, NoneOr] = setting(
        None, "of those, what one API key may hold (default: half, rounded up; only with --api-key-file)",
        flag="--max-requests-per-key", gt=0)

    @property
    def requests_per_key(self) -> int:
        if self.max_requests_per_key is not None:
            return self.max_requests_per_key
        return (self.max_concurrent_requests + 1) // 2

    @model_validator(mode="after")
    def _agree(self) -> "ServeOptions":
        if self.requests_per_key > self.max_concurrent_requests:
            raise ValueError(f"max_requests_per_key: {self.requests_per_key} is above max_concurrent_requests="
                             f"{self.max_concurrent_requests}")
        return self
