"""Every role's metrics in one registry, each labelled series touched once: what a live process
ends up with (tests/integration/test_metrics.py lints it; tests/integration/test_monitor.py checks the
dashboard against it)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from agora.dht.averaging import RoundResult
from agora.dht.bans import BanList, BanStatus, NodeBans
from agora.dht.op_timings import RequestTimings
from agora.monitor.dht_metrics import DHTMetrics
from agora.monitor.metrics import CredentialMetrics, node_info
from agora.monitor.trainer_metrics import EvalMetrics, RpcClientMetrics
from agora.monitor.weight_sync_metrics import WeightSyncMetrics
from agora.monitor.worker_metrics import RpcServerMetrics, WorkerMetrics
from agora.node.averaging.stats import AveragingStats
from agora.node.trainer.stats import TrainerStats
from agora.dht.records import PHASES

RUN = "metrics-run"


def every_role(registry: CollectorRegistry) -> None:
    """Each role's metrics, every labelled series touched once (what a live process ends up with)."""
    node_info(registry, role="worker", run_id=RUN, version="1.0", stage=0)
    worker = WorkerMetrics(registry)
    worker.watch(load=lambda: 3, capacity=8, step=lambda: 5, throughput=lambda: 1e4, phase=lambda: "member",
                 phases=PHASES, refusals=lambda: {"expired": 2}, callers=lambda: 2, queue_target=lambda: 6)
    worker.observe_job("Forward", 128, 0.001, 0.02)
    worker.served("QmTrainer", 128)
    worker.receipted("QmTrainer", 2, 128)
    worker.receipt_refused("bad_signature")
    worker.stepped(3e-4, 1.5)
    worker.watch_output_grads(scale=lambda: 0.01, peak_ratio=lambda: 3.0)
    worker.watchdog_tripped("host_memory")
    weight_sync = WeightSyncMetrics(registry)
    weight_sync.refused("step")
    weight_sync.checked(0.2, 4096)
    server = RpcServerMetrics(registry)
    server.finished("/agora.v1.Stage/Forward", "OK", 0.03)
    server.received.labels(method="Forward").inc(100)
    server.sent.labels(method="Forward").inc(100)
    CredentialMetrics(registry, lambda: 1800.0, lambda: 2)
    bans = NodeBans()
    bans.update(BanStatus(BanList(RUN, 3, 0.0, frozenset({"QmBanned"})), {"unknown_key": 1, "storage": 2}))
    timings = RequestTimings()
    timings.record("get", "workers", 0.004)
    timings.record("store", "rounds", 12.0, failed=True)
    DHTMetrics(registry, bans, timings, lambda: {"received": {"workers": (3, 9000)},
                                                 "sent": {"find_changed workers": (2, 900, 7000), "ping -": (1, 0, 0)}})
    stats = AveragingStats("sparta", registry=registry)
    stats.record(RoundResult("committed", 3, None, participants=("a", "b"), received_fraction=1.0, duration_s=0.4,
                             bytes_sent=100, bytes_received=100, rejections={"outlier": 1},
                             clipped_coordinates=5), applied=True,
                 lag_steps=1)
    stats.count_skipped(1)
    stats.count_refused("past_schedule")
    stats.add_compute_blocked(0.01)
    trainer = TrainerStats(registry)
    trainer.call(0, "Forward", 0.05, 0.02, 0.01)
    trainer.depth(8, 16, [4])
    trainer.credit_wait(0, 0.01)
    for record in (trainer.microbatch_done, trainer.busy_retry, trainer.banned, trainer.report_failed,
                   trainer.report_refused):
        record()
    trainer.rerouted("peer")
    trainer.extreme_reply("peer", 0, "output")
    trainer.blamed("peer", 0)
    trainer.flagged("peer", 0, "output", "stage 0 output: log_rms high")
    trainer.worker_report("sent")
    trainer.receipts("signed", 3)
    trainer.receipt_delivery("kept")
    trainer.aborted("reverted")
    trainer.batch_done(256, 5.2, 3e-4)
    trainer.heldout(5.0)
    trainer.spot_check(0, 0.02)
    trainer.spot_check_skipped(0)
    trainer.spot_check_disagreement(0)
    trainer.gradient_check(0, 0.02)
    trainer.gradient_check_skipped(0)
    trainer.gradient_check_failed(0)
    RpcClientMetrics(registry).exchanged("Forward", 10, 20)
    evals = EvalMetrics(registry)
    evals.finished(8, {"heldout_loss": 2.5, "heldout_perplexity": 12.2, "agora_code_mc.acc": 0.5}, 1.5)
    evals.evaluations.labels(outcome="skipped").inc()
