"""The generated classes of `agora.v1.Stage/DeliverAttestation`, a round attestation for a worker, as dataclasses.

A method of the Stage service with an adapter of its own, like DeliverReceipt (protos/receipt_adapter.py):
one member of an averaging round hands another the attestation it signed (auth/round_attestations.py),
a concern apart from training and inference; the stage adapter serves this module's handler beside its
own (`add_stage_service(..., extra=...)`).

- The attestation travels in its JSON form (`attestation_to_json`), the form the ledger exports, so a
  worker keeps and exports exactly the text that was signed and sent.
- The request is parsed tolerantly (protos/delivery.py): bytes that are no `AttestationDelivery` are
  INVALID_ARGUMENT naming it; a handler's `StageRefusal` becomes its status.

Imports nothing of ours except the generated modules and stage_adapter's refusal beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Mapping, Protocol

import grpc

from agora.protos import stage_pb2, stage_pb2_grpc
from agora.protos.delivery import delivery_handler

__all__ = ["ATTESTATION_METHOD", "AttestationDelivery", "AttestationKept", "AttestationHandler",
           "attestation_method_handlers", "AttestationStub"]

ATTESTATION_METHOD = "DeliverAttestation"


@dataclass(frozen=True)
class AttestationDelivery:
    attestation: str  # the signed attestation's JSON (auth/round_attestations.py attestation_to_json)


@dataclass(frozen=True)
class AttestationKept:
    """The worker's rounds other members now attest (each once), its attestations and their signers."""

    rounds: int
    attestations: int
    attesters: int


class AttestationHandler(Protocol):
    """What a worker implements: verify and keep the attestation; raise `StageRefusal` to refuse it."""

    def deliver_attestation(self, request: AttestationDelivery, context: Any) -> Awaitable[AttestationKept]: ...


def attestation_method_handlers(handler: AttestationHandler) -> Mapping[str, grpc.RpcMethodHandler]:
    """The DeliverAttestation method handler, for `stage_adapter.add_stage_service(..., extra=...)`."""

    return {ATTESTATION_METHOD: delivery_handler(
        stage_pb2.AttestationDelivery, "attestation",
        lambda text, context: handler.deliver_attestation(AttestationDelivery(attestation=text), context),
        lambda kept: stage_pb2.AttestationKept(rounds=kept.rounds, attestations=kept.attestations,
                                               attesters=kept.attesters))}


class AttestationStub:
    """The client side of DeliverAttestation, speaking dataclasses; raises grpc.aio.AioRpcError on failure."""

    def __init__(self, channel: grpc.aio.Channel):
        self._stub = stage_pb2_grpc.StageStub(channel)

    async def deliver(self, request: AttestationDelivery, **call: Any) -> AttestationKept:
        reply = await self._stub.DeliverAttestation(stage_pb2.AttestationDelivery(attestation=request.attestation),
                                                    **call)
        return AttestationKept(rounds=reply.rounds, attestations=reply.attestations, attesters=reply.attesters)
