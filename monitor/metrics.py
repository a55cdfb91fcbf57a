"""The Prometheus side of every agora-node process: one registry, the node's identity, a port.

Design choices:

- One `CollectorRegistry` per process, made by `new_registry` and passed to whatever updates a
  metric (no use of prometheus_client's global default registry, so tests never reset state and
  two nodes in one test process never share a counter).
- The definitions live in monitor/ (this module and the role modules beside it:
  `worker_metrics`, `trainer_metrics`, `averaging_metrics`, `swarm_metrics`); nodes only call
  `.inc()`, `.observe()` and `.set()` through them.
- Names follow Prometheus' conventions, checked by `monitor/naming.py` over the live registry:
  `agora_` prefix, one base unit per metric as its suffix (`_seconds`, `_bytes`, `_ratio`),
  `_total` exactly on counters, histograms for durations, and only low-cardinality labels
  (stage, role, outcome, method, code, phase, reason, kind; never a microbatch or peer id). A
  node's stage and role reach every series of its target through the service discovery labels
  (monitor/swarm_view.py `scrape_targets`), and `agora_node_info` carries them too.
- A value another part of the process already keeps (a queue's load, a credential's expiry, a
  renewer's count) is read at scrape time (`Gauge.set_function`, `FunctionCounter`) instead of
  being copied into a second bookkeeping.
- The process collector runs under the `agora` namespace (`agora_process_cpu_seconds_total`,
  `agora_process_resident_memory_bytes`, ...), so every series of a node has the prefix.
- `start_metrics_server(registry, host, port)`: prometheus_client's WSGI exposition served from a
  daemon thread; port 0 is the caller's "disabled" (`--metrics-port 0`), so the server always
  binds the port it is given and reports it. Its loop looks for a stop every STOP_POLL_S, not the
  standard library's 0.5 s, which every role's exit waited out (a quarter second on average).
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Callable, Iterable, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Gauge, Info, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = [
    "CredentialMetrics",
    "FunctionCounter",
    "MetricsServer",
    "QuietHandler",
    "STOP_POLL_S",
    "ThreadingHTTPServer",
    "new_registry",
    "node_info",
    "sample_value",
    "serve_in_thread",
    "start_metrics_server",
]


def new_registry() -> CollectorRegistry:
    """A fresh registry for one process, with its CPU, memory and file descriptor metrics."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(namespace="agora", registry=registry)
    return registry


def node_info(registry: CollectorRegistry, *, role: str, run_id: str, version: str,
              stage: Optional[int] = None) -> Info:
    """`agora_node_info{version, role, stage, run} 1`: who this process is (stage "" when none)."""
    info = Info("agora_node", "This process: its software version, role, stage and run", registry=registry)
    info.info({"version": version, "role": role, "stage": "" if stage is None else str(stage), "run": run_id})
    return info


class FunctionCounter(Collector):
    """A counter whose value another object keeps (read at scrape time): `agora_<name>_total`."""

    def __init__(self, name: str, documentation: str, read: Callable[[], float],
                 registry: Optional[CollectorRegistry] = None):
        self.name, self.documentation, self._read = name, documentation, read
        if registry is not None:
            registry.register(self)

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation)
        family.add_metric([], float(self._read()))
        yield family

    def describe(self) -> Iterable[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation)


class CredentialMetrics:
    """A node's credential: seconds until it expires and renewals so far (read from their owners)."""

    def __init__(self, registry: CollectorRegistry, remaining_s: Callable[[], float],
                 renewals: Callable[[], int] = lambda: 0):
        self.remaining = Gauge("agora_credential_remaining_seconds",
                               "Seconds until this node's credential expires (renewed at half life)",
                               registry=registry)
        self.remaining.set_function(lambda: _or_zero(remaining_s))
        self.renewals = FunctionCounter("agora_credential_renewals", "Credential renewals this process made",
                                        renewals, registry)


def _or_zero(read: Callable[[], float]) -> float:
    try:
        return float(read())
    except Exception:  # a missing or unreadable credential reads as expired, never a failed scrape
        return 0.0


@dataclass
class MetricsServer:
    """A started `/metrics` endpoint: where it listens, and how to stop it."""

    host: str
    port: int
    _server: object

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


STOP_POLL_S = 0.05  # how long closing an HTTP server waits, at most, for its loop to see the stop


class ThreadingHTTPServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        pass  # one line per scrape is noise


def serve_in_thread(server: WSGIServer, name: str) -> threading.Thread:
    """`server.serve_forever` in a daemon thread, looking for a stop every STOP_POLL_S."""
    thread = threading.Thread(target=server.serve_forever, args=(STOP_POLL_S,), name=name, daemon=True)
    thread.start()
    return thread


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve `registry` at http://host:port/metrics (any path answers) from a daemon thread.

    `port` 0 picks a free port; callers whose flag means "0 disables" never call this then.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MetricsHTTPServer", (ThreadingHTTPServer,), {"address_family": family})
    server = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=QuietHandler)
    serve_in_thread(server, "agora-metrics-http")
    return MetricsServer(host, server.server_address[1], server)


def sample_value(registry: CollectorRegistry, name: str, labels: Optional[dict[str, str]] = None) -> float:
    """A sample's current value (0 when the series does not exist yet): how summaries read metrics.
    Only the collector that owns `name` is collected (a worker's heartbeat reads several values each
    beat; the whole registry, /proc reads of the process collector included, would be collected for each)."""
    wanted = labels or {}
    for family in registry.restricted_registry([name]).collect():
        for sample in family.samples:
            if sample.name == name and sample.labels == wanted:
                return sample.value
    return 0.0

