"""A TCP relay for tests: forwards one listening port to an upstream address, and can hold or cut the
upstream-to-client direction after a number of bytes, so a test drops or stalls a real connection
(gRPC over it sees what it would see on a real network) at a chosen point of a transfer. With
`source`, it dials upstream from that local address (any of 127.0.0.0/8 on loopback), so a server
sees callers from several addresses of one network."""

from __future__ import annotations

import asyncio
from typing import Optional


class TcpRelay:
    """`hold_after`: bytes toward the client before forwarding waits for `release()`; `cut()` cuts
    the first connection now (when the test knows what the client has taken; later ones pass whole)."""

    def __init__(self, upstream: str, *, hold_after: Optional[int] = None, source: Optional[str] = None):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.local_addr = None if source is None else (source, 0)
        self.hold_after = hold_after
        self.held = asyncio.Event()  # set once forwarding is held
        self.dropped = asyncio.Event()  # set once the first connection was cut
        self._release = asyncio.Event()
        self._server: Optional[asyncio.base_events.Server] = None
        self._tasks: set[asyncio.Task] = set()
        self.connections = 0
        self._first_pumps: tuple[asyncio.Task, ...] = ()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def cut(self) -> None:
        """Cut the first connection mid-stream (its pumps stop, both ends are closed)."""
        self.dropped.set()
        for task in self._first_pumps:
            task.cancel()

    def release(self) -> None:
        self._release.set()

    async def close(self) -> None:
        self._release.set()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, client_reader, client_writer) -> None:
        self.connections += 1
        first = self.connections == 1
        upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream, local_addr=self.local_addr)
        up = asyncio.create_task(self._pump(client_reader, upstream_writer, False))
        down = asyncio.create_task(self._pump(upstream_reader, client_writer, True))
        self._tasks.update((up, down))
        if first:
            self._first_pumps = (up, down)
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for task in (up, down):
            task.cancel()
        for writer in (client_writer, upstream_writer):
            writer.close()
        self._tasks.difference_update((up, down))

    async def _pump(self, reader, writer, toward_client: bool) -> None:
        sent = 0
        while True:
            data = await reader.read(16384)
            if not data:
                return
            if toward_client and self.hold_after is not None and sent + len(data) >= self.hold_after \
                    and not self._release.is_set():
                self.held.set()
                await self._release.wait()
            writer.write(data)
            await writer.drain()
            sent += len(data)
