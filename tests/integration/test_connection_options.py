"""Connection settings for long round trips (node/rpc/server.py): keepalive both sides agree on, and
activations crossing the wire uncompressed, counted on a real TCP path between a client and a worker."""

from __future__ import annotations

import asyncio

import pytest
import torch

from agora.node.rpc.server import SLOW_START_SYSCTL, channel_options, run, server_options, slow_start_hint
from agora.node.trainer.stage_client import StageClient
from agora.node.worker.worker import StageWorker
from agora.pipeline.config import PRESETS
from agora.pipeline.fingerprint import run_fingerprint

pytestmark = pytest.mark.timeout(60)

CONFIG = PRESETS["tiny"].with_stages(3)


def test_servers_accept_the_pings_clients_send():
    client, server = dict(channel_options(2**20)), dict(server_options())
    assert client["grpc.keepalive_permit_without_calls"] == server["grpc.keepalive_permit_without_calls"] == 1
    # grpc answers pings more frequent than the server's minimum with GOAWAY: the client's must be slower.
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]
    assert client["grpc.keepalive_timeout_ms"] < client["grpc.keepalive_time_ms"]
    assert client["grpc.default_compression_algorithm"] == server["grpc.default_compression_algorithm"] == 0


def test_a_host_that_restarts_slow_start_after_idle_is_told_what_to_set():
    def reading(value):
        def read(path):
            assert path == SLOW_START_SYSCTL
            if value is None:
                raise FileNotFoundError(path)
            return value
        return read

    assert "sysctl -w net.ipv4.tcp_slow_start_after_idle=0" in slow_start_hint(reading("1\n"))
    assert slow_start_hint(reading("0\n")) is None
    assert slow_start_hint(reading(None)) is None  # not Linux: nothing to say


class CountingProxy:
    """A TCP relay on 127.0.0.1:0 that counts the bytes each way (what is really on the wire)."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.upstream = 0  # client -> worker
        self.downstream = 0
        self.writers = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _pipe(self, reader, writer, direction: str) -> None:
        try:
            while data := await reader.read(1 << 16):
                setattr(self, direction, getattr(self, direction) + len(data))
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def close(self) -> None:
        self.server.close()
        for writer in self.writers:
            writer.close()

    async def _serve(self, reader, writer) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, upstream_writer]
        await asyncio.gather(self._pipe(reader, upstream_writer, "upstream"),
                             self._pipe(upstream_reader, writer, "downstream"), return_exceptions=True)


def test_activations_cross_the_wire_uncompressed():
    """A body Forward with an all-zero wire (as compressible as data gets) and its reply: at least the
    frames' bytes pass through, where gzip would have sent a few hundred."""
    tokens = torch.randint(0, CONFIG.model.vocab_size, (2, 128))
    wire = torch.zeros(2, 128, CONFIG.model.wire_dim)

    async def main():
        async with StageWorker(CONFIG, 1, run_id="r") as worker:
            proxy = CountingProxy(worker.port)
            port = await proxy.start()
            client = StageClient(f"127.0.0.1:{port}", run_id="r", stage=1, model=CONFIG.model,
                                 fingerprint=run_fingerprint(CONFIG))
            try:
                result = await client.forward("m0", tokens, wire)
            finally:
                await client.close()
                proxy.close()
            return result, proxy

    result, proxy = run(main())
    frame_bytes = len(result.wire_frame)
    assert frame_bytes > 16_000
    assert proxy.upstream >= wire.numel() * 4 and proxy.downstream >= frame_bytes
