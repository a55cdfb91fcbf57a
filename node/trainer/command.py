"""`agora-node trainer`: the process around a SwarmTrainer (node/trainer/trainer.py).

It joins the DHT as a client (hivemind forks its process before any event loop or gRPC channel
exists), is admitted with its credential (mutual TLS to every worker, renewed at half life; a
revoked credential ends the run as an interruption), claims the run's units from the lease queue
(node/trainer/units.py), announces itself every beat (node/trainer/announce.py), serves its
metrics, trains, evaluates on the held-out split and returns its summary; the run config's `evals`
run meanwhile against the live swarm (node/trainer/evals.py). A worker its verifier flags is
reported to the authorizer in the background (node/trainer/reports.py), where there is one. With a
credential, the work it accepted from each worker is signed into receipts (node/trainer/receipts.py),
handed to each worker (node/trainer/receipt_delivery.py) and, with a ledger (`--ledger-url`), posted
there. With `--otlp-endpoint` a sampled share of its microbatches is
traced there (node/trainer/traces.py). SIGTERM or SIGINT end the run between calls: channels
closed, the log flushed, a summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import IO

from agora.auth.node_state import NodeCredentials
from agora.node.admission import starting_dht_security
from agora.node.observability import MetricsOptions
from agora.node.rpc.tls import TlsChannels
from agora.node.tracing_export import start_tracing
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.receipts import ReceiptBook, ReceiptSender
from agora.node.trainer.reports import WorkerReports
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.traces import MicrobatchTraces
from agora.node.trainer.trainer import SwarmTrainer
from agora.pipeline.config import ConfigError, RunConfig

__all__ = ["run_swarm_trainer"]

logger = logging.getLogger("agora.node.trainer")


def run_swarm_trainer(config: RunConfig, options: TrainerOptions, *, initial_peers: tuple[str, ...],
                      steps: int, log_json: IO[str] | None = None, evaluate: bool = True,
                      credentials: NodeCredentials | None = None, authorizer: str | None = None,
                      metrics: MetricsOptions = MetricsOptions()) -> dict:
    """`agora-node trainer`: join the DHT, train this trainer's share of `steps`, evaluate; a summary.

    `credentials`: the trainer's `NodeCredentials` (mutual TLS to every worker, an admitted DHT
    peer); None: --insecure. `authorizer`: where to renew the credential at half life (None: no
    renewal); a revoked credential ends the run as an interruption. `metrics`: where to serve its
    Prometheus metrics (port 0: nowhere); the trainer's DHT record names the endpoint."""
    from agora.auth.admission import CredentialRenewer
    from agora.dht.leases import LeaseBoard
    from agora.dht.swarm import SwarmDHT
    from agora.node.trainer.units import LeasedUnits
    from agora.monitor.dht_metrics import DHTMetrics
    from agora.monitor.metrics import CredentialMetrics
    from agora.node.observability import NodeMetrics, package_version
    from agora.node.rpc.server import run as run_loop
    from agora.node.rpc.server import slow_start_hint
    from agora.node.inference.discovery import DHTReplicas
    from agora.node.inference.generator import GeneratorOptions, SwarmGenerator
    from agora.node.trainer.announce import trainer_heartbeat
    from agora.node.trainer.discovery import DHTDiscovery
    from agora.node.trainer.evals import SwarmEvaluator
    from agora.pipeline.data import build_data
    from agora.pipeline.fingerprint import run_fingerprint

    data = build_data(config)
    hint = slow_start_hint()
    if hint is not None:
        logger.info("%s", hint)
    # hivemind forks its DHT process: start it before the event loop and gRPC channels exist.
    security = starting_dht_security(authorizer, credentials)
    swarm = SwarmDHT.start(initial_peers=initial_peers, client_mode=True, security=security)
    discovery = DHTDiscovery(swarm, options.run_id, len(config.layer_split), config.train.seq_len,
                             fingerprint=run_fingerprint(config))

    async def main() -> dict:
        # SIGTERM/SIGINT end the run between calls: channels closed, the log flushed, a summary.
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, task.cancel)
        channels = None
        renewer = None
        revoked: list[str] = []
        if credentials is not None:
            channels = TlsChannels(credentials)  # re-reads the credential directory per call (renewals)
            if credentials.identity().role != "trainer":
                raise ConfigError(f"credential in {credentials.directory}: a trainer needs a trainer credential, "
                                  f"this one is a {credentials.identity().role} credential")
            if authorizer:
                def on_revoked(reason: str) -> None:
                    revoked.append(reason)
                    task.cancel()

                renewer = CredentialRenewer(authorizer, credentials, on_revoked=on_revoked)
        node = NodeMetrics.for_role(metrics, role="trainer", run_id=options.run_id, version=package_version())
        if credentials is not None:
            CredentialMetrics(node.registry, credentials.remaining_s,
                              lambda: renewer.renewals if renewer is not None else 0)
        DHTMetrics(node.registry, swarm.bans, swarm.timings, swarm.traffic)
        stats = TrainerStats(node.registry)
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(node.close)
            tracing = start_tracing(options.tracing, "trainer", run_id=options.run_id)  # after the DHT's fork
            if tracing is not None:
                stack.callback(tracing.close)
            if renewer is not None:
                await stack.enter_async_context(renewer)
            board = LeaseBoard(swarm, run_id=options.run_id, lease_s=options.lease_s)
            # Flagged workers are reported where there is an authorizer (there is one to renew at).
            reports = None if renewer is None else await stack.enter_async_context(
                WorkerReports(authorizer, credentials, stats))
            report_flagged = reports.flagged if reports is not None else lambda evidence: None
            evaluator = None
            if config.evals.every:  # scores through every stage's replicas the DHT lists, as a client would
                replicas = DHTReplicas(swarm, options.run_id, len(config.layer_split), run_fingerprint(config))
                generator = SwarmGenerator(config, replicas, GeneratorOptions(
                    run_id=options.run_id, call_timeout_s=options.call_timeout_s), channels=channels)
                evaluator = await stack.enter_async_context(SwarmEvaluator(
                    config.evals, generator, data, registry=node.registry, log_json=log_json))
            book, sender = _receipts(options, credentials, stats)
            units = LeasedUnits(board, total=steps, start=options.start_step, stats=stats, clock=swarm.clock,
                                stripe=(options.trainer_index, options.trainers))
            trainer = await stack.enter_async_context(
                SwarmTrainer(config, data, discovery, options, log_json=log_json, channels=channels, stats=stats,
                             units=units, on_flagged=report_flagged, receipts=book,
                             traces=None if tracing is None else MicrobatchTraces(tracing.tracer, tracing.share),
                             on_record=evaluator.on_record if evaluator is not None else None))
            endpoint = node.serve()
            await stack.enter_async_context(trainer_heartbeat(
                swarm, run_id=options.run_id, trainer_index=options.trainer_index, records=lambda: trainer.records,
                metrics_endpoint=endpoint, version=package_version(), interval_s=options.heartbeat_s,
                evaluation=evaluator.last_heldout if evaluator is not None else lambda: (0, 0.0)))
            logger.info("joined run %r as trainer %d of %d (peer %s)", options.run_id, options.trainer_index,
                        options.trainers, swarm.peer_id,
                        extra={"milestone": "joined", "fields": {"role": "trainer", "run": options.run_id,
                                                                 "trainer": options.trainer_index, "peer": swarm.peer_id,
                                                                 "metrics": endpoint}})
            interrupted = False
            try:
                await trainer.run(steps)
            except asyncio.CancelledError:
                interrupted = True
            if book is not None:  # the last interval, however short (the workers' copies go as the trainer closes)
                book.close_interval()
            if sender is not None:
                await sender.drain()
            if evaluator is not None:
                await evaluator.close(wait=not interrupted)
            records = trainer.records
            held_out = None
            if evaluate and not interrupted:
                batches = data.heldout_batches(config.train.eval_batches, config.train.batch_size)
                try:
                    held_out = await trainer.evaluate(batches)
                    stats.heldout(held_out)
                except asyncio.CancelledError:
                    # SIGTERM ends the run here too (module docstring): a trainer waiting for a stage left with
                    # no worker is stopped so, and its summary is what names whom it flagged and why.
                    interrupted = True
            return {
                "trainer": options.trainer_index, "steps": len(records), "interrupted": interrupted,
                "time_budget_s": options.time_budget_s,
                "revoked": revoked[0] if revoked else None,
                "credential_renewals": renewer.renewals if renewer is not None else 0,
                "final_loss": records[-1].loss if records else None, "heldout_loss": held_out,
                "tokens_per_s": records[-1].tokens_per_s if records else 0.0,
                "microbatches": trainer.stats.microbatches, "reroutes": trainer.stats.reroutes,
                "repeats": trainer.stats.repeats,
                "busy": trainer.stats.busy, "calls": trainer.stats.calls, "bans": trainer.stats.bans,
                "failures_by_peer": trainer.stats.failures_by_peer,
                "extreme_replies_by_peer": trainer.stats.extreme_replies_by_peer,
                "blamed_by_peer": trainer.stats.blamed_by_peer,
                "reply_scales": trainer.scales.summary(),
                "flagged_by_peer": trainer.stats.flagged_by_peer,
                "reported": {peer: receipt.banned for peer, receipt in reports.receipts.items()} if reports else {},
                "verification": trainer.verification_summary(),
                "receipts": {"signed": book.signed, "withheld_tokens": book.withheld} if book is not None else None,
                "aborts": trainer.stats.aborts, "batch_reports_failed": trainer.stats.batch_reports_failed,
                "batch_reports_refused": trainer.stats.batch_reports_refused,
                "batch_reports_retried": trainer.stats.batch_reports_retried,
                "units": trainer.stats.units(),
                "time_split_by_stage": trainer.stats.time_split(),
                "trainer_split": trainer.stats.trainer_split(),
                "process_cpu": {part: round(cpu, 3) for part, cpu in trainer.stats.process_cpu_s.items()},
                "spot_checks_by_stage": trainer.stats.spot_check_split(),
                "gradient_checks_by_stage": trainer.stats.gradient_check_split(),
                "in_flight": trainer.in_flight_summary(),
                "dht_requests": swarm.timings.summary(),
                "evaluations": [result.figures | {"step": result.step} for result in evaluator.results]
                if evaluator is not None else [],
            }

    try:
        return run_loop(main())
    finally:
        swarm.shutdown()


def _receipts(options: TrainerOptions, credentials: NodeCredentials | None,
              stats: TrainerStats) -> tuple[ReceiptBook | None, ReceiptSender | None]:
    """The receipt book (None under --insecure: nothing to sign with) and its sender to the ledger at
    `options.ledger_url` (None: no ledger). The trainer hands each worker its own receipts either way."""
    if credentials is None:
        if options.ledger_url is not None:
            raise ConfigError("ledger_url: receipts are signed with the trainer's credential; without one "
                              "(--insecure) there is nothing to sign them with")
        return None, None
    sender = ReceiptSender(options.ledger_url, stats) if options.ledger_url is not None else None
    book = ReceiptBook(options.run_id, credentials.peer_id, options.receipt_every_batches,
                       lambda: (credentials.key, credentials.current()[0]),
                       flagged=lambda peer: peer in stats.flagged_by_peer,
                       deliver=sender.submit if sender is not None else None)
    return book, sender
