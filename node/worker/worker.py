"""`StageWorker`: one replica of one pipeline stage, served over gRPC (agora.v1.Stage).

Design choices:
- One grpc.aio server on the process's event loop (uvloop where available, node/rpc/server.py);
  every handler sits behind one interceptor chain (logging first, then whatever the caller adds:
  metrics, credential checks), plus standard health checking and reflection.
- Compute runs on ONE dedicated thread (`stage-compute`), the only place that touches the stage,
  its optimizer and its stash (`StageCompute`). Work for it is FIFO, so a Step barrier runs after
  every request admitted before it. Others (checkpoints, averaging) get the same thread through
  `on_compute`.
- What each Stage call goes through (bounded admission, queue slots and credits, its job on the
  compute thread, the status a failure maps to) is `StageService`'s (node/worker/service.py); the
  worker builds it, serves it and reports its load and credits.
- Graceful stop: health goes NOT_SERVING, new calls are refused, in-flight calls get `grace_s`
  to finish, then the compute thread drains and exits.
- Trust (docs/design.md "Admission and trust"): with a `NodeCredentials` the port is mutual TLS with
  the node's credential (node/rpc/tls.py; a renewed credential is served on new connections
  without a restart), and every call passes `CallerCheck` (node/rpc/auth_check.py): the caller's
  credential, its role for the method, and the run fingerprint the request carries. Without
  credentials (`--insecure`) the port is plaintext, callers are anonymous, and the fingerprint is
  still checked. Forward, Backward and Abort run as the caller (`Caller.owner`): a microbatch
  belongs to whoever ran its forward (PERMISSION_DENIED for anyone else, ALREADY_EXISTS for a
  Forward reusing a pending id). A training Forward of unit u and a Step reporting u done are taken
  from u's lease holder only (`unit_holders`, node/worker/work_gate.py: PERMISSION_DENIED naming
  the unit and its holder, INVALID_ARGUMENT for a work key naming no unit of the run, UNAVAILABLE
  when the DHT does not answer). Refusals are counted by reason (`refusals`).
- Weight sync: every training worker also serves its state to joining replicas of its stage
  (`DownloadState`, node/membership/state_transfer.py, `max_state_downloads` at once). A worker in
  phase weight_sync refuses Forward and Backward (FAILED_PRECONDITION): its weights are not the
  stage's yet. It still counts completed-batch reports, so it keeps the stage's epoch.
- Inference (Prefill, Decode, CloseSession) is served by node/inference/service.py on the same
  server and compute thread, with queue slots of its own; `serve_only` (join --serve-only) makes a
  worker that answers inference alone: phase "serving" (trainers never route to it), and every
  training call is FAILED_PRECONDITION.
- Metrics (`metrics`, monitor/worker_metrics.py): each Forward/Backward job's tokens, queue wait
  and compute time, every step's learning rate and gradient norm (a step hook), and at scrape
  time the load, phase, step, throughput and refusals; the gRPC layer counts calls, codes and bytes
  (node/rpc/metrics_hook.py, passed in `outer_interceptors`, so refusals by the credential check
  are counted too). A phase change is a milestone log line.
- Receipts: a trainer hands the worker its signed receipt for each interval (DeliverReceipt); with
  credentials the worker verifies it against the run's root and keeps it in `receipts.sqlite` in its
  state dir (node/worker/receipts.py), under --insecure it refuses it (nothing to verify against).
  The same for the attestations the other members of its averaging rounds sign for it
  (DeliverAttestation, node/worker/attestations.py; `attestations.rounds` is set by whoever runs
  its averaging loop: until then it refuses them).
- Link probes: a would-be member of its stage, holding the probe credential a Join's dry run issued,
  times its link to this worker (ProbeLink, node/worker/link_probe.py), within bounds per probe and
  per caller and in a call pool of its own.
- The announced address (`address`, what join puts in the DHT record) is `announce_host` when
  given, else the bound host, and never a wildcard (node/rpc/server.announced_host).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence, TypeVar

import grpc

from agora.auth.credentials import CredentialVerifier
from agora.auth.node_state import NodeCredentials
from agora.dht.records import PHASE_TRANSITIONS, PHASES, START_PHASES, Phase
from agora.node.inference.service import InferenceService
from agora.node.rpc.auth_check import CallerCheck, RefusalCounts, caller_owner, nobody_banned
from agora.node.rpc.call_slots import LINK_PROBE_CALLS, CallSlots
from agora.node.rpc.interceptors import interceptor_chain
from agora.node.rpc.server import (
    add_health_and_reflection,
    announced_host,
    bind,
    create_server,
    host_port,
    set_serving,
    slow_start_hint,
)
from agora.node.rpc.tls import server_credentials
from agora.node.replica.bounds import RequestGeometry, Slot
from agora.node.replica.compute import StageCompute
from agora.node.worker.flow import Credits, FlowControl
from agora.node.worker.unit_holders import UnitHolders
from agora.node.worker.work_gate import WorkGate
from agora.node.worker.options import WorkerOptions
from agora.node.worker.attestations import AttestationService, KeptAttestations
from agora.node.worker.link_probe import LinkProbeService
from agora.node.worker.receipts import RECEIPTS_FILE, KeptReceipts, ReceiptService
from agora.node.worker.service import JobTimes, StageService
from agora.node.replica.stash import ForwardStash
from agora.node.membership.state_transfer import StateDonor
from agora.monitor.worker_metrics import WorkerMetrics
from agora.pipeline.codec import WireCodec
from agora.pipeline.optim import lr_at
from agora.pipeline.config import ConfigError, RunConfig
from agora.pipeline.fingerprint import RunFingerprint, run_fingerprint
from agora.pipeline.wire_scale import WireScale
from agora.protos.stage_adapter import SERVICE_NAME, InfoReply, add_stage_service
from agora.protos.attestation_adapter import attestation_method_handlers
from agora.protos.link_probe_adapter import link_probe_method_handlers
from agora.protos.receipt_adapter import receipt_method_handlers
from agora.protos.state_adapter import state_method_handlers

__all__ = ["WorkerOptions", "StageWorker"]

T = TypeVar("T")


class StageWorker:
    """Serves one replica of stage `stage_index` of `config` for run `run_id`.

    Use as `async with StageWorker(...) as worker:` or `await worker.serve()`; construct it inside
    the event loop that will serve it.
    """

    def __init__(self, config: RunConfig, stage_index: int, *, run_id: str,
                 options: WorkerOptions = WorkerOptions(),
                 credentials: Optional[NodeCredentials] = None,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 clock: Callable[[], float] = time.monotonic, logger: logging.Logger | None = None,
                 fingerprint: Optional[RunFingerprint] = None, metrics: Optional[WorkerMetrics] = None,
                 outer_interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 unit_holders: Optional[UnitHolders] = None, banned: Callable[[str], bool] = nobody_banned):
        """`credentials`: the node's state directory (mutual TLS and per-call checks); None serves
        plaintext to anonymous callers (--insecure). `fingerprint`: this run's, by default
        `run_fingerprint(config)`; callers must send the same with every Stage request.
        `interceptors` run after the per-call credential check, `outer_interceptors` before it
        (they see every call, refused ones included: the gRPC metrics hook). `unit_holders`: the
        units' lease holders, the only callers whose work and reports of a unit are taken (with
        `credentials`; node/worker/unit_holders.py). `banned`: whether
        the run's ban list names a peer (`SwarmDHT.bans.is_banned`); its calls are refused."""
        self.config = config
        self.stage_index = stage_index
        self.run_id = run_id
        self.options = options
        self.options.inference.validate(self.config)
        self._phase = Phase.SERVING if options.serve_only else Phase.MEMBER
        self._clock = clock
        self._logger = logger or logging.getLogger("agora.node.worker")
        self.credentials = credentials
        if credentials is not None:
            _check_own_credential(credentials, run_id, stage_index)
        self.fingerprint = fingerprint if fingerprint is not None else run_fingerprint(self.config)
        # What a request may declare and carry (node/replica/bounds.py); a bad max_rows fails here.
        self.geometry = RequestGeometry.from_config(self.config, stage_index, self.options.max_rows)
        self.refusals = RefusalCounts()  # refused calls by reason (auth, fingerprint, ownership)
        check = CallerCheck(fingerprint=self.fingerprint, credentials=credentials, refusals=self.refusals, clock=clock,
                            banned=banned)
        self._interceptors = interceptor_chain(check, *interceptors, outer=outer_interceptors, clock=clock)
        self._announced_host: str | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self._compute: StageCompute | None = None
        self._inference: InferenceService | None = None
        self._server: grpc.aio.Server | None = None
        self._health = None
        self._port: int | None = None
        self._stopping: asyncio.Task | None = None
        self._metrics = metrics
        # Whose work and reports of a unit are taken (node/worker/work_gate.py); None: anyone's.
        self._gate = None if unit_holders is None or credentials is None else WorkGate(
            unit_holders, stage=stage_index, microbatches=config.train.microbatches, is_tail=self.geometry.is_tail,
            per_caller=options.stash_capacity, refusals=self.refusals, logger=self._logger)
        # Each call's admission, its run on the compute thread and the status of its failure.
        self._service = StageService(self, clock=clock, logger=self._logger, metrics=metrics, gate=self._gate)
        # Serves this replica's state to joining ones (DownloadState); None for a serve-only worker.
        self.state_donor: StateDonor | None = None
        # Keeps the receipts trainers deliver for this worker's work (DeliverReceipt); built at start.
        self.receipts: ReceiptService | None = None
        # Keeps the attestations of the averaging rounds it joined (DeliverAttestation); built at start.
        self.attestations: AttestationService | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the worker is not started")
        return self._port

    @property
    def address(self) -> str:
        """The host:port peers dial (announced host, real port); see `WorkerOptions.announce_host`."""
        if self._announced_host is None:
            raise RuntimeError("the worker is not started")
        return host_port(self._announced_host, self.port)

    @property
    def secure(self) -> bool:
        return self.credentials is not None

    @property
    def compute(self) -> StageCompute:
        """The stage replica. Touch it only through `on_compute`, or after `stop()` returned."""
        if self._compute is None:
            raise RuntimeError("the worker is not started")
        return self._compute

    @property
    def load(self) -> int:
        return self._service.slots.in_use

    @property
    def control_load(self) -> int:
        """Step and Abort calls admitted and not finished (their own pool: `max_control_queue`)."""
        return self._service.control_slots.in_use

    @property
    def flow(self) -> FlowControl:
        """The callers' credits; what a caller new to this worker gets is `flow.grant(None)`."""
        return self._service.flow

    @property
    def compute_errors(self) -> int:
        """Calls failed on this replica's own non-finite result (its watchdog reads it)."""
        return self._service.compute_errors

    @property
    def job_times(self) -> JobTimes:
        """Its Forward and Backward jobs' wall and CPU time so far (node/worker/service.py's `JobTimes`)."""
        return self._service.job_times

    @property
    def is_serving(self) -> bool:
        """Started and not stopping: the readiness handshake for whoever launched it."""
        return self._server is not None and self._stopping is None

    @property
    def phase(self) -> Phase:
        return self._phase

    @phase.setter
    def phase(self, phase: Phase | str) -> None:
        # The sync phases (node/membership/phases.py) move the worker through its life; Info and the DHT
        # report it. A move the life does not have is a bug in the caller: refused, never announced.
        phase = Phase(phase)
        if phase == self._phase:
            return
        if phase not in PHASE_TRANSITIONS[self._phase]:
            raise ValueError(f"stage {self.stage_index} worker: no move from phase {self._phase} to {phase}")
        self._logger.info("stage %d worker: phase %s -> %s", self.stage_index, self._phase, phase,
                          extra={"milestone": "phase_changed",
                                 "fields": {"stage": self.stage_index, "from": self._phase, "to": phase}})
        self._phase = phase

    def start_in_phase(self, phase: Phase | str) -> None:
        """The phase the worker starts in, set before anything has seen another (its first DHT
        announce): no phase_changed milestone, since it never was in the default one."""
        phase = Phase(phase)
        if phase not in START_PHASES:
            raise ValueError(f"a worker starts in one of {', '.join(sorted(START_PHASES))}, not {phase}")
        self._phase = phase

    def _build_compute(self) -> StageCompute:
        options = self.options
        return StageCompute(
            self.config, self.stage_index, run_id=self.run_id,
            codec=WireCodec(options.wire_dtype, max_bytes=options.max_stream_bytes),
            stash=ForwardStash(options.stash_capacity, options.stash_ttl_s, clock=self._clock),
            synchronous=options.synchronous, local_batch=options.local_batch,
            pinned_versions=options.pinned_weights, keep_graphs=options.keep_graphs,
            output_grad_scale=None if self.geometry.is_tail else WireScale(options.gradient_bound_factor,
                                                                            options.gradient_bound_warmup),
        )

    async def start(self) -> int:
        """Build the stage (on the compute thread), listen, and return the real port."""
        if self._server is not None:
            return self.port
        # Built on the compute thread so that it is the only thread that ever touches the stage.
        self._compute = await asyncio.wrap_future(self._executor.submit(self._build_compute))
        self._inference = InferenceService(
            self.config, self.stage_index, run_id=self.run_id, options=self.options.inference, geometry=self.geometry,
            codec=self._compute.codec, submit=self.submit_compute, refusals=self.refusals, clock=self._clock)
        if self._metrics is not None:
            self._watch(self._metrics, self._compute)
        slots = CallSlots(calls=self.options.concurrent_rpcs, probe_calls=self.options.max_probe_calls,
                          link_probe_calls=LINK_PROBE_CALLS,
                          calls_setting="worker.max_concurrent_rpcs", probe_setting="worker.max_probe_calls",
                          owner=caller_owner, refused=self.refusals.add, logger=self._logger)
        server = create_server(interceptors=self._interceptors, max_message_bytes=self.options.max_message_bytes,
                               max_receive_bytes=self.geometry.message_budget(), slots=slots)
        # The registration-wide bound only limits how much of a refused stream is read (and dropped)
        # so that its client sees the status (grpc/grpc#36066); an admitted stream is read under its
        # own method's budget from the geometry (`_admit`).
        if not self.options.serve_only and self.options.max_state_downloads:
            self.state_donor = StateDonor(self, max_downloads=self.options.max_state_downloads,
                                          chunk_bytes=self.options.stream_chunk_bytes, clock=self._clock)
        self.receipts = ReceiptService(self._open_receipts(), metrics=self._metrics, logger=self._logger)
        self.attestations = AttestationService(self._open_attestations(), stage=self.stage_index,
                                               metrics=self._metrics, logger=self._logger)
        add_stage_service(server, self._service, max_stream_bytes=self.options.max_stream_bytes,
                          chunk_bytes=self.options.stream_chunk_bytes, stream_timeout_s=self.options.stream_timeout_s,
                          inference=self._inference,
                          extra={**(state_method_handlers(self.state_donor) if self.state_donor is not None else {}),
                                 **receipt_method_handlers(self.receipts),
                                 **attestation_method_handlers(self.attestations),
                                 **link_probe_method_handlers(LinkProbeService(
                                     self.stage_index, logger=self._logger, refused=self.refusals.add))})
        self._health = add_health_and_reflection(server, [SERVICE_NAME])
        tls = server_credentials(self.credentials) if self.credentials is not None else None
        self._announced_host = announced_host(self.options.host, self.options.announce_host)
        self._port = bind(server, self.options.host, self.options.port, tls)
        await server.start()
        await set_serving(self._health, [SERVICE_NAME], True)
        self._server = server
        if tls is None:
            self._logger.warning("stage %d worker serves WITHOUT TLS or credentials (--insecure): any process that "
                                 "reaches %s can call it", self.stage_index, self.address)
        hint = slow_start_hint()
        if hint is not None:
            self._logger.info("%s", hint)
        self._logger.info("stage %d/%d worker of run %r serving on %s (bound %s, %s mode, %s)", self.stage_index,
                          self._compute.n_stages, self.run_id, self.address,
                          host_port(self.options.host, self._port),
                          "synchronous" if self.options.synchronous else "asynchronous",
                          "mutual TLS" if tls is not None else "insecure")
        return self._port

    def _open_receipts(self) -> KeptReceipts | None:
        """The receipts trainers deliver, kept in the state dir (node/worker/receipts.py); None under --insecure."""
        if self.credentials is None:
            return None
        verifier = CredentialVerifier(self.credentials.root_pem(), self.run_id, clock=time.time)
        return KeptReceipts(self.credentials.directory / RECEIPTS_FILE, self.credentials.peer_id, verifier)

    def _open_attestations(self) -> KeptAttestations | None:
        """The round attestations the stage's other replicas deliver, kept beside the receipts, each store
        with a verifier of its own (node/worker/attestations.py); None under --insecure."""
        if self.credentials is None:
            return None
        verifier = CredentialVerifier(self.credentials.root_pem(), self.run_id, clock=time.time)
        return KeptAttestations(self.credentials.directory / RECEIPTS_FILE, self.credentials.peer_id,
                                self.stage_index, verifier)

    def _watch(self, metrics: WorkerMetrics, compute: StageCompute) -> None:
        metrics.watch(load=lambda: self.load, capacity=self.options.queue_capacity,
                      step=lambda: compute.optimizer.steps,
                      throughput=lambda: compute.throughput, phase=lambda: self.phase, phases=PHASES,
                      refusals=self.refusals.snapshot, callers=self.flow.active_callers,
                      queue_target=self.flow.queue_target)
        scale = compute.output_grad_scale
        if scale is not None:
            metrics.watch_output_grads(scale=lambda: scale.scale or float("nan"), peak_ratio=lambda: scale.peak_ratio)

        def stepped(compute: StageCompute) -> None:  # compute thread, right after each step
            steps, last = compute.optimizer.steps, compute.last_step
            metrics.stepped(lr_at(max(0, steps - 1), compute.config.optim),
                            last.grad_norm if last is not None and last.step == steps else None)

        compute.step_hooks.append(stepped)

    async def stop(self, grace_s: float | None = None) -> None:
        """Refuse new calls, let in-flight ones finish (up to `grace_s`), then stop the compute thread."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(self.options.grace_s if grace_s is None else grace_s))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace_s: float) -> None:
        self.phase = Phase.LEAVING
        if self._server is not None:
            await self._health.enter_graceful_shutdown()
            await self._server.stop(grace_s)
        # Jobs of calls that gave up may still be queued or running; wait for them off the loop.
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        if self.receipts is not None and self.receipts.kept is not None:
            self.receipts.kept.close()
        if self.attestations is not None:
            self.attestations.close()
        self._log_output_grad_scale()
        self._logger.info("stage %d worker on port %s stopped", self.stage_index, self._port)
        if self._gate is not None:
            await self._gate.close()

    def _log_output_grad_scale(self) -> None:
        """How far the output gradients it took came to its bound, and how many it refused: a line at leave."""
        scale = None if self._compute is None else self._compute.output_grad_scale
        if scale is None or not scale.accepted:
            return
        self._logger.info("stage %d: %d output gradients accepted, %d refused beyond %g times their scale %.3g; the "
                          "largest accepted was %.3g times it", self.stage_index, scale.accepted, scale.refused,
                          scale.factor, scale.scale, scale.peak_ratio,
                          extra={"milestone": "output_grad_scale",
                                 "fields": {"stage": self.stage_index, "accepted": scale.accepted,
                                            "refused": scale.refused, "scale": scale.scale, "factor": scale.factor,
                                            "peak_ratio": scale.peak_ratio}})

    async def serve(self) -> None:
        """Start (if needed) and serve until stopped; cancelling this stops gracefully."""
        await self.start()
        try:
            await self._server.wait_for_termination()
        finally:
            await self.stop()

    async def __aenter__(self) -> "StageWorker":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    # ------------------------------------------------------------------ compute thread

    async def on_compute(self, fn: Callable[[StageCompute], T]) -> T:
        """Run `fn(compute)` on the compute thread, in FIFO order with requests (not counted in load)."""
        if self._compute is None:
            raise RuntimeError("the worker is not started")
        return await asyncio.wrap_future(self._executor.submit(fn, self._compute))

    def submit_compute(self, fn: Callable[[StageCompute], T], slot: Slot | None = None) -> Future:
        """`fn(compute)` on the compute thread, FIFO with every request; `slot` is given back when the job
        ends (the inference service's calls run this way)."""
        future = self._executor.submit(fn, self._compute)
        if slot is not None:
            slot.hand_off(future)
        return future

    def info(self, owner: str | None = None) -> InfoReply:
        """Stage, step, phase and load; the credits are `owner`'s (None: a caller new to this worker)."""
        compute = self._compute
        credits: Credits = self.flow.grant(owner)
        return InfoReply(
            run_id=self.run_id, stage=self.stage_index, n_stages=compute.n_stages,
            # Plain int reads of compute-thread state: a momentarily stale value is fine for routing.
            step=compute.optimizer.steps, phase=self.phase, load=self.load, capacity=self.options.queue_capacity,
            stashed=len(compute.stash), synchronous=self.options.synchronous, throughput=compute.throughput,
            sessions=len(self._inference.sessions), session_capacity=self._inference.sessions.max_sessions,
            credits=credits.calls, in_flight_credits=credits.in_flight,
        )


def _check_own_credential(credentials: NodeCredentials, run_id: str, stage: int) -> None:
    """A worker serves only under a worker credential of its own run and stage."""
    identity = credentials.identity()
    if identity.role != "worker":
        raise ConfigError(f"credential in {credentials.directory}: a worker needs a worker credential, "
                          f"this one is a {identity.role} credential")
    if identity.run_id != run_id:
        raise ConfigError(f"credential in {credentials.directory}: it is for run {identity.run_id!r}, "
                          f"this worker serves run {run_id!r}")
    if identity.stage != stage:
        raise ConfigError(f"credential in {credentials.directory}: it is for stage {identity.stage}, "
                          f"this worker serves stage {stage}")
