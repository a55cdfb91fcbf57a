"""Measuring what the harness made: TCP round trips and bulk goodput between two namespaces.

`serve` runs in one namespace (a thread per connection); `rtt` and `rate` run in another, each as
its own short process (`ip netns exec NS python -m agora.bench.wan.probe ...`), and print one JSON
object. The protocol is one mode byte, then:
- `e` (echo): every byte sent back; the client times `count` one-byte round trips (TCP_NODELAY)
  and reports the median.
- `s` (sink): the server counts what arrives until the client's half-close and answers with a JSON
  report. The rate is the receiver's, over the steady part of the transfer (after the first 40%
  of the receive time, at least 0.5 s: slow start or BBR's startup are not the link's rate), so
  bytes a sender buffered do not count as sent; it is the median of that part's windows, so a
  burst of bytes held behind a retransmission does not count as rate.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

__all__ = ["steady_rate_mbit", "main"]

_CHUNK = 1 << 20


def steady_rate_mbit(samples: list[tuple[float, int]], *, skip_fraction: float = 0.4, min_skip_s: float = 0.5,
                     window_s: float = 0.1, samples_per_window: int = 8) -> float | None:
    """Goodput in Mbit/s over the steady part of (time, cumulative bytes) receive samples: the median
    of its windows' rates. A loss early in a transfer holds the bytes after it in the receiver's
    out-of-order queue until the retransmission lands, and then they are readable at once: read
    as bytes over the whole window, that one jump put a 200 Mbit/s link at 229 after a 1.5 s
    transfer. A window lasts at least `window_s` and spans `samples_per_window` reads on average,
    so that a slow link's few large reads do not make each window's rate a multiple of one read."""
    if len(samples) < 2:
        return None
    start, end = samples[0][0], samples[-1][0]
    skip = max(min_skip_s, skip_fraction * (end - start))
    steady = [(t, n) for t, n in samples if t >= start + skip]
    if len(steady) < 2 or steady[-1][0] - steady[0][0] <= 0:
        return None
    duration = steady[-1][0] - steady[0][0]
    count = max(1, int(duration / max(window_s, samples_per_window * duration / len(steady))))
    edges = [steady[0][0] + duration * i / count for i in range(count + 1)]
    received, index = [], 0
    for edge in edges:  # the bytes read by each edge: those of the last read at or before it
        while index + 1 < len(steady) and steady[index + 1][0] <= edge:
            index += 1
        received.append(steady[index][1])
    received[-1] = steady[-1][1]
    rates = [(b - a) * 8 / 1e6 / (duration / count) for a, b in zip(received, received[1:])]
    return statistics.median(rates)


def _serve_connection(connection: socket.socket) -> None:
    with connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = connection.recv(1)
        if mode == b"e":
            while True:
                data = connection.recv(4096)
                if not data:
                    return
                connection.sendall(data)
        elif mode == b"s":
            total = 0
            samples = [(time.monotonic(), 0)]
            buffer = bytearray(_CHUNK)
            while True:
                received = connection.recv_into(buffer)
                if not received:
                    break
                total += received
                samples.append((time.monotonic(), total))
            report = {"bytes": total, "seconds": samples[-1][0] - samples[0][0],
                      "rate_mbit": steady_rate_mbit(samples[1:])}
            connection.sendall(json.dumps(report).encode())


def serve(host: str, ready_file: str) -> None:
    listener = socket.create_server((host, 0), reuse_port=False)
    port = listener.getsockname()[1]
    ready = Path(ready_file)
    temporary = ready.with_name(ready.name + ".tmp")
    temporary.write_text(f"{host}:{port}\n")
    temporary.rename(ready)
    while True:
        connection, _ = listener.accept()
        threading.Thread(target=_serve_connection, args=(connection,), daemon=True).start()


def _connect(target: str, mode: bytes) -> socket.socket:
    host, port = target.rsplit(":", 1)
    connection = socket.create_connection((host, int(port)), timeout=30)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    connection.sendall(mode)
    return connection


def measure_rtt(target: str, count: int) -> dict:
    with _connect(target, b"e") as connection:
        times = []
        for _ in range(count + 1):  # the first one pays for the connection's warm-up
            started = time.perf_counter()
            connection.sendall(b"x")
            if connection.recv(1) != b"x":
                raise RuntimeError("echo probe: the server answered something else")
            times.append(time.perf_counter() - started)
    return {"rtt_ms": 1e3 * statistics.median(times[1:]), "samples": count}


def measure_rate(target: str, seconds: float) -> dict:
    with _connect(target, b"s") as connection:
        payload = bytes(_CHUNK)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            connection.sendall(payload)
        connection.shutdown(socket.SHUT_WR)
        connection.settimeout(max(60.0, seconds * 4))
        answer = b""
        while True:
            data = connection.recv(4096)
            if not data:
                break
            answer += data
    return json.loads(answer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="link probe of the WAN harness")
    commands = parser.add_subparsers(dest="command", required=True)
    server = commands.add_parser("serve")
    server.add_argument("--host", required=True)
    server.add_argument("--ready-file", required=True)
    rtt = commands.add_parser("rtt")
    rtt.add_argument("--to", required=True)
    rtt.add_argument("--count", type=int, default=20)
    rate = commands.add_parser("rate")
    rate.add_argument("--to", required=True)
    rate.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.host, args.ready_file)
    elif args.command == "rtt":
        print(json.dumps(measure_rtt(args.to, args.count)))
    else:
        print(json.dumps(measure_rate(args.to, args.seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
