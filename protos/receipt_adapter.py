"""The generated classes of `agora.v1.Stage/DeliverReceipt`, a trainer's receipt for a worker, as dataclasses.

A method of the Stage service with an adapter of its own, like DownloadState (protos/state_adapter.py):
keeping one's receipts is a worker's concern apart from training and inference, and the stage adapter
serves this module's handler beside its own (`add_stage_service(..., extra=...)`).

- The receipt travels in its JSON form (auth/receipts.py `receipt_to_json`), the form the ledger
  exports, so a worker keeps and exports exactly the text that was signed and sent.
- The request is parsed tolerantly (protos/delivery.py, shared with DeliverAttestation): bytes that are no
  `ReceiptDelivery` are INVALID_ARGUMENT naming it; a handler's `StageRefusal` becomes its status.

Imports nothing of ours except the generated modules and stage_adapter's refusal beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Mapping, Protocol

import grpc

from agora.protos import stage_pb2, stage_pb2_grpc
from agora.protos.delivery import delivery_handler

__all__ = ["DELIVER_METHOD", "ReceiptDelivery", "ReceiptKept", "ReceiptHandler", "receipt_method_handlers",
           "ReceiptStub"]

DELIVER_METHOD = "DeliverReceipt"


@dataclass(frozen=True)
class ReceiptDelivery:
    receipt: str  # the signed receipt's JSON (auth/receipts.py receipt_to_json)


@dataclass(frozen=True)
class ReceiptKept:
    """What the worker now keeps from the receipt's trainer, this receipt included."""

    receipts: int
    microbatches: int
    tokens: int


class ReceiptHandler(Protocol):
    """What a worker implements: verify and keep the receipt; raise `StageRefusal` to refuse it."""

    def deliver_receipt(self, request: ReceiptDelivery, context: Any) -> Awaitable[ReceiptKept]: ...


def receipt_method_handlers(handler: ReceiptHandler) -> Mapping[str, grpc.RpcMethodHandler]:
    """The DeliverReceipt method handler, for `stage_adapter.add_stage_service(..., extra=...)`."""

    return {DELIVER_METHOD: delivery_handler(
        stage_pb2.ReceiptDelivery, "receipt",
        lambda text, context: handler.deliver_receipt(ReceiptDelivery(receipt=text), context),
        lambda kept: stage_pb2.ReceiptKept(receipts=kept.receipts, microbatches=kept.microbatches, tokens=kept.tokens))}


class ReceiptStub:
    """The client side of DeliverReceipt, speaking dataclasses; raises grpc.aio.AioRpcError on failure."""

    def __init__(self, channel: grpc.aio.Channel):
        self._stub = stage_pb2_grpc.StageStub(channel)

    async def deliver(self, request: ReceiptDelivery, **call: Any) -> ReceiptKept:
        reply = await self._stub.DeliverReceipt(stage_pb2.ReceiptDelivery(receipt=request.receipt), **call)
        return ReceiptKept(receipts=reply.receipts, microbatches=reply.microbatches, tokens=reply.tokens)
