"""One unary Stage call that hands a worker a signed statement to keep (a receipt, a round attestation).

The statements travel as their signed JSON text in one field of the request; the reply says what the
worker now keeps. What every such call does alike lives here: the request parsed tolerantly (bytes
that are no such message: INVALID_ARGUMENT naming it, protos/serving.py), the handler's
`StageRefusal` turned into its status, the reply serialized.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import grpc

from agora.protos.serving import MalformedMessage, checked, tolerant_parser
from agora.protos.stage_adapter import StageRefusal

__all__ = ["delivery_handler"]


def delivery_handler(request_cls: type, field: str, handle: Callable[[str, Any], Awaitable[Any]],
                     reply: Callable[[Any], Any]) -> grpc.RpcMethodHandler:
    """The method handler: `handle(text of the request's `field`, context)` keeps the statement (or raises
    `StageRefusal`), and `reply(what it returned)` is the generated reply message."""

    async def deliver(request: Any, context: Any) -> Any:
        try:
            text = getattr(checked(request), field)
        except MalformedMessage as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        try:
            kept = await handle(text, context)
        except StageRefusal as refusal:
            await context.abort(refusal.code, refusal.message)
        return reply(kept)

    return grpc.unary_unary_rpc_method_handler(deliver, request_deserializer=tolerant_parser(request_cls),
                                               response_serializer=lambda message: message.SerializeToString())
