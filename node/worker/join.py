"""`agora-node join`: the contributor's daemon, hosting ONE replica of ONE stage.

Life: start a DHT peer (joining through `--initial-peers`), build the stage and serve it over
gRPC, announce it in the DHT every few seconds (endpoint, stage, throughput, queue, step, phase),
and on SIGTERM/SIGINT leave cleanly: mark itself leaving, withdraw the DHT record so trainers stop
routing to it, finish in-flight calls, write an atomic checkpoint of its stage, exit 0.
With `serve_checkpoint` (join --serve-only) it serves inference only, on that checkpoint's
weights (node/inference/serving.py): no training call, no averaging, nothing written when it leaves.
A kill -9 needs nobody's cooperation: the record expires after ~3 missed heartbeats and trainers
reroute. With `--checkpoint-dir` holding a checkpoint of the same stage, the worker resumes it.
Unless the run's `sync.method` is "none" (or the worker is in synchronous mode, one replica per
stage), it averages with the other replicas of its stage in the background (node/averaging/loop.py)
and, with `--stats-file`, writes the averaging counters there as JSON when it leaves.
With `--metrics-port` it serves Prometheus metrics (worker, gRPC, averaging, credential; see
monitor/) and names the endpoint in its DHT record, with its averaging counts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from dataclasses import dataclass

from agora.auth.admission import CredentialRenewer
from agora.dht.security import DHTSecurity
from agora.auth.node_state import NodeCredentials
from agora.dht.averaging import RoundBoard, SliceAverager
from agora.dht.bootstrap import host_maddrs, write_ready_file
from agora.dht.heartbeat import Heartbeat
from agora.dht.records import TRAINING_PHASES, WorkerRecord
from agora.dht.robust import RobustAggregation
from agora.dht.swarm import SwarmDHT
from agora.monitor.metrics import CredentialMetrics
from agora.monitor.worker_metrics import RpcServerMetrics, WorkerMetrics
from agora.node.averaging.loop import AveragingLoop
from agora.node.averaging.sparta import (
    SlicePartition,
    averaged_vector_size,
    max_round_weight,
    stage_parameter_numels,
)
from agora.node.averaging.stats import AveragingStats
from agora.node.observability import MetricsOptions, NodeMetrics, package_version
from agora.node.rpc.metrics_hook import MetricsHook
from agora.node.worker.epoch import stage_step
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.node.worker.checkpoints import StageCheckpointer, restore_stage
from agora.pipeline.checkpoint import checkpoint_steps
from agora.pipeline.config import ConfigError, RunConfig
from agora.pipeline.fingerprint import run_fingerprint

__all__ = ["EXIT_REVOKED", "JoinOptions", "run_worker", "package_version"]

# Exit status of a worker that left because its credential was revoked (banned) or ran out.
EXIT_REVOKED = 3

logger = logging.getLogger("agora.node.join")


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
    checkpoint_every: int = 0  # optimizer steps between periodic checkpoints (0: only when leaving)
    resume_step: int | None = None  # resume from this step's checkpoint (None: the newest complete one)
    stats_file: str | None = None  # averaging counters, written as JSON on exit
    authorizer: str | None = None  # host:port to renew the credential with (None: no renewal)
    serve_checkpoint: str | None = None  # serve-only: the checkpoint whose weights this stage serves
    metrics: MetricsOptions = MetricsOptions()  # port 0: no metrics server


def _start_averager(config: RunConfig, options: JoinOptions, swarm: SwarmDHT, security: DHTSecurity | None,
                    local_batch: int | None) -> SliceAverager:
    """The stage's averager process, sized for one round of `config.sync.method` (forks: call early)."""
    sync = config.sync
    robust = RobustAggregation(sync.aggregation, max_weight=max_round_weight(sync, config.train.batch_size,
                                                                             local_batch))
    numels = stage_parameter_numels(config.model, options.stage)
    size = averaged_vector_size(sync, SlicePartition(numels, sync.n_slices, config.seed).buffer_size)
    return SliceAverager.start(
        swarm.hivemind_dht, prefix=f"{options.run_id}_stage{options.stage}_{sync.method}", size=size,
        matchmaking_s=sync.matchmaking_s, request_s=sync.request_s, sender_s=sync.sender_s,
        reducer_s=sync.reducer_s, round_s=sync.round_s, part_size_bytes=sync.part_size_bytes,
        admission=security.averaging_admission(options.stage) if security is not None else None, robust=robust)


async def _follow_stage_epoch(swarm: SwarmDHT, worker: StageWorker, options: JoinOptions) -> None:
    """Every heartbeat: give the compute the step count the stage's other replicas announce (their
    median; node/worker/epoch.py), against which it judges a first or far-off completed-batch report."""
    while True:
        try:
            records = await swarm.live_workers_async(options.run_id, options.stage)
            steps = [r.step for r in records if r.peer_id != swarm.peer_id and r.phase in TRAINING_PHASES]
            value = stage_step(steps)
            await worker.on_compute(lambda compute: setattr(compute, "stage_step", value))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a DHT hiccup keeps the last value; the worker goes on
            logger.debug("could not read the stage's replicas: %s", error)
        await asyncio.sleep(options.heartbeat_s)


async def _serve(config: RunConfig, options: JoinOptions, worker_options: WorkerOptions, swarm: SwarmDHT,
                 averager: SliceAverager | None = None, credentials: NodeCredentials | None = None,
                 metrics: NodeMetrics | None = None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    metrics = metrics if metrics is not None else NodeMetrics(options.metrics)
    registry = metrics.registry
    # With credentials: mutual TLS and per-call checks (node/rpc/auth_check.py); None: --insecure.
    worker = StageWorker(config, options.stage, run_id=options.run_id, options=worker_options,
                         credentials=credentials, outer_interceptors=[MetricsHook(RpcServerMetrics(registry))],
                         metrics=WorkerMetrics(registry))
    await worker.start()
    revoked: list[str] = []
    renewer = None
    if credentials is not None and options.authorizer:
        def on_revoked(reason: str) -> None:  # banned, or the credential ran out: leave the run
            revoked.append(reason)
            stop.set()

        renewer = CredentialRenewer(options.authorizer, credentials, on_revoked=on_revoked)
        renewer.start()
    if credentials is not None:
        CredentialMetrics(registry, credentials.remaining_s, lambda: renewer.renewals if renewer is not None else 0)
    stats = AveragingStats(config.sync.method, registry=registry) if averager is not None else None
    metrics_endpoint = metrics.serve(worker_options.announce_host)
    averaging_state = None
    if options.serve_checkpoint:
        from agora.node.inference.serving import load_serving_weights

        step = await worker.on_compute(lambda c: load_serving_weights(c, options.serve_checkpoint))
        logger.info("serving stage %d of %s (step %d), inference only", options.stage, options.serve_checkpoint, step)
    elif options.checkpoint_dir and (checkpoint_steps(options.checkpoint_dir) or options.resume_step is not None):
        step, averaging_state, saved = await worker.on_compute(
            lambda c: restore_stage(c, options.checkpoint_dir, config, step=options.resume_step))
        logger.info("resumed stage %d at step %d from %s (it was %s)", options.stage, step, options.checkpoint_dir,
                    saved.get("phase", "a member"))
    version = package_version()
    seq_len = config.train.seq_len
    fingerprint = run_fingerprint(config).text()  # in every record: trainers skip a mismatched run

    def record() -> WorkerRecord:
        info = worker.info()
        return WorkerRecord(peer_id=swarm.peer_id, run_id=options.run_id, endpoint=worker.address,
                            stage=options.stage, n_stages=info.n_stages, throughput=float(info.throughput),
                            queue_depth=info.load, step=info.step, phase=info.phase, version=version,
                            updated_at=0.0, fingerprint=fingerprint, sessions=info.sessions,
                            metrics_endpoint=metrics_endpoint,
                            averaging_rounds=sum(stats.rounds.values()) if stats is not None else 0,
                            averaging_committed=stats.rounds["committed"] if stats is not None else 0)

    heartbeat = Heartbeat(swarm, record, interval=options.heartbeat_s)
    await heartbeat.start()
    follow = asyncio.create_task(_follow_stage_epoch(swarm, worker, options), name="stage-epoch")
    averaging = None
    if averager is not None:
        sync = config.sync
        board = RoundBoard(swarm, run_id=options.run_id, stage=options.stage, method=sync.method,
                           ttl=sync.matchmaking_s + sync.request_s)
        averaging = AveragingLoop(worker, averager, sync, seed=config.seed, board=board, stats=stats)
        if averaging_state is not None:
            try:
                averaging.load_state_dict(averaging_state)
            except ValueError as error:  # another method or slicing than this run's: start afresh
                logger.warning("not resuming the averaging state: %s", error)
        await averaging.start()
    checkpoints = None
    if options.checkpoint_dir and not options.serve_checkpoint:
        checkpoints = StageCheckpointer(worker, options.checkpoint_dir, config, options.checkpoint_every, averaging)
        await checkpoints.start()
    if options.ready_file:
        write_ready_file(options.ready_file, [worker.address, swarm.peer_id])
    logger.info("joined run %r as stage %d at %s (peer %s, %d tokens/sequence)", options.run_id, options.stage,
                worker.address, swarm.peer_id, seq_len,
                extra={"milestone": "joined", "fields": {"role": "worker", "stage": options.stage, "run": options.run_id,
                                                         "endpoint": worker.address, "peer": swarm.peer_id,
                                                         "metrics": metrics_endpoint}})
    await stop.wait()

    if revoked:
        logger.error("leaving the run: the credential was revoked (%s)", revoked[0])
    logger.info("leaving: withdrawing the record, finishing in-flight work")
    phase = worker.phase
    worker.phase = "leaving"
    if renewer is not None:
        await renewer.stop()
    follow.cancel()
    await heartbeat.stop(withdraw=True)
    if averaging is not None:
        await averaging.stop()
    if checkpoints is not None:
        await checkpoints.stop()
    await worker.stop()
    if checkpoints is not None:
        # The compute thread is shut down now; nothing else touches the stage, so save here.
        await checkpoints.final(worker.compute, phase=phase)
    if averaging is not None:
        averaging.stats.local_steps = worker.compute.optimizer.steps  # the loop polls it; take the final count
        stats = averaging.stats.snapshot()
        logger.info("averaging: %s", stats)
        if options.stats_file:
            write_ready_file(options.stats_file, [json.dumps(stats)])  # atomic: never half a file
    return EXIT_REVOKED if revoked else 0


def run_worker(config: RunConfig, options: JoinOptions, worker_options: WorkerOptions,
               credentials: NodeCredentials | None = None) -> int:
    """Blocking: serve until a signal, return the exit code. `credentials`: the node's
    `NodeCredentials` (a worker credential for this run and stage); None serves --insecure."""
    from agora.node.rpc.server import run as run_loop

    n_stages = len(config.layer_split)
    if not 0 <= options.stage < n_stages:
        raise ConfigError(f"--stage: {options.stage} out of range for {n_stages} stages")
    # hivemind forks its DHT process: start it before any gRPC server or torch thread exists.
    security = DHTSecurity.from_state_dir(credentials.directory) if credentials is not None else None
    announce = None
    if worker_options.announce_host and options.dht_port:
        announce = host_maddrs(worker_options.announce_host, options.dht_port)
    swarm = SwarmDHT.start(initial_peers=options.initial_peers, announce_maddrs=announce,
                           host_maddrs=host_maddrs(options.dht_host, options.dht_port), security=security)
    averager = None
    # Its server thread starts inside _serve, after both forks.
    metrics = NodeMetrics.for_role(options.metrics, role="worker", run_id=options.run_id, version=package_version(),
                                   stage=options.stage)
    try:
        # Synchronous mode has one replica per stage by definition: nothing to average with.
        if config.sync.method != "none" and not worker_options.synchronous and not worker_options.serve_only:
            # forks too: before the gRPC server
            averager = _start_averager(config, options, swarm, security, worker_options.local_batch)
        return run_loop(_serve(config, options, worker_options, swarm, averager, credentials, metrics))
    finally:
        metrics.close()
        if averager is not None:
            averager.shutdown()
        swarm.shutdown()
