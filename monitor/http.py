"""The monitor's one HTTP port: `/metrics`, `/sd`, `/api/swarm`, and the status page at `/`.

A stdlib threaded WSGI server in a daemon thread (the same server prometheus_client's own
exposition uses), so a slow client never holds up the DHT poll; every answer is built from the
current `SwarmView`, which the poll replaces whole. The status page and its assets are files of
this package (monitor/static/), served from it: no CDN, works offline.
"""

from __future__ import annotations

import json
import mimetypes
import threading
from importlib import resources
from socketserver import ThreadingMixIn
from typing import Callable, Iterable, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from agora.monitor.swarm_view import SwarmView, scrape_targets

__all__ = ["MonitorServer", "start_monitor_server"]

_STATIC = "static"


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        pass  # one line per scrape is noise; the monitor logs what matters


def _static_file(name: str) -> Optional[bytes]:
    if "/" in name or name.startswith("."):
        return None
    resource = resources.files("agora.monitor").joinpath(_STATIC, name)
    return resource.read_bytes() if resource.is_file() else None


def monitor_app(registry: CollectorRegistry, current: Callable[[], Optional[SwarmView]]):
    metrics = make_wsgi_app(registry)

    def app(environ, start_response) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return metrics(environ, start_response)
        view = current()
        if path == "/sd":
            return _json(start_response, scrape_targets(view) if view is not None else [])
        if path == "/api/swarm":
            return _json(start_response, view.to_json() if view is not None else {"stages": [], "trainers": []})
        name = "index.html" if path in ("/", "/index.html") else path.removeprefix("/static/")
        body = _static_file(name) if path in ("/", "/index.html") or path.startswith("/static/") else None
        if body is None:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: /, /api/swarm, /sd and /metrics are served here\n"]
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        start_response("200 OK", [("Content-Type", kind), ("Cache-Control", "no-cache")])
        return [body]

    return app


def _json(start_response, value) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "application/json"), ("Cache-Control", "no-store")])
    return [json.dumps(value).encode()]


class MonitorServer:
    def __init__(self, server: WSGIServer):
        self._server = server
        self.host, self.port = server.server_address[:2]
        self._thread = threading.Thread(target=server.serve_forever, name="agora-monitor-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_monitor_server(registry: CollectorRegistry, current: Callable[[], Optional[SwarmView]], host: str,
                         port: int) -> MonitorServer:
    """Listen on host:port (0: a free port; `MonitorServer.port` says which) and serve."""
    return MonitorServer(make_server(host, port, monitor_app(registry, current), _ThreadingServer,
                                     handler_class=_QuietHandler))
