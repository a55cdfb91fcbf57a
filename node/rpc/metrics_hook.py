"""`MetricsHook`: every gRPC call of a server counted in the process's registry.

A `CallHook` (node/rpc/interceptors.py) placed in the chain ahead of the credential check
(`interceptor_chain(outer=...)`), so a call that check refuses is counted with its status code
like any other. It counts calls by method and
code, times them, and wraps each method's (de)serializers to count the bytes of every message
each way (unary and streamed alike). The definitions are monitor/worker_metrics.RpcServerMetrics.
"""

from __future__ import annotations

from typing import Any, Callable

from agora.monitor.worker_metrics import RpcServerMetrics, short_method
from agora.node.rpc.interceptors import CallHook, CallRecord, Clock

__all__ = ["MetricsHook"]


class MetricsHook(CallHook):
    def __init__(self, metrics: RpcServerMetrics, *, clock: Clock | None = None):
        super().__init__(**({} if clock is None else {"clock": clock}))
        self._metrics = metrics

    def after(self, record: CallRecord) -> None:
        self._metrics.finished(record.method, record.code.name, record.duration_s)

    def codecs(self, method: str, deserialize: Any, serialize: Any) -> tuple[Any, Any]:
        name = short_method(method)
        received, sent = self._metrics.received.labels(method=name), self._metrics.sent.labels(method=name)
        return _counting_in(deserialize, received.inc), _counting_out(serialize, sent.inc)


def _counting_in(deserialize: Callable[[bytes], Any] | None, count: Callable[[int], None]):
    def parse(data: bytes) -> Any:
        count(len(data))
        return deserialize(data) if deserialize is not None else data
    return parse


def _counting_out(serialize: Callable[[Any], bytes] | None, count: Callable[[int], None]):
    def write(message: Any) -> bytes:
        data = serialize(message) if serialize is not None else message
        count(len(data))
        return data
    return write
