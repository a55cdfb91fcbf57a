"""`InferenceOptions`: a worker's bounds on inference sessions; `ServeOptions`: where `agora-node
serve`'s HTTP API listens, who may use it and how much of it at once; `ClientOptions`: how
`generate` and `serve` call the workers; `GenerateOptions`: `generate`'s length and sampling.
Sections of the settings schema (pipeline/schema.py): `join`'s, `generate`'s and `serve`'s flags for
them come from here. Light: the CLI imports it to build its parser, before torch.

The sessions' attention caches live on the stage's device beside training's state, so their bytes
are bounded (`max_kv_cache_gib`) and the memory plan counts that budget (pipeline/memory.py). Its
default holds `max_sessions` sessions of the longest a session may be, one row each: what the
sessions' count and length bounds let single-row generations (every completion of
`agora-node serve`) hold anyway, so the default refuses none of them and only makes it counted."""

from __future__ import annotations

from typing import Annotated

from pydantic import StrictFloat, StrictInt, StrictStr, model_validator
from pydantic.dataclasses import dataclass

from agora.pipeline.config import ConfigError, RunConfig
from agora.pipeline.schema import SECTION, NoneOr, setting

GiB = 2**30

__all__ = ["InferenceOptions", "ClientOptions", "GenerateOptions", "ServeOptions"]


@dataclass(frozen=True, config=SECTION)
class InferenceOptions:
    max_sessions: StrictInt = setting(
        32, "inference sessions held at once; the least recently used is evicted beyond", flag="--max-sessions", gt=0)
    max_session_tokens: Annotated[StrictInt | None, NoneOr] = setting(
        None, "positions one session may hold (default: model.max_seq_len)", flag="--max-session-tokens", gt=0)
    session_ttl_s: StrictFloat = setting(300.0, "seconds an idle session is kept", flag="--session-ttl", gt=0)
    max_queue: StrictInt = setting(8, "inference calls in flight before RESOURCE_EXHAUSTED",
                                   flag="--max-inference-queue", gt=0)
    max_kv_cache_gib: Annotated[StrictFloat | None, NoneOr] = setting(
        None, "GiB of device memory the sessions' attention caches may hold on this worker, counted in its memory "
        "plan; a Prefill or Decode that would take them past it is refused (RESOURCE_EXHAUSTED) and the open "
        "sessions keep theirs (default: max_sessions sessions of max_session_tokens positions, one row each)",
        flag="--max-kv-cache-gib", gt=0)

    def session_tokens(self, config: RunConfig) -> int:
        return self.max_session_tokens or config.model.max_seq_len

    def session_positions(self, config: RunConfig) -> int:
        """Positions the sessions hold at most by default: `max_sessions` of the longest, one row each."""
        return self.max_sessions * self.session_tokens(config)

    @property
    def set_kv_cache_bytes(self) -> int | None:
        """`max_kv_cache_gib` in bytes; None when unset (the default depends on the stage)."""
        return None if self.max_kv_cache_gib is None else int(self.max_kv_cache_gib * GiB)

    def kv_cache_bytes(self, config: RunConfig, bytes_per_position: int) -> int:
        """The sessions' cache budget in bytes, given what one position of one row costs on the stage."""
        if self.set_kv_cache_bytes is not None:
            return self.set_kv_cache_bytes
        return self.session_positions(config) * bytes_per_position

    def validate(self, config: RunConfig) -> "InferenceOptions":
        """Within the run's model: a session holds at most model.max_seq_len positions."""
        if self.max_session_tokens is not None and self.max_session_tokens > config.model.max_seq_len:
            raise ConfigError(f"inference.max_session_tokens: must be in 1..{config.model.max_seq_len} "
                              f"(model.max_seq_len), got {self.max_session_tokens}")
        return self


@dataclass(frozen=True, config=SECTION)
class ClientOptions:
    """How `generate` and `serve` call the serving workers, and the run config they serve."""

    call_timeout_s: StrictFloat = setting(30.0, "deadline of one call", flag="--call-timeout", metavar="S", gt=0)
    checkpoint: StrictStr | None = setting(
        None, "the checkpoint the workers serve: its run config (same as --config C)", flag="--checkpoint",
        metavar="C", min_length=1)


@dataclass(frozen=True, config=SECTION)
class GenerateOptions:
    """`generate`'s request: how long, and how each token is drawn (the bounds the HTTP API's
    requests have, pipeline/inference.py `Sampling`)."""

    max_new_tokens: StrictInt = setting(64, "tokens to add at most (cut at model.max_seq_len)", flag="--max-new-tokens",
                                        metavar="N", ge=0)
    temperature: StrictFloat = setting(0.0, "0: greedy", flag="--temperature", metavar="T", ge=0, le=100)
    top_p: StrictFloat = setting(1.0, "nucleus sampling mass", flag="--top-p", metavar="P", gt=0, le=1)
    seed: StrictInt = setting(0, "sampling seed (the run's seed is --run-seed)", flag="--seed", metavar="S",
                              dest="sampling_seed", ge=0, lt=2**63)


@dataclass(frozen=True, config=SECTION)
class ServeOptions:
    host: StrictStr = setting("127.0.0.1", "address the HTTP server listens on", flag="--host", min_length=1)
    port: StrictInt = setting(8000, "HTTP port (0: pick a free one)", flag="--port", ge=0, lt=65536)
    model_name: StrictStr | None = setting(None, "the model id clients name (default: agora-<config name>)",
                                           flag="--model-name", min_length=1)
    ready_file: StrictStr | None = setting(None, "write the API's base URL here once serving", flag="--ready-file")
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
