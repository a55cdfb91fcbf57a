"""How a worker node is put together (node/worker/join.py): whatever started is stopped on every path."""

from __future__ import annotations

import socket

import pytest

from agora.dht.swarm import SwarmDHT
from agora.node.admission import free_port
from agora.node.rpc.server import run
from agora.node.worker.join import _serve
from agora.node.worker.join_options import JoinOptions
from agora.node.worker.options import WorkerOptions
from agora.pipeline.config import PRESETS, ConfigError

pytestmark = pytest.mark.timeout(120)


def test_a_start_that_fails_halfway_stops_the_server_it_had_started(tmp_path):
    """The resume step asked for is not there: the start fails after the gRPC server is up, and the
    error reaches the caller with the server closed, not left serving a stage nobody announces."""
    config = PRESETS["tiny"].with_stages(2)
    port = free_port("127.0.0.1")
    swarm = SwarmDHT.start()
    try:
        options = JoinOptions(stage=0, run_id="assembly", checkpoint_dir=str(tmp_path), resume_step=7,
                              heartbeat_s=1.0)
        with pytest.raises(ConfigError, match="step-00000007"):
            run(_serve(config, options, WorkerOptions(port=port), swarm))
    finally:
        swarm.shutdown()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
