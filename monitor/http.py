"""The monitor's one HTTP port: `/metrics`, `/sd`, `/api/swarm`, the ledger, and the status page at `/`.

A stdlib threaded WSGI server in a daemon thread (the same server prometheus_client's own
exposition uses), so a slow client never holds up the DHT poll; every answer is built from the
current `SwarmView`, which the poll replaces whole. The status page and its assets are files of
this package (monitor/static/), served from it: no CDN, works offline.

The ledger of verified work (monitor/ledger.py), where the monitor keeps one: trainers POST their
signed receipts to `/api/receipts` (`{"receipts": [...]}`; each is verified before it is stored,
so the port needs no credential of its own: a forged receipt is refused, a copy is a duplicate);
`/api/contributors` sums them per worker and `/api/ledger` exports them, signed, for anyone to
re-verify. A body over `MAX_RECEIPTS_BODY` bytes is refused before it is read.
"""

from __future__ import annotations

import json
import mimetypes
from dataclasses import asdict
from importlib import resources
from typing import Callable, Iterable, Optional
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from agora.auth.receipts import ReceiptError, receipt_from_json
from agora.monitor.ledger import ReceiptLedger, ServedCount
from agora.monitor.metrics import QuietHandler, ThreadingHTTPServer, serve_in_thread
from agora.monitor.swarm_view import SwarmView, scrape_targets

__all__ = ["MAX_RECEIPTS_BODY", "MonitorServer", "ServedLookup", "start_monitor_server"]

MAX_RECEIPTS_BODY = 1 << 20
# (worker peer id, trainer peer id) -> what the worker says it served that trainer, None if unknown.
ServedLookup = Callable[[str, str], Optional[ServedCount]]

_STATIC = "static"


def _static_file(name: str) -> Optional[bytes]:
    if "/" in name or name.startswith("."):
        return None
    resource = resources.files("agora.monitor").joinpath(_STATIC, name)
    return resource.read_bytes() if resource.is_file() else None


def monitor_app(registry: CollectorRegistry, current: Callable[[], Optional[SwarmView]],
                ledger: Optional[ReceiptLedger] = None, served: ServedLookup = lambda worker, trainer: None):
    metrics = make_wsgi_app(registry)

    def app(environ, start_response) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return metrics(environ, start_response)
        if path in ("/api/receipts", "/api/contributors", "/api/ledger"):
            return _ledger_api(path, environ, start_response, ledger, served)
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


def _json(start_response, value, status: str = "200 OK") -> list[bytes]:
    start_response(status, [("Content-Type", "application/json"), ("Cache-Control", "no-store")])
    return [json.dumps(value).encode()]


def _ledger_api(path: str, environ, start_response, ledger: Optional[ReceiptLedger],
                served: ServedLookup) -> list[bytes]:
    if ledger is None:
        return _json(start_response, {"error": "this monitor keeps no ledger (start it with a credential and "
                                               "--ledger FILE)"}, "404 Not Found")
    if path == "/api/contributors":
        return _json(start_response, {"contributors": [asdict(c) for c in ledger.contributors()]})
    if path == "/api/ledger":
        return _json(start_response, ledger.export())
    if environ.get("REQUEST_METHOD") != "POST":
        return _json(start_response, {"error": "POST {\"receipts\": [...]} here"}, "405 Method Not Allowed")
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = -1
    if not 0 < length <= MAX_RECEIPTS_BODY:
        return _json(start_response, {"error": f"body: expected 1 to {MAX_RECEIPTS_BODY} bytes of JSON, "
                                               f"got a length of {environ.get('CONTENT_LENGTH')!r}"},
                     "413 Content Too Large")
    try:
        entries = json.loads(environ["wsgi.input"].read(length)).get("receipts")
    except (ValueError, AttributeError):
        entries = None
    if not isinstance(entries, list):
        return _json(start_response, {"error": "body: expected {\"receipts\": [...]}"}, "400 Bad Request")
    return _json(start_response, _take_receipts(entries, ledger, served))


def _take_receipts(entries: list, ledger: ReceiptLedger, served: ServedLookup) -> dict:
    """Each receipt appended or refused on its own: the answer lists the refused ones by index. The
    worker's count is read once per worker and trainer in a request (one HTTP read each)."""
    accepted, flagged, refused = 0, 0, []
    counts: dict[tuple[str, str], Optional[ServedCount]] = {}
    for index, entry in enumerate(entries):
        try:
            try:
                signed = receipt_from_json(entry)
            except ReceiptError:
                ledger.metrics.refused.labels(reason="malformed").inc()  # `append` counts the rest
                raise
            pair = (signed.receipt.worker, signed.receipt.trainer)
            if pair not in counts:
                counts[pair] = served(*pair)
            stored = ledger.append(signed, counts[pair])
        except ReceiptError as error:
            refused.append({"index": index, "reason": error.reason, "error": str(error)})
            continue
        accepted += 1
        flagged += bool(stored.flag)
    return {"accepted": accepted, "flagged": flagged, "refused": refused}


class MonitorServer:
    def __init__(self, server: WSGIServer):
        self._server = server
        self.host, self.port = server.server_address[:2]
        self._thread = serve_in_thread(server, "agora-monitor-http")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_monitor_server(registry: CollectorRegistry, current: Callable[[], Optional[SwarmView]], host: str,
                         port: int, ledger: Optional[ReceiptLedger] = None,
                         served: ServedLookup = lambda worker, trainer: None) -> MonitorServer:
    """Listen on host:port (0: a free port; `MonitorServer.port` says which) and serve."""
    return MonitorServer(make_server(host, port, monitor_app(registry, current, ledger, served), ThreadingHTTPServer,
                                     handler_class=QuietHandler))
