"""The monitor's decisions without a network, its HTTP port over loopback, and what the package ships.

The swarm view, service discovery and loss history are pure functions of records; the HTTP
app is served for real on 127.0.0.1:0 and read with urllib; a real two-peer DHT feeds
`SwarmMonitor.poll`. tests/system/test_monitor_live.py checks the whole against a running demo with
Prometheus and Chromium.
"""

from __future__ import annotations

import asyncio
import dataclasses
import configparser
import fnmatch
import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agora.dht.heartbeat import Heartbeat
from agora.dht.record_fields import RecordError
from agora.dht.records import TrainerRecord, WorkerRecord
from agora.dht.swarm import SwarmDHT
from agora.monitor.http import start_monitor_server
from agora.monitor.metrics import new_registry
from agora.monitor.naming import lint
from agora.monitor.options import MonitorOptions, parse_target
from agora.monitor.service import SwarmMonitor
from agora.monitor.swarm_metrics import MonitorMetrics, SwarmCollector
from agora.monitor.swarm_view import EvalHistory, LossHistory, StaticTarget, scrape_targets, summarize
from agora.node.trainer.announce import trainer_heartbeat
from agora.pipeline.centralized import StepRecord
from metric_sets import every_role

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
RUN = "mon"


def worker(peer: str, stage: int, *, step: int = 10, throughput: float = 100.0, phase: str = "member",
           rounds: int = 0, committed: int = 0, metrics: str = "", host: str = "127.0.0.1") -> WorkerRecord:
    return WorkerRecord(peer_id=peer, run_id=RUN, endpoint=f"{host}:{5000 + stage}", stage=stage, n_stages=3,
                        throughput=throughput, queue_depth=1, step=step, phase=phase, version="1", updated_at=1.0,
                        fingerprint="f", metrics_endpoint=metrics, averaging_rounds=rounds,
                        averaging_committed=committed)


def trainer(index: int, step: int, loss: float, rate: float, metrics: str = "", evaluated: tuple[int, float] = (0, 0.0)
            ) -> TrainerRecord:
    return TrainerRecord(peer_id=f"t{index}", run_id=RUN, trainer_index=index, batches=step, step=step, loss=loss,
                         tokens_per_s=rate, version="1", updated_at=1.0, metrics_endpoint=metrics,
                         eval_step=evaluated[0], heldout_loss=evaluated[1])


def test_the_view_finds_the_bottleneck_the_drift_and_each_stages_averaging_health():
    workers = {0: [worker("a", 0, step=12, throughput=300, rounds=4, committed=3, metrics="127.0.0.1:9001"),
                   worker("b", 0, step=11, throughput=200, phase="leaving", rounds=2, committed=2)],
               1: [worker("c", 1, step=9, throughput=150, metrics="127.0.0.1:9002")]}
    view = summarize(RUN, workers, [trainer(0, 20, 3.0, 1000, "127.0.0.1:9100"), trainer(1, 18, 2.0, 500)],
                     n_stages=3, now=5.0, static_targets=(StaticTarget("authorizer", "127.0.0.1:9200"),))
    assert [len(s.workers) for s in view.stages] == [2, 1, 0]  # an empty stage is shown, not dropped
    assert view.stages[0].phases["member"] == 1 and view.stages[0].phases["leaving"] == 1
    assert view.stages[0].throughput == 500 and view.stages[0].averaging_success == 5 / 6
    assert view.stages[1].averaging_success is None
    assert view.bottleneck_stage == 1 and view.step_drift == 12 - 9
    assert view.tokens_per_s == 1500 and view.loss == 2.5
    assert scrape_targets(view) == [
        {"targets": ["127.0.0.1:9001"], "labels": {"role": "worker", "stage": "0", "run": RUN}},
        {"targets": ["127.0.0.1:9002"], "labels": {"role": "worker", "stage": "1", "run": RUN}},
        {"targets": ["127.0.0.1:9100"], "labels": {"role": "trainer", "run": RUN}},
        {"targets": ["127.0.0.1:9200"], "labels": {"role": "authorizer", "run": RUN}},
    ]
    json.dumps(view.to_json())  # what /api/swarm serves is plain JSON


def test_an_empty_swarm_has_no_targets_and_no_bottleneck():
    view = summarize(RUN, {}, [], n_stages=2, now=0.0)
    assert scrape_targets(view) == [] and view.bottleneck_stage is None and view.loss is None
    assert [s.stage for s in view.stages] == [0, 1]


def test_the_loss_history_adds_a_point_only_when_the_step_moves_and_stays_bounded():
    history = LossHistory(capacity=3)
    for now, step in ((1, 0), (2, 5), (3, 5), (4, 6), (5, 9), (6, 12)):
        points = history.add(summarize(RUN, {}, [trainer(0, step, 4.0 - step / 10, 100)] if step else [],
                                       n_stages=1, now=now))
    assert [p.step for p in points] == [6, 9, 12]
    assert points[-1].loss == pytest.approx(2.8) and points[-1].t == 6


def test_the_eval_curve_adds_a_point_when_the_trainers_latest_evaluation_moves():
    """The held-out loss the trainers measured through the swarm (their records' last evaluation):
    one point per evaluation step, the mean of the trainers that evaluated at it; none before one."""
    history = EvalHistory()
    polls = [(1, [trainer(0, 3, 4.0, 1)]),
             (2, [trainer(0, 4, 3.9, 1, evaluated=(4, 3.5)), trainer(1, 4, 3.9, 1)]),
             (3, [trainer(0, 6, 3.8, 1, evaluated=(4, 3.5)), trainer(1, 6, 3.8, 1)]),
             (4, [trainer(0, 8, 3.7, 1, evaluated=(8, 3.1)), trainer(1, 8, 3.7, 1, evaluated=(8, 3.3))])]
    for now, trainers in polls:
        view = summarize(RUN, {}, trainers, n_stages=1, now=now)
        points = history.add(view)
    assert [(p.t, p.step) for p in points] == [(2, 4), (4, 8)]
    assert points[-1].heldout_loss == pytest.approx(3.2)
    assert dataclasses.replace(view, eval_history=points).to_json()["eval_history"][-1] == \
        {"t": 4, "step": 8, "heldout_loss": pytest.approx(3.2)}


def test_static_targets_are_parsed_or_refused_naming_the_problem():
    assert parse_target("authorizer=10.0.0.2:9100") == StaticTarget("authorizer", "10.0.0.2:9100")
    for bad, message in (("10.0.0.2:9100", "ROLE=HOST:PORT"), ("boot=host", "endpoint"), ("x=h:99999", "port")):
        with pytest.raises(ValueError, match=message):
            parse_target(bad)


def test_records_refuse_a_malformed_metrics_endpoint():
    with pytest.raises(RecordError, match="worker.metrics_endpoint"):
        worker("a", 0, metrics="no-port")
    with pytest.raises(RecordError, match="trainer.loss"):
        trainer(0, 1, -1.0, 0)
    with pytest.raises(RecordError, match="averaging_committed"):
        worker("a", 0, rounds=1, committed=2)


def test_the_http_port_serves_the_page_the_api_discovery_and_metrics():
    registry = new_registry()
    views = [None]
    SwarmCollector(lambda: views[0], registry)
    server = start_monitor_server(registry, lambda: views[0], "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.port}"
    read = lambda path: urllib.request.urlopen(base + path, timeout=10).read()  # noqa: E731
    try:
        assert json.loads(read("/sd")) == []  # before the first poll: no target, never an error
        views[0] = summarize(RUN, {0: [worker("a", 0, metrics="127.0.0.1:9001")]}, [trainer(0, 3, 2.0, 10)],
                             n_stages=1, now=1.0)
        assert json.loads(read("/sd"))[0]["targets"] == ["127.0.0.1:9001"]
        assert json.loads(read("/api/swarm"))["stages"][0]["workers"][0]["peer"] == "a"
        page = read("/").decode()
        for asset in ("/static/app.js", "/static/style.css"):
            assert asset in page and read(asset)  # shipped in the package, no CDN
        assert "http" not in page.replace('href="/', "").split("<body")[0].lower().replace("http-equiv", "")
        families = list(text_string_to_metric_families(read("/metrics").decode()))
        assert {"agora_swarm_workers", "agora_swarm_loss", "agora_swarm_bottleneck_stage"} <= {f.name for f in families}
        assert lint(families) == []
        with pytest.raises(urllib.error.HTTPError) as missing:
            read("/static/../setup.cfg")
        assert missing.value.code == 404
    finally:
        server.close()


def test_the_package_ships_every_monitor_asset():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    patterns = [p.strip() for p in config["options.package_data"]["agora.monitor"].split(",")]
    shipped = [path.relative_to(ROOT / "monitor").as_posix() for path in (ROOT / "monitor").rglob("*")
               if path.is_file() and path.suffix not in (".py", ".pyc")]
    assert shipped and all(any(fnmatch.fnmatch(name, p) and name.count("/") == p.count("/") for p in patterns)
                           for name in shipped), (shipped, patterns)
    for name in ("prometheus.yml", "static/index.html", "grafana/dashboards/agora-swarm.json",
                 "grafana/provisioning/datasources/agora.yml", "grafana/provisioning/dashboards/agora.yml"):
        assert name in shipped


def test_the_dashboard_queries_only_metrics_that_exist():
    """Every metric name a panel asks for is one some role defines (the live test runs them all)."""

    registry = new_registry()
    every_role(registry)
    MonitorMetrics(registry)
    view = summarize(RUN, {0: [worker("a", 0, rounds=1, committed=1)]}, [trainer(0, 3, 2.0, 10)], n_stages=1, now=1.0)
    SwarmCollector(lambda: view, registry)
    known = {sample.name for family in registry.collect() for sample in family.samples} | {"up"}
    dashboard = json.loads((ROOT / "monitor/grafana/dashboards/agora-swarm.json").read_text())
    asked = {name for panel in dashboard["panels"] for target in panel.get("targets", [])
             for name in re.findall(r"\b(agora_[a-z_]+|up)\b", target["expr"])}
    assert asked and asked <= known, asked - known


def test_the_monitor_reads_announced_workers_and_trainers_from_a_real_dht(caplog):
    """Two hivemind peers: a worker's and a trainer's heartbeats on one, the monitor's poll on the
    other (client mode); a withdrawn trainer leaves the view and `/sd` on the next poll. A worker
    whose metrics endpoint names a private address beside its public gRPC endpoint is left out of
    `/sd`, logged naming its peer and counted, once however many polls read it."""
    node = SwarmDHT.start()
    try:
        reader = SwarmDHT.start(initial_peers=node.visible_maddrs(), client_mode=True)
        try:
            async def main():
                records = [StepRecord(step=4, loss=3.5, tokens=100, lr=1e-3, grad_norm=[], elapsed_s=1.0,
                                      tokens_per_s=250.0)]
                beat = Heartbeat(node, lambda: worker(node.peer_id, 1, metrics="127.0.0.1:9001", rounds=2,
                                                      committed=1), interval=5)
                pointer = Heartbeat(node, lambda: worker(node.peer_id, 2, metrics="10.0.0.5:9100",
                                                         host="203.0.113.5"), interval=5)
                trainer_beat = trainer_heartbeat(node, run_id=RUN, trainer_index=0, records=lambda: records,
                                                 metrics_endpoint="127.0.0.1:9100", version="1", interval_s=5,
                                                 evaluation=lambda: (4, 3.25))
                registry = new_registry()
                monitor = SwarmMonitor(reader, MonitorOptions(port=0, trainer_hosts=("127.0.0.1",)), registry,
                                       run_id=RUN, n_stages=3)
                async with beat, pointer, trainer_beat:
                    deadline = asyncio.get_running_loop().time() + 20
                    while True:  # readiness: the monitor's own reads see every record
                        view = await monitor.poll()
                        if view.trainers and view.stages[1].workers and view.stages[2].workers:
                            break
                        assert asyncio.get_running_loop().time() < deadline, view
                        await asyncio.sleep(0.2)
                    assert (view.trainers[0].step, view.trainers[0].loss, view.tokens_per_s) == (4, 3.5, 250.0)
                    assert [(p.step, p.heldout_loss) for p in view.eval_history] == [(4, 3.25)]  # the status page's
                    assert view.stages[1].averaging_success == 0.5 and view.bottleneck_stage == 1
                    assert [(g["labels"]["role"], g["targets"]) for g in scrape_targets(view)] == [
                        ("worker", ["127.0.0.1:9001"]), ("trainer", ["127.0.0.1:9100"])]
                    await monitor.poll()  # read again: reported once
                    left_out = registry.get_sample_value("agora_monitor_scrape_targets_left_out_total",
                                                         {"role": "worker", "reason": "other_host"})
                    assert left_out == 1
                    lines = [r for r in caplog.records if getattr(r, "milestone", None) == "scrape_target_left_out"]
                    assert len(lines) == 1 and node.peer_id in lines[0].getMessage()
                    assert "10.0.0.5:9100" in lines[0].getMessage()
                # Both withdrawn (tombstones) on leaving: the next poll has no target left.
                view = await monitor.poll()
                assert scrape_targets(view) == [] and view.history[-1].step == 4

            asyncio.run(main())
        finally:
            reader.shutdown()
    finally:
        node.shutdown()
