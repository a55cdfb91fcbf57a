"""Metrics of every role: the naming rules over a live registry, one bookkeeping, real endpoints.

Unit tests build each role's metric set in one registry (no sockets); the worker test runs a
real StageWorker over loopback gRPC and reads what its hooks counted; the server test scrapes a
real `/metrics` endpoint over HTTP.
"""

from __future__ import annotations

import argparse
import urllib.request

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from agora.dht.averaging import RoundResult
from agora.monitor.metrics import new_registry, node_info, sample_value, start_metrics_server
from agora.monitor.naming import lint
from agora.monitor.trainer_metrics import RpcClientMetrics
from agora.monitor.worker_metrics import RpcServerMetrics, WorkerMetrics
from agora.node.averaging.stats import AveragingStats
from agora.node.observability import MetricsOptions, NodeMetrics, add_metrics_arguments
from agora.node.rpc.metrics_hook import MetricsHook
from agora.node.rpc.server import run
from agora.node.trainer.stage_client import RequestRefused, StageClient
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS, ConfigError
from agora.pipeline.fingerprint import run_fingerprint
from agora.pipeline.option_flags import options_from_args
from metric_sets import every_role

pytestmark = pytest.mark.timeout(60)

CONFIG = PRESETS["tiny"].with_stages(2)
RUN = "metrics-run"


def test_every_metric_of_every_role_follows_the_naming_rules():
    registry = new_registry()
    every_role(registry)
    assert lint(registry.collect()) == []
    names = {family.name for family in registry.collect()}
    assert {"agora_node", "agora_process_cpu_seconds", "agora_worker_queue_depth", "agora_averaging_rounds",
            "agora_trainer_tokens", "agora_credential_remaining_seconds"} <= names


def test_the_lint_names_each_broken_rule():
    registry = CollectorRegistry()
    Gauge("agora_latency_ms", "time in ms", registry=registry).set(1)
    Gauge("queue_depth", "no prefix", registry=registry).set(1)
    Counter("agora_calls", "by peer", ["peer"], registry=registry).labels(peer="x").inc()
    Gauge("agora_things_total", "a gauge named like a counter", registry=registry).set(1)
    Histogram("agora_step_duration", "a duration without its unit", registry=registry).observe(1)
    Gauge("agora_undocumented", "", registry=registry).set(1)
    problems = "\n".join(lint(registry.collect()))
    for expected in ("agora_latency_ms: ms is not a base unit", "queue_depth: not under the agora_ prefix",
                     "label(s) peer outside", "agora_things_total: a gauge must not end in _total",
                     "agora_step_duration: names a duration, so it must end in _seconds",
                     "agora_undocumented: no help text"):
        assert expected in problems


def test_the_largest_apply_lag_is_scraped_from_the_first_apply_even_at_zero():
    """The dashboard's apply-lag panel: rounds applied with no lag show 0 (a labelled gauge has no
    sample until its label is first used); a round that was not applied adds none."""
    registry = new_registry()
    stats = AveragingStats("sparta", registry=registry)
    result = RoundResult("committed", 1, None, participants=("a", "b"), received_fraction=1.0, duration_s=1.0,
                         bytes_sent=10, bytes_received=10)
    stats.record(result, applied=False)
    assert registry.get_sample_value("agora_averaging_apply_lag_max_steps", {"method": "sparta"}) is None
    stats.record(result, applied=True, lag_steps=0)
    assert registry.get_sample_value("agora_averaging_apply_lag_max_steps", {"method": "sparta"}) == 0


def test_averaging_stats_are_read_back_from_the_registry():
    registry = new_registry()
    stats = AveragingStats("sparta", registry=registry, clock=iter(range(100)).__next__)
    for outcome, group, lag in (("committed", 2, 1), ("committed", 3, 4), ("alone", 1, 0), ("failed", 2, 0)):
        stats.record(RoundResult(outcome, 1, None, participants=tuple("abc"[:group]), received_fraction=0.5,
                                 duration_s=float(group), bytes_sent=10, bytes_received=20),
                     applied=outcome == "committed", lag_steps=lag)
    stats.count_skipped(2)
    snap = stats.snapshot()
    assert snap["rounds_by_outcome"] == {"committed": 2, "alone": 1, "failed": 1, "rejected": 0, "cancelled": 0}
    assert (snap["applied"], snap["skipped"], snap["max_lag_steps"], snap["mean_lag_steps"]) == (2, 2, 4, 2.5)
    assert snap["group_sizes"] == {"1": 1, "2": 2, "3": 1}
    assert (snap["mean_received_fraction"], snap["max_duration_s"], snap["bytes_sent"]) == (0.5, 3.0, 40)
    # One bookkeeping: the snapshot is what a scrape shows.
    labels = {"method": "sparta"}
    assert sample_value(registry, "agora_averaging_rounds_total", {**labels, "outcome": "committed"}) == 2
    assert sample_value(registry, "agora_averaging_rounds_skipped_total", labels) == 2


def test_a_metrics_endpoint_serves_its_registry_over_http():
    registry = new_registry()
    node_info(registry, role="trainer", run_id=RUN, version="1.0")
    server = start_metrics_server(registry, "127.0.0.1", 0)
    try:
        page = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    finally:
        server.close()
    families = {f.name: f for f in text_string_to_metric_families(page)}
    assert families["agora_node_info"].samples[0].labels == {"version": "1.0", "role": "trainer", "stage": "", "run": RUN}
    assert lint(families.values()) == []


def metrics_flags(*argv: str) -> MetricsOptions:
    """The metrics options a role's command line gives (the flags generated from `MetricsOptions`)."""
    parser = argparse.ArgumentParser()
    add_metrics_arguments(parser)
    return options_from_args(MetricsOptions, parser.parse_args(list(argv)), "metrics")


def test_metrics_port_auto_serves_on_a_port_the_system_picks_and_announces_it():
    metrics = NodeMetrics.for_role(metrics_flags("--metrics-port", "auto"), role="worker", run_id=RUN, version="1.0",
                                   stage=0)
    try:
        endpoint = metrics.serve()
        host, port = endpoint.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) == metrics.server.port > 0
        page = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
        assert "agora_node_info" in page
    finally:
        metrics.close()
    assert metrics_flags().port == 0  # the default serves nothing
    with pytest.raises(SystemExit):  # argparse names the flag and the value
        metrics_flags("--metrics-port", "fast")


def test_metrics_file_names_the_endpoint_while_serving_for_a_launcher(tmp_path):
    """A role without a DHT record (bootstrap, authorizer) tells its launcher where it serves: the
    file holds the endpoint once serving and is gone once the server closes."""
    path = tmp_path / "bootstrap.metrics"
    metrics = NodeMetrics.for_role(metrics_flags("--metrics-port", "auto", "--metrics-file", str(path)),
                                   role="bootstrap", run_id=RUN, version="1.0")
    assert not path.exists()
    try:
        endpoint = metrics.serve()
        assert path.read_text() == endpoint + "\n" and endpoint.endswith(f":{metrics.server.port}")
        page = urllib.request.urlopen(f"http://{path.read_text().strip()}/metrics", timeout=10).read().decode()
        assert 'role="bootstrap"' in page
    finally:
        metrics.close()
    assert not path.exists()
    with pytest.raises(ConfigError, match="metrics.file: needs a metrics server"):
        metrics_flags("--metrics-file", str(path))
    unwritable = metrics_flags("--metrics-port", "auto", "--metrics-file", str(tmp_path / "missing" / "x.metrics"))
    metrics = NodeMetrics.for_role(unwritable, role="bootstrap", run_id=RUN, version="1.0")
    with pytest.raises(ConfigError, match="--metrics-file .*cannot write it"):
        metrics.serve()
    assert metrics.server is None  # the server it started is closed again


def test_a_worker_counts_its_jobs_calls_bytes_and_steps():
    registry = new_registry()

    async def main():
        worker = StageWorker(CONFIG, 1, run_id=RUN, options=WorkerOptions(synchronous=True),
                             outer_interceptors=[MetricsHook(RpcServerMetrics(registry))],
                             metrics=WorkerMetrics(registry))
        await worker.start()
        client = StageClient(worker.address, run_id=RUN, stage=1, model=CONFIG.model,
                             fingerprint=run_fingerprint(CONFIG), metrics=RpcClientMetrics(registry))
        try:
            tokens = torch.randint(0, CONFIG.model.vocab_size, (2, 17))
            wire = torch.zeros(2, 16, CONFIG.model.wire_dim)
            await client.forward("m0", tokens[:, :-1], wire, tokens[:, 1:])
            stranger = StageClient(worker.address, run_id="another-run", stage=1, model=CONFIG.model,
                                   fingerprint=run_fingerprint(CONFIG))
            with pytest.raises(RequestRefused):  # misaddressed: INVALID_ARGUMENT, counted by code
                await stranger.forward("m1", tokens[:, :-1], wire, tokens[:, 1:])
            await stranger.close()
            other_run = StageClient(worker.address, run_id=RUN, stage=1, model=CONFIG.model,
                                    fingerprint=run_fingerprint(PRESETS["tiny"].with_stages(3)))
            with pytest.raises(RequestRefused):  # refused by the per-call check, ahead of the handler
                await other_run.forward("m2", tokens[:, :-1], wire, tokens[:, 1:])
            await other_run.close()
            await client.step(1, step=0)
        finally:
            await client.close()
            await worker.stop()

    run(main())
    value = lambda name, **labels: sample_value(registry, name, labels)  # noqa: E731
    assert value("agora_worker_microbatches_total", method="Forward") == 1
    assert value("agora_worker_tokens_total", method="Forward") == 2 * 16
    assert value("agora_worker_compute_seconds_count", method="Forward") == 1
    # The compute thread's CPU in that one job: some, and no more than the job's wall time (one thread).
    cpu, wall = value("agora_worker_compute_cpu_seconds_total", method="Forward"), \
        value("agora_worker_compute_seconds_sum", method="Forward")
    assert 0 < cpu <= wall + 0.01, (cpu, wall)
    assert value("agora_rpc_server_handled_total", method="Forward", code="OK") == 1
    assert value("agora_rpc_server_handled_total", method="Forward", code=grpc.StatusCode.INVALID_ARGUMENT.name) == 1
    assert value("agora_rpc_server_handled_total", method="Forward", code="FAILED_PRECONDITION") == 1
    assert value("agora_worker_refusals_total", reason="fingerprint_mismatch") == 1
    assert value("agora_rpc_server_received_bytes_total", method="Forward") > 2 * 16 * CONFIG.model.wire_dim * 4
    assert value("agora_rpc_client_sent_bytes_total", method="Forward") > 0
    assert value("agora_worker_optimizer_steps_total") == 1 and value("agora_worker_optimizer_step") == 1
    assert value("agora_worker_learning_rate") > 0 and value("agora_worker_grad_norm") > 0
    assert value("agora_worker_phase", phase="leaving") == 1  # stopped
    assert lint(registry.collect()) == []
