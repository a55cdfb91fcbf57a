"""What every gRPC server of a node shares: the event loop, limits, health and reflection.

Design choices:
- One asyncio loop per process, uvloop where it is installed (`run`, `new_event_loop`);
  grpc.aio runs on it (checked on this machine with concurrent 1 MiB unary calls).
- `create_server` is the only place a `grpc.aio.Server` is built, so every service gets the
  same message-size limits and sits behind the same interceptor chain (node/rpc/interceptors.py).
- Every server also runs the standard health-checking service and server reflection, so
  grpc_health_probe and grpcurl work against any node without our .proto files. They are served
  from a small pool of calls of their own (node/rpc/call_slots.py): a peer holding health Watch
  streams open never takes the calls training and inference need.
- Connections are long-lived and cross long round trips and NATs (`channel_options`,
  `server_options`): HTTP/2 keepalive pings every 20 s, also on an idle channel, because a NAT or a
  stateful firewall forgets an idle TCP flow after as little as 30 s and a trainer may not call a
  replica for a while; 10 s without the ping's ack (some 60 round trips at 150 ms) declares the
  peer gone, so a dead worker's channel fails fast instead of at the next call's deadline. Servers
  accept pings that often (grpc's default is one per 5 minutes, and it answers more with GOAWAY)
  and ping their clients alike. Compression is off both ways: activations and gradients are
  dense floats that do not compress, and compressing them would cost CPU on every hop.
  Flow-control windows are left to grpc's bandwidth-delay probing, which grows them to the link.
- One host setting matters more than any of these and is not the application's to change: with
  Linux's default `net.ipv4.tcp_slow_start_after_idle=1`, a connection that sent nothing for one
  retransmission timeout (~RTT + 200 ms) restarts from the initial window, so a 16 KiB call after a
  pause takes two or three round trips instead of one (measured over the WAN harness's 80 ms links:
  bench/RESULTS.md). `slow_start_hint` says so once, in the log of a worker or trainer that has it on.
- `bind` listens on the given host and port (0 picks a free one) and returns the real port,
  which is what a worker announces and what tests connect to. With server credentials it opens a
  TLS port (node/rpc/tls.py); without, a plaintext one: the `--insecure` path, which the caller
  chose (and the authorizer's door, which serves nodes that hold no credential yet).
- `announced_host` is what a node tells others to dial, which is not always what it binds:
  `--announce-host` for a node behind a proxy or NAT, and never a wildcard (0.0.0.0 or ::
  means "every interface" to the node itself and nothing to anyone else); a wildcard bind
  announces the address of the interface that routes outwards (found by a UDP connect(),
  which sends nothing) or loopback on a machine without a route.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any, Callable, Coroutine, Optional, Sequence, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from agora.node.rpc.call_slots import CallSlots

__all__ = [
    "new_event_loop",
    "run",
    "message_options",
    "channel_options",
    "server_options",
    "slow_start_hint",
    "KEEPALIVE_TIME_MS",
    "KEEPALIVE_TIMEOUT_MS",
    "create_server",
    "bind",
    "announced_host",
    "outbound_address",
    "is_wildcard_host",
    "is_loopback_host",
    "host_port",
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


KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """A client channel's options to a peer: message limits, keepalive, no compression (module docstring)."""
    return [*message_options(max_message_bytes),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.default_compression_algorithm", grpc.Compression.NoCompression.value)]


def server_options() -> list[tuple[str, Any]]:
    """What every server adds to its limits: clients' keepalive pings accepted, its own pings, no compression."""
    return [("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.default_compression_algorithm", grpc.Compression.NoCompression.value)]


SLOW_START_SYSCTL = "/proc/sys/net/ipv4/tcp_slow_start_after_idle"


def slow_start_hint(read: Callable[[str], str] = lambda path: open(path).read()) -> Optional[str]:
    """The log line for a host that restarts TCP slow start after idle (None when it does not, or
    when the setting cannot be read); `read` is injected for tests."""
    try:
        value = read(SLOW_START_SYSCTL).strip()
    except OSError:
        return None
    if value == "0":
        return None
    return ("this host restarts TCP slow start after an idle connection (net.ipv4.tcp_slow_start_after_idle="
            f"{value}): over long round trips a call after a pause costs one or two extra round trips; "
            "`sysctl -w net.ipv4.tcp_slow_start_after_idle=0` avoids it (bench/RESULTS.md, row 3)")


def message_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Channel/server options bounding one message each way (grpc's default receive limit is 4 MiB)."""
    if max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes must be positive, got {max_message_bytes}")
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def create_server(*, interceptors: Sequence[grpc.aio.ServerInterceptor], max_message_bytes: int,
                  options: Sequence[tuple[str, Any]] = (), max_receive_bytes: Optional[int] = None,
                  slots: Optional[CallSlots] = None) -> grpc.aio.Server:
    """`max_receive_bytes`: a tighter bound on one received message than `max_message_bytes` (a
    worker derives it from the run's geometry, node/replica/bounds.py); grpc refuses a message over
    it with RESOURCE_EXHAUSTED before any handler runs. `slots`: calls served at once, health checks
    and reflection in a pool of their own (node/rpc/call_slots.py; by default only that pool is
    bounded); it goes last in the chain, and grpc's own limit is set to their sum, so what every call
    may hold is bounded in sum."""
    limits = message_options(max_message_bytes)
    if max_receive_bytes is not None:
        if max_receive_bytes <= 0:
            raise ValueError(f"max_receive_bytes must be positive, got {max_receive_bytes}")
        limits = [("grpc.max_receive_message_length", min(max_receive_bytes, max_message_bytes)),
                  ("grpc.max_send_message_length", max_message_bytes)]
    slots = slots if slots is not None else CallSlots()
    return grpc.aio.server(interceptors=[*interceptors, slots], options=[*limits, *server_options(), *options],
                           maximum_concurrent_rpcs=slots.grpc_limit, compression=grpc.Compression.NoCompression)


def bind(server: grpc.aio.Server, host: str, port: int, credentials: Optional[grpc.ServerCredentials] = None) -> int:
    """Listen on TLS with `credentials`, plaintext without them; return the real port."""
    address = host_port(host, port)
    bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"could not listen on {address}")
    return bound


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 literal in brackets (what grpc and every peer parse)."""
    try:
        if ipaddress.ip_address(host.strip("[]")).version == 6:
            return f"[{host.strip('[]')}]:{port}"
    except ValueError:
        pass  # a host name
    return f"{host}:{port}"


def is_wildcard_host(host: str) -> bool:
    """0.0.0.0, ::, or an empty host: "every interface", which no peer can dial."""
    host = host.strip().strip("[]")
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Documentation addresses (RFC 5737, RFC 3849): never routed, and a UDP connect() sends nothing.
_PROBE_TARGETS = {socket.AF_INET: ("192.0.2.1", 9), socket.AF_INET6: ("2001:db8::1", 9)}


def outbound_address(family: int = socket.AF_INET) -> Optional[str]:
    """The local address of the interface that routes outwards, or None without a route."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(_PROBE_TARGETS[family])
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if is_wildcard_host(address) else address


def announced_host(bind_host: str, announce_host: Optional[str] = None, *,
                   outbound: Callable[[int], Optional[str]] = outbound_address) -> str:
    """The host a node announces for a server bound on `bind_host` (see the module docstring).

    `outbound` is injected so the decision is tested without the machine's interfaces."""
    if announce_host is not None:
        if is_wildcard_host(announce_host):
            raise ValueError(f"--announce-host: {announce_host!r} means 'every interface', which no peer can "
                             "dial; give the address peers reach this node on")
        return announce_host.strip().strip("[]")
    if not is_wildcard_host(bind_host):
        return bind_host.strip().strip("[]")
    wants_v6 = ":" in bind_host
    families = (socket.AF_INET6, socket.AF_INET) if wants_v6 else (socket.AF_INET,)
    for family in families:
        address = outbound(family)
        if address is not None:
            return address
    return "127.0.0.1"  # no route out: only this machine can reach it anyway (:: is dual-stack)


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
