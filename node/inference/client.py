"""`InferenceClient`: a `StageClient` (node/trainer/stage_client.py) that also speaks the inference calls.

The same channel plumbing, fingerprint metadata, deadlines and typed errors as training's client
(a NOT_FOUND is a `RequestRefused` whose `code` says the session is gone: the generator replays
it). Replies are decoded and checked here, shapes included, so a replica answering garbage is
caught at its own hop (`BadReply`).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch

from agora.node.trainer.stage_client import BadReply, StageClient
from agora.protos.stage_adapter import CloseSessionRequest, InferRequest

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
        return InferResult(output=self._decode(frame, shape, method), frame=frame, length=reply.length,
                           step=reply.step, session_step=reply.session_step, queued_s=reply.queued_s,
                           compute_s=reply.compute_s)

    async def prefill(self, session_id: str, tokens: torch.Tensor, wire: torch.Tensor | bytes | None = None, *,
                      max_tokens: int = 0, timeout_s: float | None = None) -> InferResult:
        """Open the session here with positions 0.. (`tokens` (rows, n)); `max_tokens`: its declared bound."""
        request = InferRequest(run_id=self.run_id, stage=self.stage, session_id=session_id, position=0,
                               tokens=self._token_frame(tokens), wire=self._frame(wire), max_tokens=max_tokens)
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
