"""`InferenceClient`: a `StageClient` (node/trainer/stage_client.py) that also speaks the inference calls.

The same channel plumbing, fingerprint metadata, deadlines and typed errors as training's client
(a NOT_FOUND is a `RequestRefused` whose `code` says the session is gone: the generator replays
it). Replies are decoded and checked here, shapes included, so a replica answering garbage is
caught at its own hop (`BadReply`); so are a scoring reply's frames (`PositionScores`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import grpc
import torch

from agora.node.trainer.stage_client import BadReply, StageClient
from agora.pipeline.codec import WireFormatError, decode_tokens
from agora.pipeline.inference import PositionScores
from agora.protos.stage_adapter import CloseSessionRequest, InferReply, InferRequest

__all__ = ["InferResult", "InferenceClient"]


@dataclass(frozen=True)
class InferResult:
    output: torch.Tensor  # head/body: wire (rows, n, wire_dim); tail: last position's logits (rows, 1, vocab)
    frame: bytes  # the encoded output: a head/body's passes on to the next stage as is
    length: int  # positions the session holds on that worker now
    step: int  # the worker's optimizer step, now and when the session opened
    session_step: int
    queued_s: float = 0.0
    compute_s: float = 0.0
    scores: Optional[PositionScores] = None  # tail, when the call asked to score


class InferenceClient(StageClient):
    """Prefill / Decode / CloseSession on one worker of one stage."""

    @property
    def is_tail(self) -> bool:
        return self.stage == len(self.model.layer_split or (self.model.n_layers,)) - 1

    async def _infer(self, method: str, request: InferRequest, rows: int, positions: int,
                     timeout_s: float | None) -> InferResult:
        stub = self._calls()
        call = stub.prefill if method == "Prefill" else stub.decode
        reply = await self._invoke(method, lambda **options: call(request, **options), timeout_s)
        frame = reply.logits if self.is_tail else reply.wire
        if not frame:
            raise BadReply(grpc.StatusCode.DATA_LOSS, f"reply carries no {'logits' if self.is_tail else 'wire'}",
                           address=self.address, method=method)
        shape = (rows, 1, self.model.vocab_size) if self.is_tail else (rows, positions, self.model.wire_dim)
        scores = self._scores(reply, rows, positions, request.top_logprobs, method) if request.score else None
        return InferResult(output=self._decode(frame, shape, method), frame=frame, length=reply.length,
                           step=reply.step, session_step=reply.session_step, queued_s=reply.queued_s,
                           compute_s=reply.compute_s, scores=scores)

    def _scores(self, reply: InferReply, rows: int, positions: int, top_k: int, method: str) -> PositionScores:
        """A scoring reply's frames, each held to the shape the call implies."""
        logprobs = self._decode(reply.token_logprobs, (rows, positions), method)
        if not top_k:
            empty = torch.zeros((rows, positions, 0))
            return PositionScores(logprobs, empty, empty.long())
        values = self._decode(reply.top_logprobs, (rows, positions, top_k), method)
        try:
            ids = decode_tokens(reply.top_ids, self.model.vocab_size, expected_shape=(rows, positions, top_k))
        except WireFormatError as error:
            raise BadReply(grpc.StatusCode.DATA_LOSS, f"reply's top_ids do not decode: {error}",
                           address=self.address, method=method) from None
        return PositionScores(logprobs, values, ids)

    async def prefill(self, session_id: str, tokens: torch.Tensor, wire: torch.Tensor | bytes | None = None, *,
                      max_tokens: int = 0, score: bool = False, top_logprobs: int = 0,
                      timeout_s: float | None = None) -> InferResult:
        """Open the session here with positions 0.. (`tokens` (rows, n)); `max_tokens`: its declared bound;
        `score` (the tail): also each position's scores, with `top_logprobs` alternatives."""
        request = InferRequest(run_id=self.run_id, stage=self.stage, session_id=session_id, position=0,
                               tokens=self._token_frame(tokens), wire=self._frame(wire), max_tokens=max_tokens,
                               score=score and self.is_tail, top_logprobs=top_logprobs if score and self.is_tail else 0)
        return await self._infer("Prefill", request, *tokens.shape, timeout_s)

    async def decode(self, session_id: str, position: int, tokens: torch.Tensor,
                     wire: torch.Tensor | bytes | None = None, *, timeout_s: float | None = None) -> InferResult:
        """The positions `position`.. of an open session."""
        request = InferRequest(run_id=self.run_id, stage=self.stage, session_id=session_id, position=position,
                               tokens=self._token_frame(tokens), wire=self._frame(wire))
        return await self._infer("Decode", request, *tokens.shape, timeout_s)

    async def close_session(self, session_id: str, *, timeout_s: float | None = None) -> bool:
        request = CloseSessionRequest(run_id=self.run_id, stage=self.stage, session_id=session_id)
        stub = self._calls()
        reply = await self._invoke("CloseSession", lambda **options: stub.close_session(request, **options),
                                   timeout_s)
        return reply.closed
