"""Honest stage workers made liars: their replies rewritten on their compute thread."""

from __future__ import annotations

import dataclasses

from agora.node.worker.worker import StageWorker
from agora.pipeline.codec import WireCodec

CODEC = WireCodec("fp32")


def rewrite_replies(worker: StageWorker, rewrite, *, after: int = 0) -> None:
    """From its `after`-th Forward on, the worker's replies go through `rewrite` (a liar)."""
    forward, served = worker.compute.forward, [0]

    def lying(request, **caller):
        reply = forward(request, **caller)
        served[0] += 1
        return rewrite(reply) if served[0] > after and not request.evaluate else reply
    worker.compute.forward = lying


def scaled_output(factor: float):
    return lambda reply: dataclasses.replace(reply, wire=CODEC.encode(CODEC.decode(reply.wire) * factor))


def rewritten_output(transform):
    """A rewrite of a Forward reply's output wire: `transform(output, the previous honest output or None)`."""
    previous = [None]

    def rewrite(reply):
        honest = CODEC.decode(reply.wire)
        lie = transform(honest, previous[0])
        previous[0] = honest
        return dataclasses.replace(reply, wire=CODEC.encode(lie))
    return rewrite
