"""`agora-node join`: the contributor's daemon, hosting ONE replica of ONE stage.

Life: start a DHT peer (joining through `--initial-peers`), build the stage and serve it over
gRPC, announce it in the DHT every few seconds (endpoint, stage, throughput, queue, step, phase),
and on SIGTERM/SIGINT leave cleanly: mark itself leaving, withdraw the DHT record so trainers stop
routing to it, tell the authorizer (its slot frees at once), finish in-flight calls, write an atomic
checkpoint of its stage, exit 0. Its watchdog (node/worker/watchdog.py) leaves the same way when a
rule of `worker.watchdog` trips (non-finite gradients, memory, a stalled compute thread, failing
averaging or renewal, its own id banned), and exits with that rule's code. A second
SIGTERM/SIGINT during that leave stops it at once (exit 130): the record expires as after a crash,
the DHT and averager processes follow their owner, the newest complete checkpoint stays.
With `serve_checkpoint` (join --serve-only) it serves inference only, on that checkpoint's
weights (node/inference/serving.py): no training call, no averaging, nothing written when it leaves.
A kill -9 needs nobody's cooperation: the record expires after ~3 missed heartbeats and trainers
reroute. With `--checkpoint-dir` holding a checkpoint of the same stage, the worker resumes it.
Unless the run's `sync.method` is "none" (or the worker is in synchronous mode, one replica per
stage), it averages with the other replicas of its stage in the background (node/averaging/loop.py)
and, with `--stats-file`, writes the averaging counters there as JSON when it leaves. An admitted
worker attests the other members of each round it completes and keeps their attestations of it
(node/averaging/round_attestations.py, node/worker/attestations.py).
With `--metrics-port` it serves Prometheus metrics (worker, gRPC, averaging, credential; see
monitor/) and names the endpoint in its DHT record, with its averaging counts.
A replica that joins a stage whose members are ahead of it goes through the sync phases first
(node/membership/phases.py): weight sync (the stage's state downloaded from a member,
node/membership/state_download.py; averaging with weight 0 for a rotation), optimizer sync, member.
Every training worker serves its own state to the next joiner (node/membership/state_transfer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
from dataclasses import dataclass

from agora.auth.admission import CredentialRenewer
from agora.dht.security import DHTSecurity
from agora.auth.node_state import NodeCredentials
from agora.dht.averaging import SliceAverager
from agora.dht.averaging_admission import AveragingAdmission
from agora.dht.round_board import RoundBoard
from agora.dht.bootstrap import host_maddrs, write_ready_file
from agora.dht.heartbeat import Heartbeat
from agora.dht.leases import read_block
from agora.dht.keys import averaging_prefix, move_key
from agora.dht.records import TRAINING_PHASES, MoveRecord, Phase, WorkerRecord
from agora.dht.robust import RobustAggregation
from agora.dht.swarm import SwarmDHT
from agora.monitor.dht_metrics import DHTMetrics
from agora.monitor.metrics import CredentialMetrics
from agora.monitor.weight_sync_metrics import WeightSyncMetrics
from agora.monitor.worker_metrics import RpcServerMetrics, WorkerMetrics
from agora.node.admission import starting_dht_security
from agora.node.averaging.loop import AveragingLoop
from agora.node.averaging.round_attestations import attest_rounds
from agora.node.averaging.sparta import (
    SlicePartition,
    averaged_vector_size,
    max_round_weight,
    second_moment_offset,
    stage_parameter_numels,
)
from agora.node.averaging.stats import AveragingStats
from agora.node.observability import MetricsOptions, NodeMetrics, package_version
from agora.node.rpc.metrics_hook import MetricsHook
from agora.node.tracing_export import start_tracing, traced_calls
from agora.node.replica.epoch import stage_step
from agora.node.worker.join_options import JoinOptions
from agora.node.worker.unit_holders import UnitHolders
from agora.node.worker.watchdog import NodeHealth, Watchdog
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.node.replica.checkpoints import StageCheckpointer, restore_stage
from agora.node.membership.phases import StageView, SyncPhases, SyncPolicy
from agora.node.membership.rebalance import Move, RebalancePolicy, Rebalancer
from agora.node.membership.state_check import StateSketch, norms_of
from agora.node.membership.state_download import StateDownloader, plan_donors
from agora.node.membership.state_transfer import apply_state, expected_state_bytes
from agora.node.membership.state_verify import StateChecks
from agora.node.rpc.tls import InsecureChannels, TlsChannels
from agora.pipeline.checkpoint import CheckpointError, checkpoint_steps, read_meta
from agora.pipeline.config import ConfigError, RunConfig
from agora.pipeline.fingerprint import run_fingerprint

__all__ = ["EXIT_REVOKED", "EXIT_STOPPED_NOW", "WorkerExit", "run_worker", "package_version"]

# Exit status of a worker that left because its credential was revoked (banned) or ran out.
EXIT_REVOKED = 3
# Exit status of a worker stopped by a second signal before its leave finished.
EXIT_STOPPED_NOW = 130


@dataclass(frozen=True)
class WorkerExit:
    """How the daemon ended: its exit code, and the stage it left to host instead (rebalancing,
    node/membership/rebalance.py), which the command line starts it again on."""

    code: int
    move_to: int | None = None

logger = logging.getLogger("agora.node.join")


def _start_averager(config: RunConfig, options: JoinOptions, swarm: SwarmDHT, security: DHTSecurity | None,
                    local_batch: int | None) -> SliceAverager:
    """The stage's averager process, sized for one round of `config.sync.method` (forks: call early)."""
    sync = config.sync
    numels = stage_parameter_numels(config.model, options.stage)
    buffer_size = SlicePartition(numels, sync.n_slices, config.seed).buffer_size
    size = averaged_vector_size(sync, buffer_size)
    robust = RobustAggregation(sync.aggregation, max_weight=max_round_weight(sync, config.train.batch_size, local_batch),
                               nonnegative_from=second_moment_offset(sync, buffer_size))
    return SliceAverager.start(
        swarm.hivemind_dht, prefix=averaging_prefix(options.run_id, options.stage, sync.method), size=size,
        matchmaking_s=sync.matchmaking_s, request_s=sync.request_s, sender_s=sync.sender_s,
        reducer_s=sync.reducer_s, round_s=sync.round_s, part_size_bytes=sync.part_size_bytes,
        admission=AveragingAdmission.for_node(security, options.stage) if security is not None else None,
        robust=robust, banned=lambda: swarm.bans.banned)


async def _follow_stage_epoch(swarm: SwarmDHT, worker: StageWorker, options: JoinOptions) -> None:
    """Every heartbeat: give the compute the step count the stage's other replicas announce (their
    median; node/replica/epoch.py), against which it judges a first or far-off completed-batch report."""
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
                 metrics: NodeMetrics | None = None) -> WorkerExit:
    """Start the node's parts, serve until a signal, a revocation or a move, then leave.

    Each part's stop goes on one exit stack the moment the part has started, so whatever started is
    stopped on every path, an exception halfway through the start included. The stack unwinds in
    reverse: the periodic checkpoints, averaging, the renewer, the gRPC server, and last the final
    checkpoint (only on a clean leave: a start that failed halfway has no state worth keeping). Two
    steps must come before all of that and are pushed last so that they run first (`withdraw`):
    nothing may decide a phase or a move any more, and the record is withdrawn while averaging
    still winds down, so trainers stop routing here as early as possible; right after it the
    authorizer is told (`tell_authorizer`: the slot frees at once, a few seconds at most). The
    watchdog and the renewer stop as the leave begins: a credential outlasts a leave, and at a run's
    end the authorizer is going too.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    metrics = metrics if metrics is not None else NodeMetrics(MetricsOptions())
    registry = metrics.registry
    revoked: list[str] = []
    moves: list[Move] = []
    left_phase: list[str] = []  # the phase it left from, once it leaves cleanly
    checkpoints = averaging = phases = None
    async with contextlib.AsyncExitStack() as stack:
        # With credentials: mutual TLS and per-call checks (node/rpc/auth_check.py); None: --insecure.
        worker_metrics = WorkerMetrics(registry)
        tracing = start_tracing(worker_options.tracing, "worker", run_id=options.run_id)  # after the forks
        if tracing is not None:
            stack.callback(tracing.close)  # runs after the server's stop: its last spans are flushed
        worker = StageWorker(config, options.stage, run_id=options.run_id, options=worker_options,
                             credentials=credentials, outer_interceptors=[MetricsHook(RpcServerMetrics(registry))],
                             interceptors=traced_calls(tracing),
                             metrics=worker_metrics, unit_holders=_unit_holders(swarm, options, credentials),
                             banned=swarm.bans.is_banned)

        async def final_checkpoint() -> None:
            if checkpoints is not None and left_phase and not moves:  # a mover's state stays with its old stage
                # The compute thread is shut down now; nothing else touches the stage, so save here.
                await checkpoints.final(worker.compute, phase=left_phase[0])

        stack.push_async_callback(final_checkpoint)
        await worker.start()
        stack.push_async_callback(worker.stop)
        renewer = None
        if credentials is not None and options.authorizer:
            def on_revoked(reason: str) -> None:  # banned, or the credential ran out: leave the run
                revoked.append(reason)
                stop.set()

            renewer = CredentialRenewer(options.authorizer, credentials, on_revoked=on_revoked)
            renewer.start()
            stack.push_async_callback(renewer.stop)
        if credentials is not None:
            CredentialMetrics(registry, credentials.remaining_s,
                              lambda: renewer.renewals if renewer is not None else 0)
        DHTMetrics(registry, swarm.bans, swarm.timings, swarm.traffic)
        stats = AveragingStats(config.sync.method, registry=registry) if averager is not None else None
        watchdog = Watchdog(worker_options.watchdog, NodeHealth.of(worker, swarm, stats, renewer).sample,
                            on_trip=lambda trip: stop.set(), metrics=worker_metrics)
        watchdog.start()
        stack.push_async_callback(watchdog.stop)
        metrics_endpoint = metrics.serve(worker_options.announce_host)
        step, saved, averaging_state = await _restore(worker, config, options)
        members = _stage_members(swarm, options, config, await worker.on_compute(lambda c: c.report_window.ahead))
        if not options.serve_checkpoint:  # before the first announce: a joiner is never routed by mistake
            phases = SyncPhases(worker, SyncPolicy.from_config(config.sync),
                                config.sync if averager is not None else None)
            stack.push_async_callback(phases.stop)
            if options.sync_phases:
                resumed = None if saved is None else saved.get("phase", Phase.MEMBER)
                await phases.begin(own_step=step, resumed_phase=resumed, members=members)
            else:
                phases.enter(Phase.MEMBER, "join --no-sync-phases")
        heartbeat = Heartbeat(swarm, _record_of(worker, swarm, config, options, stats, metrics_endpoint),
                              interval=options.heartbeat_s)
        await heartbeat.start()
        stack.push_async_callback(heartbeat.stop)
        follow = asyncio.create_task(_follow_stage_epoch(swarm, worker, options), name="stage-epoch")
        stack.push_async_callback(_cancelled, follow)
        if phases is not None and phases.phase == Phase.WEIGHT_SYNC:
            downloaded = await _weight_sync(phases, worker, config, options, members, credentials, stop,
                                            WeightSyncMetrics(registry))
            if downloaded is not None:
                averaging_state = downloaded.tree.get("averaging")
        if averager is not None:
            averaging = _averaging_loop(worker, averager, swarm, config, options, stats, averaging_state)
            if credentials is not None:  # its rounds, attested by their other members (nothing under --insecure)
                attester = attest_rounds(worker, averaging, credentials, lambda: swarm.live_workers_async(
                    options.run_id, options.stage), worker_metrics)
                stack.push_async_callback(attester.close)  # after the loop stops: its last round is attested too
            await averaging.start()
            stack.push_async_callback(averaging.stop)
        if worker.state_donor is not None:
            worker.state_donor.averaging = averaging  # a snapshot for a joiner carries the loop's state
        if phases is not None and phases.phase != Phase.MEMBER:
            await phases.start(averaging)
        rebalancer = None
        # A move needs a credential for the other stage: from the authorizer, or none at all (--insecure).
        if options.rebalance and not options.serve_checkpoint and not worker_options.synchronous and (
                credentials is None or options.authorizer):
            def on_move(move: Move) -> None:
                if not stop.is_set():  # a move decided while leaving would never be announced
                    moves.append(move)
                    stop.set()

            rebalancer = _rebalancer(swarm, worker, config, options, on_move)
            rebalancer.start()
            stack.push_async_callback(rebalancer.stop)
        if options.checkpoint_dir and not options.serve_checkpoint:
            checkpoints = StageCheckpointer(worker, options.checkpoint_dir, config,
                                            options.checkpoint_interval(config.train.checkpoint_every), averaging)
            await checkpoints.start()
            stack.push_async_callback(checkpoints.stop)

        async def withdraw() -> None:
            for part in (phases, rebalancer):
                if part is not None:
                    await part.stop()
            if moves:
                await _announce_move(swarm, options, moves[0])
            await heartbeat.stop(withdraw=True)

        async def tell_authorizer() -> None:  # right after the withdrawal: trainers stop routing here first
            if renewer is not None and left_phase and not revoked and not moves:  # a mover keeps its slot
                await renewer.leave(f"watchdog: {watchdog.tripped.rule}" if watchdog.tripped else "signal")

        stack.push_async_callback(tell_authorizer)
        stack.push_async_callback(withdraw)
        if options.ready_file:
            write_ready_file(options.ready_file, [worker.address, swarm.peer_id])
        logger.info("joined run %r as stage %d at %s (peer %s, %d tokens/sequence)", options.run_id, options.stage,
                    worker.address, swarm.peer_id, config.train.seq_len,
                    extra={"milestone": "joined", "fields": {"role": "worker", "stage": options.stage,
                                                             "run": options.run_id, "endpoint": worker.address,
                                                             "peer": swarm.peer_id, "metrics": metrics_endpoint}})
        await stop.wait()
        for signum in (signal.SIGINT, signal.SIGTERM):  # pressed again: the user wants it gone now
            loop.add_signal_handler(signum, _stop_now)
        if revoked:
            logger.error("leaving the run: the credential was revoked (%s)", revoked[0])
        logger.info("leaving: withdrawing the record, finishing in-flight work")
        await watchdog.stop()
        if renewer is not None:
            await renewer.stop()
        left_phase.append(worker.phase)
        worker.phase = Phase.LEAVING
    if averaging is not None:
        _write_stats(averaging, worker, phases, options)
    code = EXIT_REVOKED if revoked else watchdog.tripped.exit_code if watchdog.tripped else 0
    return WorkerExit(code, moves[0].target if moves and code == 0 else None)


def _unit_holders(swarm: SwarmDHT, options: JoinOptions, credentials: NodeCredentials | None) -> UnitHolders | None:
    """Whose work and reports of a unit this worker takes: its lease holder's, read from the DHT as
    trainers read it (node/worker/unit_holders.py); None under --insecure (no caller identities)."""
    if credentials is None:
        return None
    return UnitHolders(lambda block: read_block(swarm, options.run_id, block), clock=swarm.clock)


async def _cancelled(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _restore(worker: StageWorker, config: RunConfig, options: JoinOptions):
    """The stage's starting point: (step, the checkpoint's meta or None, its averaging state or None).
    A serve-only node loads its checkpoint's weights; a training node resumes its newest checkpoint of
    this stage, if any; else it starts at step 0."""
    if options.serve_checkpoint:
        from agora.node.inference.serving import load_serving_weights

        step = await worker.on_compute(lambda c: load_serving_weights(c, options.serve_checkpoint))
        logger.info("serving stage %d of %s (step %d), inference only", options.stage, options.serve_checkpoint, step)
        return step, None, None
    if options.checkpoint_dir and (options.resume_step is not None or (
            checkpoint_steps(options.checkpoint_dir) and _checkpoints_of_this_stage(options.checkpoint_dir, options.stage))):
        step, averaging_state, saved = await worker.on_compute(
            lambda c: restore_stage(c, options.checkpoint_dir, config, step=options.resume_step))
        logger.info("resumed stage %d at step %d from %s (it was %s)", options.stage, step, options.checkpoint_dir,
                    saved.get("phase", "a member"))
        return step, saved, averaging_state
    return 0, None, None


def _record_of(worker: StageWorker, swarm: SwarmDHT, config: RunConfig, options: JoinOptions,
               stats: AveragingStats | None, metrics_endpoint: str):
    """What the heartbeat announces, built afresh each beat from the worker's state."""
    version = package_version()
    fingerprint = run_fingerprint(config).text()  # in every record: trainers skip a mismatched run

    def record() -> WorkerRecord:
        info = worker.info()  # with the credits a trainer new to this worker would get
        return WorkerRecord(peer_id=swarm.peer_id, run_id=options.run_id, endpoint=worker.address,
                            stage=options.stage, n_stages=info.n_stages, throughput=float(info.throughput),
                            queue_depth=info.load, step=info.step, phase=info.phase, version=version,
                            updated_at=0.0, fingerprint=fingerprint, sessions=info.sessions,
                            metrics_endpoint=metrics_endpoint, capacity=info.capacity, credits=info.credits,
                            in_flight_credits=info.in_flight_credits,
                            averaging_rounds=sum(stats.rounds.values()) if stats is not None else 0,
                            averaging_committed=stats.rounds["committed"] if stats is not None else 0)

    return record


def _averaging_loop(worker: StageWorker, averager: SliceAverager, swarm: SwarmDHT, config: RunConfig,
                    options: JoinOptions, stats: AveragingStats | None, state: dict | None) -> AveragingLoop:
    """The stage's background averaging, resuming the loop's state from a checkpoint or a donor."""
    sync = config.sync
    board = RoundBoard(swarm, run_id=options.run_id, stage=options.stage, method=sync.method,
                       ttl=sync.matchmaking_s + sync.request_s)
    averaging = AveragingLoop(worker, averager, sync, seed=config.seed, board=board, stats=stats)
    if state is not None:
        try:
            averaging.load_state_dict(state)
        except ValueError as error:  # another method or slicing than this run's: start afresh
            logger.warning("not resuming the averaging state: %s", error)
    return averaging


def _write_stats(averaging: AveragingLoop, worker: StageWorker, phases: SyncPhases | None,
                 options: JoinOptions) -> None:
    averaging.stats.local_steps = worker.compute.optimizer.steps  # the loop polls it; take the final count
    stats = averaging.stats.snapshot()
    logger.info("averaging: %s", stats)
    stats["stage"] = options.stage  # the one it ended on (rebalancing moves a worker)
    stats["jobs"] = worker.job_times.snapshot()  # its compute's wall and CPU time, for the demo's summary
    if phases is not None:  # the demo's summary: each replica's phases, seconds after it started
        stats["phases"] = phases.history
    if worker.state_donor is not None:
        stats["state_served"] = {"downloads": worker.state_donor.stats.downloads,
                                 "completed": worker.state_donor.stats.completed,
                                 "bytes": worker.state_donor.stats.bytes_sent}
    if options.stats_file:
        write_ready_file(options.stats_file, [json.dumps(stats)])  # atomic: never half a file


def _stop_now() -> None:
    """A second signal while leaving: exit without the rest of the leave. The helper processes'
    owner watchdogs (dht/swarm.py) take them down as after a kill -9; checkpoints are atomic, so
    the newest complete one stays and the next write removes a half-written one."""
    logger.warning("a second signal while leaving: stopping now, without the rest of the leave")
    logging.shutdown()
    os._exit(EXIT_STOPPED_NOW)


def _checkpoints_of_this_stage(directory: str, stage: int) -> bool:
    """False (said in one line) when the newest checkpoint there is another stage's: a worker that moved
    (rebalancing) starts its new stage afresh, through weight sync, and its next checkpoints replace those."""
    try:
        held = read_meta(directory).get("stages")
    except CheckpointError:
        return True  # restore_stage falls back to an older one, or says what is wrong
    if held == [stage]:
        return True
    logger.warning("not resuming from %s: it holds stage %s, this worker hosts stage %d", directory, held, stage)
    return False


def _rebalancer(swarm: SwarmDHT, worker: StageWorker, config: RunConfig, options: JoinOptions, on_move) -> Rebalancer:
    n_stages = len(config.layer_split)
    fingerprint = run_fingerprint(config)
    interval = options.rebalance_s if options.rebalance_s is not None else 6 * options.heartbeat_s

    async def read():
        by_stage = await swarm.all_workers_async(options.run_id, n_stages, fingerprint=fingerprint)
        moves = await swarm.owned_entries_async(move_key(options.run_id), MoveRecord)
        return by_stage, [stored.record for stored in moves.values()]

    return Rebalancer(read, n_stages=n_stages, own_peer_id=swarm.peer_id, own_phase=lambda: worker.phase,
                      policy=RebalancePolicy(interval_s=interval), on_move=on_move)


async def _announce_move(swarm: SwarmDHT, options: JoinOptions, move: Move) -> None:
    """While this worker is in transit to `move.target`, nobody else moves (node/membership/rebalance.py):
    for long enough to leave, be admitted again and announce itself there."""
    record = MoveRecord(peer_id=swarm.peer_id, run_id=options.run_id, from_stage=options.stage, to_stage=move.target,
                        started_at=swarm.clock())
    try:
        await swarm.store_async(record.dht_key(), record, max(60.0, 12 * options.heartbeat_s),
                                subkey=swarm.subkey_of(record.peer_id))
    except Exception as error:  # the move goes on; a second mover is then possible, not harmful
        logger.warning("could not announce the move to stage %d: %s", move.target, error)


def _stage_members(swarm: SwarmDHT, options: JoinOptions, config: RunConfig, max_gap: int):
    """What the sync phases read: the stage's members other than this node, best donor first, those
    announcing a step more than `max_gap` from the members' agreed one set apart
    (node/membership/state_download.py), and the highest step a member of any stage announces."""
    fingerprint = run_fingerprint(config)
    rng = random.Random()

    async def members() -> StageView:
        stages = await swarm.all_workers_async(options.run_id, len(config.layer_split), fingerprint=fingerprint)
        steps = [r.step for records in stages.values() for r in records
                 if r.phase == Phase.MEMBER and r.peer_id != swarm.peer_id]
        return StageView(plan_donors(stages, options.stage, swarm.peer_id, rng, max_gap=max_gap),
                         max(steps, default=None))

    return members


async def _weight_sync(phases: SyncPhases, worker: StageWorker, config: RunConfig, options: JoinOptions, members,
                       credentials: NodeCredentials | None, stop: asyncio.Event, metrics: WeightSyncMetrics):
    """Download the stage's state (unless the daemon is told to stop first); the download or None."""
    downloader = StateDownloader(run_id=options.run_id, stage=options.stage, fingerprint=run_fingerprint(config),
                                 channels=TlsChannels(credentials) if credentials is not None else InsecureChannels(),
                                 max_bytes=await worker.on_compute(expected_state_bytes),
                                 checks=_state_checks(worker, config), timeout_s=options.state_download_s,
                                 max_message_bytes=worker.options.max_message_bytes, metrics=metrics)
    download = asyncio.create_task(phases.download(downloader, members,
                                                   lambda tree: worker.on_compute(lambda c: apply_state(c, tree))))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({download, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not download.done():
        download.cancel()
        await asyncio.gather(download, return_exceptions=True)
        return None
    return download.result()


def _state_checks(worker: StageWorker, config: RunConfig) -> StateChecks:
    """What a downloaded state must pass (node/membership/state_verify.py); the scale reference without
    a second member is this replica's own state (its initialisation or its checkpoint's)."""
    async def own() -> StateSketch:
        return await worker.on_compute(lambda compute: norms_of(compute.stage.state_dict()))

    return StateChecks.for_run(worker.options.state_check, config.optim, own)


def run_worker(config: RunConfig, options: JoinOptions, worker_options: WorkerOptions,
               credentials: NodeCredentials | None = None, metrics: MetricsOptions = MetricsOptions()) -> WorkerExit:
    """Blocking: serve until a signal, return the exit code. `credentials`: the node's
    `NodeCredentials` (a worker credential for this run and stage); None serves --insecure.
    `metrics`: where it serves Prometheus metrics (port 0: nowhere)."""
    from agora.node.rpc.server import run as run_loop

    n_stages = len(config.layer_split)
    if options.stage is None:
        raise ConfigError("--stage: a worker needs the stage it hosts (admission assigns one)")
    if not 0 <= options.stage < n_stages:
        raise ConfigError(f"--stage: {options.stage} out of range for {n_stages} stages")
    # hivemind forks its DHT process: start it before any gRPC server or torch thread exists.
    security = starting_dht_security(options.authorizer, credentials)
    announce = None
    if worker_options.announce_host and options.dht_port:
        announce = host_maddrs(worker_options.announce_host, options.dht_port)
    swarm = SwarmDHT.start(initial_peers=options.initial_peers, announce_maddrs=announce,
                           host_maddrs=host_maddrs(options.dht_host, options.dht_port), security=security)
    averager = None
    # Its server thread starts inside _serve, after both forks.
    node_metrics = NodeMetrics.for_role(metrics, role="worker", run_id=options.run_id, version=package_version(),
                                        stage=options.stage)
    try:
        # Synchronous mode has one replica per stage by definition: nothing to average with.
        if config.sync.method != "none" and not worker_options.synchronous and not worker_options.serve_only:
            # forks too: before the gRPC server
            averager = _start_averager(config, options, swarm, security, worker_options.local_batch)
        return run_loop(_serve(config, options, worker_options, swarm, averager, credentials, node_metrics))
    finally:
        node_metrics.close()
        if averager is not None:
            averager.shutdown()
        swarm.shutdown()
