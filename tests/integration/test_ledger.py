"""The ledger of verified work end to end: a trainer on mutual TLS to real StageWorkers signs receipts
for what it accepted, posts them to a real monitor HTTP port, the ledger verifies and sums them, the
workers' own metrics count the same tokens, and an export verifies with `agora-node ledger verify`.
Each worker is handed its own receipts over its gRPC service and keeps them; its export verifies too,
and a receipt it must refuse is refused with the reason while it keeps serving."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import replace

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry, start_http_server

from agora.auth.credentials import CredentialVerifier
from agora.auth.node_state import NodeCredentials
from agora.auth.receipts import Receipt, receipt_to_json, sign_receipt
from agora.monitor.http import start_monitor_server
from agora.monitor.ledger import LedgerMetrics, ReceiptLedger
from agora.monitor.metrics import new_registry, sample_value
from agora.monitor.served_counts import served_count
from agora.monitor.worker_metrics import WorkerMetrics
from agora.node.cli import main as agora_node
from agora.node.rpc.tls import TlsChannels
from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.receipts import POST_CHUNK, ReceiptBook, ReceiptSender
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.stage_client import RequestRefused, StageClient
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.trainer import SwarmTrainer
from agora.node.worker.worker import StageWorker
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data
from agora.pipeline.fingerprint import run_fingerprint
from run_pki import build_pki

pytestmark = pytest.mark.timeout(180)

RUN = "ledger-run"
STEPS = 3
CONFIG = PRESETS["tiny"].with_stages(3)
CONFIG = replace(CONFIG, train=replace(CONFIG.train, batch_size=4, microbatches=2, seq_len=32, eval_every=0))
TOKENS_PER_BATCH = 4 * 32


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return build_pki(tmp_path_factory.mktemp("pki"), RUN)


def _post(base: str, body: bytes) -> dict:
    request = urllib.request.Request(base + "/api/receipts", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def _get(base: str, path: str):
    with urllib.request.urlopen(base + path, timeout=10) as reply:
        return json.loads(reply.read())


def _page_dom(base: str, tmp_path) -> str:
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed: .ci/run installs it (apt-get install chromium)"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", base + "/"], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout


def test_a_trainers_receipts_reach_the_ledger_and_match_what_the_workers_counted(pki, tmp_path):
    registry = new_registry()
    ledger = ReceiptLedger(tmp_path / "ledger.sqlite", CredentialVerifier(pki.root_pem, RUN, clock=time.time),
                           LedgerMetrics(registry), clock=time.time)
    worker_registries = [CollectorRegistry() for _ in range(3)]
    metrics_servers = [start_http_server(0, addr="127.0.0.1", registry=r) for r in worker_registries]
    endpoints = {}
    monitor = start_monitor_server(registry, lambda: None, "127.0.0.1", 0, ledger=ledger,
                                   served=lambda worker, trainer: served_count(endpoints[worker], trainer))
    base = f"http://127.0.0.1:{monitor.port}"
    trainer_credentials = NodeCredentials(pki.trainer, clock=time.time)
    data = build_data(CONFIG)

    async def main():
        workers = []
        for stage in range(3):
            worker = StageWorker(CONFIG, stage, run_id=RUN, credentials=NodeCredentials(pki.workers[stage],
                                                                                          clock=time.time),
                                 metrics=WorkerMetrics(worker_registries[stage]))
            await worker.start()
            workers.append(worker)
            endpoints[worker.credentials.peer_id] = f"127.0.0.1:{metrics_servers[stage][0].server_port}"
        views = [WorkerView(w.credentials.peer_id, w.address, w.stage_index) for w in workers]
        stats = TrainerStats()
        sender = ReceiptSender(base, stats)
        book = ReceiptBook(RUN, trainer_credentials.peer_id, 2, lambda: (trainer_credentials.key,
                                                                          trainer_credentials.current()[0]),
                           flagged=lambda peer: peer in stats.flagged_by_peer, deliver=sender.submit)
        try:
            async with SwarmTrainer(CONFIG, data, StaticDiscovery(views), TrainerOptions(run_id=RUN),
                                    channels=TlsChannels(trainer_credentials), stats=stats, receipts=book) as trainer:
                await trainer.run(STEPS)
                book.close_interval()  # what the trainer command does when the run ends
            await sender.drain()
            return [w.credentials.peer_id for w in workers], stats
        finally:
            await asyncio.gather(*(w.stop(0) for w in workers))

    try:
        peers, stats = asyncio.run(main())
        contributors = {c["worker"]: c for c in _get(base, "/api/contributors")["contributors"]}
        assert sorted(contributors) == sorted(peers)
        for stage, peer in enumerate(peers):
            entry = contributors[peer]
            assert (entry["tokens"], entry["microbatches"], entry["receipts"]) == (STEPS * TOKENS_PER_BATCH, 6, 2)
            assert entry["trainers"] == [trainer_credentials.peer_id] and entry["flagged_receipts"] == 0
            served = sample_value(worker_registries[stage], "agora_worker_served_tokens_total",
                                  {"trainer": trainer_credentials.peer_id})
            assert served == STEPS * TOKENS_PER_BATCH  # the contributor's own count: the same tokens
        assert sample_value(stats.registry, "agora_trainer_receipts_total", {"outcome": "delivered"}) == 6

        # Each worker was handed its own receipts, verified and kept them: the same ones the ledger holds,
        # counted in its metrics, and exported from its state dir they verify against the root alone.
        assert sample_value(stats.registry, "agora_trainer_receipt_deliveries_total", {"outcome": "kept"}) == 6
        root = tmp_path / "root.pem"
        root.write_bytes(pki.root_pem)
        for stage, peer in enumerate(peers):
            receipted = sample_value(worker_registries[stage], "agora_worker_receipted_tokens_total",
                                     {"trainer": trainer_credentials.peer_id})
            assert receipted == STEPS * TOKENS_PER_BATCH
            own = tmp_path / f"worker{stage}-receipts.json"
            assert agora_node(["ledger", "export", "--state-dir", str(pki.workers[stage]), "--out", str(own)]) == 0
            (entry,) = json.loads(own.read_text())["contributors"]
            assert (entry["worker"], entry["tokens"], entry["receipts"]) == (peer, STEPS * TOKENS_PER_BATCH, 2)
            assert agora_node(["ledger", "verify", str(own), "--ca", str(root)]) == 0

        # A receipt claiming more than the worker served is stored flagged, apart from the share.
        head = peers[0]
        claim = Receipt(RUN, trainer_credentials.peer_id, head, 0, time.time(), time.time(), 2, 10 * TOKENS_PER_BATCH)
        inflated = sign_receipt(claim, trainer_credentials.key, trainer_credentials.current()[0])
        answer = _post(base, json.dumps({"receipts": [receipt_to_json(inflated)]}).encode())
        assert (answer["accepted"], answer["flagged"]) == (1, 1)
        assert _get(base, "/api/contributors")["contributors"][0]["tokens"] == STEPS * TOKENS_PER_BATCH

        # A forged receipt is refused, names why, is counted on /metrics and stored nowhere.
        forged = receipt_to_json(dataclasses.replace(inflated, receipt=dataclasses.replace(claim, tokens=10 ** 6)))
        answer = _post(base, json.dumps({"receipts": [forged, {"receipt": 1}]}).encode())
        assert answer["accepted"] == 0
        assert [(r["index"], r["reason"]) for r in answer["refused"]] == [(0, "bad_signature"), (1, "malformed")]
        assert "signature:" in answer["refused"][0]["error"]
        assert sample_value(registry, "agora_ledger_receipts_refused_total", {"reason": "bad_signature"}) == 1
        with pytest.raises(urllib.error.HTTPError) as bad:
            _post(base, b"not json")
        assert bad.value.code == 400

        # The status page shows each contributor's share (headless Chromium runs the page's own fetches).
        rows = dict(re.findall(r'<tr data-worker="([^"]+)" data-tokens="(\d+)"', _page_dom(base, tmp_path)))
        assert rows == {peer: str(STEPS * TOKENS_PER_BATCH) for peer in peers}

        # The export verifies against the root alone; one changed figure does not.
        export = tmp_path / "ledger.json"
        export.write_text(json.dumps(_get(base, "/api/ledger")))
        assert agora_node(["ledger", "verify", str(export), "--ca", str(root)]) == 0
        document = json.loads(export.read_text())
        document["receipts"][0]["signed"]["receipt"]["tokens"] += 1
        export.write_text(json.dumps(document))
        assert agora_node(["ledger", "verify", str(export), "--ca", str(root)]) == 1
    finally:
        monitor.close()
        ledger.close()
        for server, thread in metrics_servers:
            server.shutdown()
            server.server_close()


def test_receipts_the_ledger_could_not_take_are_kept_and_a_backlog_goes_in_several_posts(pki, tmp_path):
    credentials = NodeCredentials(pki.trainer, clock=time.time)
    chain, worker = credentials.current()[0], NodeCredentials(pki.workers[0], clock=time.time).peer_id
    now = time.time()
    receipts = [sign_receipt(Receipt(RUN, credentials.peer_id, worker, 0, now + i, now + i + 0.5, 1, 64),
                             credentials.key, chain) for i in range(4 * POST_CHUNK)]  # over 1 MiB in one body
    with socket.socket() as reserved:  # a port nothing listens on yet: the monitor comes up there later
        reserved.bind(("127.0.0.1", 0))
        port = reserved.getsockname()[1]
    stats = TrainerStats()
    sender = ReceiptSender(f"http://127.0.0.1:{port}", stats, timeout_s=5)

    async def submit(batch):
        sender.submit(batch)
        await sender.drain()

    asyncio.run(submit(receipts[:20]))
    assert sample_value(stats.registry, "agora_trainer_receipts_total", {"outcome": "failed"}) == 20
    registry = new_registry()
    ledger = ReceiptLedger(tmp_path / "ledger.sqlite", CredentialVerifier(pki.root_pem, RUN, clock=time.time),
                           LedgerMetrics(registry), clock=time.time)
    monitor = start_monitor_server(registry, lambda: None, "127.0.0.1", port, ledger=ledger)
    try:
        asyncio.run(submit(receipts[20:]))  # the 20 kept go first, then these: two posts
        assert sample_value(stats.registry, "agora_trainer_receipts_total", {"outcome": "delivered"}) == len(receipts)
        (entry,) = ledger.contributors()
        assert (entry.receipts, entry.tokens) == (len(receipts), 64 * len(receipts))
        assert sample_value(registry, "agora_ledger_receipts_refused_total", {"reason": "duplicate"}) == 0
    finally:
        monitor.close()
        ledger.close()


def test_a_worker_refuses_a_bad_receipt_with_the_reason_and_keeps_serving(pki, tmp_path):
    state = tmp_path / "worker0"  # the stage-0 worker's credential, with a receipts file of its own
    shutil.copytree(pki.workers[0], state, ignore=shutil.ignore_patterns("receipts.sqlite*"))
    trainer = NodeCredentials(pki.trainer, clock=time.time)
    registry = CollectorRegistry()

    def client_of(worker: StageWorker, credentials_dir) -> StageClient:
        return StageClient(worker.address, run_id=RUN, stage=0, model=CONFIG.model, fingerprint=run_fingerprint(CONFIG),
                           peer_id=worker.credentials.peer_id, channels=TlsChannels(NodeCredentials(
                               credentials_dir, clock=time.time)), timeout_s=10)

    async def main():
        worker = StageWorker(CONFIG, 0, run_id=RUN, credentials=NodeCredentials(state, clock=time.time),
                             metrics=WorkerMetrics(registry))
        async with worker, client_of(worker, pki.trainer) as as_trainer, client_of(worker, pki.monitor) as as_monitor:
            now, chain = time.time(), trainer.current()[0]
            genuine = sign_receipt(Receipt(RUN, trainer.peer_id, worker.credentials.peer_id, 0, now - 60, now, 2, 64),
                                   trainer.key, chain)
            others = sign_receipt(replace(genuine.receipt, worker=NodeCredentials(pki.workers[1], clock=time.time)
                                          .peer_id), trainer.key, chain)
            forged = replace(genuine, receipt=replace(genuine.receipt, tokens=6400))
            kept = await as_trainer.deliver_receipt(json.dumps(receipt_to_json(genuine)))
            refusals = {}
            for name, signed in (("forged", forged), ("another worker's", others), ("again", genuine)):
                with pytest.raises(RequestRefused) as refused:
                    await as_trainer.deliver_receipt(json.dumps(receipt_to_json(signed)))
                refusals[name] = (refused.value.code, refused.value.details)
            with pytest.raises(RequestRefused) as by_monitor:  # a monitor credential may not deliver receipts
                await as_monitor.deliver_receipt(json.dumps(receipt_to_json(genuine)))
            tokens = torch.randint(0, CONFIG.model.vocab_size, (2, CONFIG.train.seq_len))
            served = await as_trainer.forward("after-refusals", tokens, evaluate=True)
            return kept, refusals, by_monitor.value, served

    kept, refusals, by_monitor, served = asyncio.run(main())
    assert (kept.receipts, kept.microbatches, kept.tokens) == (1, 2, 64)
    assert refusals["forged"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert refusals["forged"][1].startswith("receipt refused (bad_signature): signature:")
    assert refusals["another worker's"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "(wrong_worker): worker: the receipt is for worker" in refusals["another worker's"][1]
    assert refusals["again"][0] == grpc.StatusCode.ALREADY_EXISTS
    assert by_monitor.code == grpc.StatusCode.PERMISSION_DENIED and "monitor credential" in by_monitor.details
    assert served.wire_frame  # still serving the pipeline
    for reason in ("bad_signature", "wrong_worker", "duplicate"):
        assert sample_value(registry, "agora_worker_receipts_refused_total", {"reason": reason}) == 1
    assert sample_value(registry, "agora_worker_receipted_tokens_total", {"trainer": trainer.peer_id}) == 64
