"""`InferenceEngine`: Prefill, Decode and CloseSession on one stage, on the worker's compute thread.

Why the compute thread and not an executor of its own: it is the only thread that touches the
stage (node/replica/compute.py), and a worker that trains writes its weights in place there (an
optimizer step, an averaging apply). An inference job in FIFO order with those jobs always reads
one consistent version of the weights, without a lock and without a second copy of the stage;
it costs a serving call the wait behind training jobs already queued (a serve-only worker has
none). The sessions' caches live on that thread too.

Weights that move: a session records the optimizer step it opened on (`session_step` in every
reply, beside the step of the call). Its cache keeps what earlier calls computed on their
weights; positions computed after a step see the new weights. A client that needs one version
throughout replays the session (Prefill) when the steps differ; serve-only workers never step.

Every input is untrusted and checked before compute: run and stage, the session id, frames
decoded against the model (vocabulary, wire width, the rows the session has, finite values).
Nothing is half-applied: a call that fails after touching the cache cuts it back to where the
call started, and a Prefill that fails leaves no session. Inference never touches gradients,
optimizer state or the training stash.

Scoring (`InferRequest.score`, on the tail): the call's logits at every new position, not only
the last, reduced here to each position's next-token log-probability and top-k alternatives
(pipeline/inference.score_positions): what leaves the worker is n * (1 + 2k) numbers per row, not
n * vocab. The last position's logits still come back whole, so a scored Prefill also starts a
generation.

The sessions' caches are bounded in bytes (node/inference/sessions.py): before a call runs, the
engine says what the session will hold after it, rows x positions x what one position costs on
this stage. That cost is measured once, on the compute thread at the first call, by caching one
position (pipeline/inference.py `cache_bytes_per_position`, the memory plan's measure), and fixes
the default budget (node/inference/options.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from agora.node.inference.sessions import SessionError, SessionTable
from agora.node.replica.compute import StageCompute
from agora.node.replica.request_frames import InvalidRequest
from agora.pipeline.codec import WireCodec, WireFormatError, decode_tokens, encode_tokens
from agora.pipeline.inference import (MAX_TOP_LOGPROBS, SessionTooLong, StageCache, cache_bytes_per_position,
                                      cached_forward, score_positions)
from agora.protos.stage_adapter import CloseSessionReply, CloseSessionRequest, InferReply, InferRequest

__all__ = ["InferenceEngine", "SessionBehind", "MAX_SESSION_ID_CHARS"]

MAX_SESSION_ID_CHARS = 128


class SessionBehind(SessionError):
    """A Decode after positions this worker does not hold (FAILED_PRECONDITION: replay the session)."""


class InferenceEngine:
    """Not thread-safe: call it from the compute thread only (node/inference/service.py does)."""

    def __init__(self, sessions: SessionTable, codec: WireCodec, kv_budget: Callable[[int], int] | None = None):
        """`kv_budget`: the caches' budget in bytes given what one position of one row costs (None:
        unbounded)."""
        self.sessions = sessions
        self.codec = codec  # what this worker sends on the wire; it decodes any dtype
        self._logits_codec = WireCodec("fp32", max_bytes=codec.max_bytes)  # sampling needs full precision
        self._kv_budget = kv_budget
        self.bytes_per_position: int | None = None  # measured at the first call (module docstring)

    def _cache_bytes(self, compute: StageCompute, rows: int, positions: int) -> int:
        """What a session of `rows` x `positions` holds in its cache here (0 when unbounded)."""
        if self._kv_budget is None:
            return 0
        if self.bytes_per_position is None:
            with compute.runtime.autocast():
                self.bytes_per_position = cache_bytes_per_position(compute.stage, compute.runtime.device)
            self.sessions.max_cache_bytes = self._kv_budget(self.bytes_per_position)
        return rows * positions * self.bytes_per_position

    # ------------------------------------------------------------------ checks

    def _check(self, compute: StageCompute, run_id: str, stage: int, session_id: str) -> None:
        compute.check_addressing(run_id, stage)
        if not session_id or len(session_id) > MAX_SESSION_ID_CHARS:
            raise InvalidRequest(f"session_id must be 1..{MAX_SESSION_ID_CHARS} characters, got {len(session_id)}")

    @staticmethod
    def _check_scoring(compute: StageCompute, request: InferRequest) -> None:
        bound = min(MAX_TOP_LOGPROBS, compute.config.model.vocab_size)
        if request.top_logprobs > bound:
            raise InvalidRequest(f"top_logprobs: at most {bound} alternatives per position, got {request.top_logprobs}")
        if request.top_logprobs and not request.score:
            raise InvalidRequest("top_logprobs: only with score")

    def _inputs(self, compute: StageCompute, request: InferRequest, rows: int | None):
        if not request.tokens:
            raise InvalidRequest("tokens: missing (empty frame)")
        try:
            tokens = decode_tokens(request.tokens, compute.config.model.vocab_size, max_bytes=self.codec.max_bytes,
                                   expected_shape=(rows, None))
        except WireFormatError as error:
            raise InvalidRequest(f"tokens: {error}") from None
        tokens = tokens.to(compute.runtime.device, non_blocking=True)  # where the stage is (pipeline/runtime.py)
        if compute.stage.is_head:
            if request.wire:
                raise InvalidRequest("wire: the head stage takes token ids only, but a wire frame was sent")
            return tokens, None
        if not request.wire:
            raise InvalidRequest(f"wire: missing; stage {compute.index} ({compute.stage.kind}) needs the previous "
                                 "stage's output")
        try:
            wire = self.codec.decode(request.wire, expected_shape=(*tokens.shape, compute.config.model.wire_dim),
                                     out=compute.runtime.host_buffer)
        except WireFormatError as error:
            raise InvalidRequest(f"wire: {error}") from None
        return tokens, compute.runtime.to_device(wire)

    # ------------------------------------------------------------------ calls

    def _run(self, compute: StageCompute, session, tokens, wire, request: InferRequest) -> InferReply:
        rows, new = tokens.shape
        position = request.position
        self.sessions.check_room(session, position, new, cache_bytes=self._cache_bytes(compute, rows, position + new))
        scoring = compute.stage.is_tail and request.score
        try:
            with compute.runtime.autocast():
                output = cached_forward(compute.stage, tokens, wire, session.cache, position=position,
                                        last_only=not scoring)
        except SessionTooLong as error:
            session.cache.truncate(position)
            raise SessionTooLong(str(error)) from None
        try:
            if not compute.stage.is_tail:
                reply = InferReply(wire=self.codec.encode(compute.runtime.to_host(output)))
            elif scoring:
                reply = self._scored(compute, output, tokens, request.top_logprobs)
            else:
                reply = InferReply(logits=self._logits_codec.encode(compute.runtime.to_host(output)))
        except WireFormatError:
            session.cache.truncate(position)  # nothing of a failed call stays in the cache
            raise InvalidRequest(f"stage {compute.index} produced non-finite values from this request's input: "
                                 "the request's values overflowed it") from None
        return dataclasses.replace(reply, length=session.cache.length, step=compute.optimizer.steps,
                                   session_step=session.started_step)

    def _scored(self, compute: StageCompute, logits, tokens, top_k: int) -> InferReply:
        """The tail's reply to a scoring call: the last position's logits, and every position's scores."""
        scores = score_positions(logits, tokens, top_k)
        vocab = compute.config.model.vocab_size
        return InferReply(logits=self._logits_codec.encode(compute.runtime.to_host(logits[:, -1:])),
                          token_logprobs=self._logits_codec.encode(compute.runtime.to_host(scores.token_logprobs)),
                          top_logprobs=self._logits_codec.encode(compute.runtime.to_host(scores.top_logprobs))
                          if top_k else b"",
                          top_ids=encode_tokens(scores.top_ids, vocab) if top_k else b"")

    def prefill(self, compute: StageCompute, request: InferRequest, owner: str) -> InferReply:
        """Open (or start again) the caller's session with its first positions."""
        self._check(compute, request.run_id, request.stage, request.session_id)
        if request.position != 0:
            raise InvalidRequest(f"position: Prefill opens a session at position 0, got {request.position}; "
                                 "extend an open session with Decode")
        self._check_scoring(compute, request)
        tokens, wire = self._inputs(compute, request, None)
        session = self.sessions.open(request.session_id, owner, request.max_tokens, StageCache(compute.stage),
                                     compute.optimizer.steps, cache_bytes=self._cache_bytes(compute, *tokens.shape))
        try:
            return self._run(compute, session, tokens, wire, request)
        except BaseException:
            self.sessions.drop(request.session_id)  # a failed Prefill leaves no session behind
            raise

    def decode(self, compute: StageCompute, request: InferRequest, owner: str) -> InferReply:
        """The positions after `request.position` of the caller's open session."""
        self._check(compute, request.run_id, request.stage, request.session_id)
        session = self.sessions.get(request.session_id, owner)
        held = session.cache.length
        if request.position > held:
            raise SessionBehind(f"position: session {request.session_id!r} holds {held} positions on stage "
                                f"{compute.index}, the call follows {request.position}; replay it with Prefill")
        self._check_scoring(compute, request)
        tokens, wire = self._inputs(compute, request, session.cache.rows)
        return self._run(compute, session, tokens, wire, request)

    def close(self, compute: StageCompute, request: CloseSessionRequest, owner: str) -> CloseSessionReply:
        self._check(compute, request.run_id, request.stage, request.session_id)
        return CloseSessionReply(closed=self.sessions.close(request.session_id, owner))
