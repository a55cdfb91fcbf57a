"""What every gRPC server of a node shares: the event loop, limits, health and reflection.

Design choices:
- One asyncio loop per process, uvloop where it is installed (`run`, `new_event_loop`);
  grpc.aio runs on it (checked on this machine with concurrent 1 MiB unary calls).
- `create_server` is the only place a `grpc.aio.Server` is built, so every service gets the
  same message-size limits and sits behind the same interceptor chain (node/rpc/interceptors.py).
- Every server also runs the standard health-checking service and server reflection, so
  grpc_health_probe and grpcurl work against any node without our .proto files.
- `bind` listens on the given host and port (0 picks a free one) and returns the real port,
  which is what a worker announces and what tests connect to.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, Sequence, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

__all__ = [
    "new_event_loop",
    "run",
    "message_options",
    "create_server",
    "bind",
    "add_health_and_reflection",
    "set_serving",
    "HEALTH_SERVICE_NAME",
    "REFLECTION_SERVICE_NAME",
]

HEALTH_SERVICE_NAME = health.SERVICE_NAME  # "grpc.health.v1.Health"
REFLECTION_SERVICE_NAME = reflection.SERVICE_NAME

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop where available, else the default asyncio loop."""
    try:
        import uvloop
    except ImportError:  # e.g. Windows: uvloop does not exist there
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on the loop `new_event_loop` picks."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def message_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Channel/server options bounding one message each way (grpc's default receive limit is 4 MiB)."""
    if max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes must be positive, got {max_message_bytes}")
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def create_server(*, interceptors: Sequence[grpc.aio.ServerInterceptor], max_message_bytes: int,
                  options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Server:
    return grpc.aio.server(interceptors=list(interceptors),
                           options=[*message_options(max_message_bytes), *options])


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Listen (insecure for now; the authorizer issue adds credentials) and return the real port."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not listen on {host}:{port}")
    return bound


def add_health_and_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> health.aio.HealthServicer:
    """Register health checking and reflection for `service_names`; returns the health servicer."""
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    reflection.enable_server_reflection([*service_names, HEALTH_SERVICE_NAME, REFLECTION_SERVICE_NAME], server)
    return checker


async def set_serving(checker: health.aio.HealthServicer, service_names: Sequence[str], serving: bool) -> None:
    """Mark the named services and the server as a whole ("") SERVING or NOT_SERVING."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *service_names):
        await checker.set(name, status)
