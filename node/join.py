"""`agora-node join`: the contributor's daemon, hosting ONE replica of ONE stage.

Life: start a DHT peer (joining through `--initial-peers`), build the stage and serve it over
gRPC, announce it in the DHT every few seconds (endpoint, stage, throughput, queue, step, phase),
and on SIGTERM/SIGINT leave cleanly: mark itself leaving, withdraw the DHT record so trainers stop
routing to it, finish in-flight calls, write an atomic checkpoint of its stage, exit 0.
A kill -9 needs nobody's cooperation: the record expires after ~3 missed heartbeats and trainers
reroute. With `--checkpoint-dir` holding a checkpoint of the same stage, the worker resumes it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from agora.dht.bootstrap import host_maddrs, write_ready_file
from agora.dht.heartbeat import Heartbeat
from agora.dht.records import WorkerRecord
from agora.dht.swarm import SwarmDHT
from agora.node.worker import StageWorker, WorkerOptions
from agora.node.worker_compute import StageCompute
from agora.pipeline.checkpoint import StageState, latest_checkpoint, load_checkpoint, save_checkpoint
from agora.pipeline.config import ConfigError, RunConfig

__all__ = ["JoinOptions", "run_worker", "package_version"]

logger = logging.getLogger("agora.node.join")


def package_version() -> str:
    try:
        return metadata.version("agora-node")
    except metadata.PackageNotFoundError:  # running from a source tree without an install
        return "0+unknown"


@dataclass(frozen=True)
class JoinOptions:
    stage: int
    run_id: str = "agora"
    initial_peers: tuple[str, ...] = ()
    dht_host: str = "127.0.0.1"
    dht_port: int = 0
    heartbeat_s: float = 5.0
    ready_file: str | None = None
    checkpoint_dir: str | None = None


def _save_stage(compute: StageCompute, directory: str, config: RunConfig) -> Path:
    state = StageState(compute.index, compute.stage.state_dict(), compute.optimizer.state_dict())
    return save_checkpoint(directory, compute.optimizer.steps, config, [state])


def _restore_stage(compute: StageCompute, directory: str, config: RunConfig) -> int:
    step, saved_config, states, _ = load_checkpoint(directory)
    if saved_config.model != config.model or [s.index for s in states] != [compute.index]:
        raise ConfigError(f"--checkpoint-dir: {directory} holds another model or stage than stage {compute.index}")
    compute.stage.load_state_dict(states[0].model)
    compute.optimizer.load_state_dict(states[0].optimizer)
    return step


async def _serve(config: RunConfig, options: JoinOptions, worker_options: WorkerOptions, swarm: SwarmDHT) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    worker = StageWorker(config, options.stage, run_id=options.run_id, options=worker_options)
    await worker.start()
    if options.checkpoint_dir and latest_checkpoint(options.checkpoint_dir) is not None:
        step = await worker.on_compute(lambda c: _restore_stage(c, options.checkpoint_dir, config))
        logger.info("resumed stage %d at step %d from %s", options.stage, step, options.checkpoint_dir)
    version = package_version()
    seq_len = config.train.seq_len

    def record() -> WorkerRecord:
        info = worker.info()
        return WorkerRecord(peer_id=swarm.peer_id, run_id=options.run_id, endpoint=worker.address,
                            stage=options.stage, n_stages=info.n_stages, throughput=float(info.throughput),
                            queue_depth=info.load, step=info.step, phase=info.phase, version=version,
                            updated_at=0.0)

    heartbeat = Heartbeat(swarm, record, interval=options.heartbeat_s)
    await heartbeat.start()
    if options.ready_file:
        write_ready_file(options.ready_file, [worker.address, swarm.peer_id])
    logger.info("joined run %r as stage %d at %s (peer %s, %d tokens/sequence)", options.run_id, options.stage,
                worker.address, swarm.peer_id, seq_len)
    await stop.wait()

    logger.info("leaving: withdrawing the record, finishing in-flight work")
    worker.phase = "leaving"
    await heartbeat.stop(withdraw=True)
    await worker.stop()
    if options.checkpoint_dir:
        # The compute thread is shut down now; nothing else touches the stage, so save here.
        path = _save_stage(worker.compute, options.checkpoint_dir, config)
        logger.info("checkpoint written: %s", path)
    return 0


def run_worker(config: RunConfig, options: JoinOptions, worker_options: WorkerOptions) -> int:
    """Blocking: serve until a signal, return the exit code."""
    from agora.node.server import run as run_loop

    n_stages = len(config.layer_split)
    if not 0 <= options.stage < n_stages:
        raise ConfigError(f"--stage: {options.stage} out of range for {n_stages} stages")
    # hivemind forks its DHT process: start it before any gRPC server or torch thread exists.
    swarm = SwarmDHT.start(initial_peers=options.initial_peers,
                           host_maddrs=host_maddrs(options.dht_host, options.dht_port))
    try:
        return run_loop(_serve(config, options, worker_options, swarm))
    finally:
        swarm.shutdown()
