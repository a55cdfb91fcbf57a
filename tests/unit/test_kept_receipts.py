"""A worker's own receipts (node/worker/receipts.py): kept only when addressed to it, of its run, signed by
a trainer of the run's root, and once; refused otherwise with a reason and a status; shown in one log
line per receipt and in its metrics; exported in the ledger's form, which verifies against the root alone."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sqlite3

import grpc
import pytest
from prometheus_client import CollectorRegistry

from agora.auth.keys import generate_key, peer_id_of
from agora.auth.receipts import Receipt, receipt_to_json, sign_receipt
from agora.monitor.ledger import verify_export
from agora.monitor.metrics import sample_value
from agora.monitor.worker_metrics import WorkerMetrics
from agora.node.worker.receipts import MAX_RECEIPT_BYTES, KeptReceipts, KeptTotals, ReceiptService
from agora.protos.receipt_adapter import ReceiptDelivery
from agora.protos.stage_adapter import StageRefusal
from receipt_pki import NOW, RUN, receipt_pki


@pytest.fixture(scope="module")
def pki():
    made = receipt_pki()
    worker_key, other_key = generate_key(), generate_key()
    return made, peer_id_of(worker_key), peer_id_of(other_key), made.credential(worker_key, "worker", 1), worker_key


@pytest.fixture
def kept(tmp_path, pki):
    store = KeptReceipts(tmp_path / "receipts.sqlite", pki[1], pki[0].verifier(NOW + 600), clock=lambda: NOW + 600)
    yield store
    store.close()


def signed_for(pki, *, worker=None, start=0.0, microbatches=4, run_id=RUN, key=None, chain=None):
    made = pki[0]
    key, chain = key or made.trainer_key, chain or made.trainer_chain
    receipt = Receipt(run_id, peer_id_of(key), worker or pki[1], 1, NOW + start, NOW + start + 30, microbatches,
                      microbatches * 64)
    return sign_receipt(receipt, key, chain)


def deliver(service: ReceiptService, signed) -> object:
    text = json.dumps(receipt_to_json(signed)) if not isinstance(signed, str) else signed
    return asyncio.run(service.deliver_receipt(ReceiptDelivery(text), None))


def refusal(service: ReceiptService, signed) -> StageRefusal:
    with pytest.raises(StageRefusal) as refused:
        deliver(service, signed)
    return refused.value


def test_a_receipt_for_this_worker_is_kept_summed_and_counted(kept, pki, caplog):
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    trainer = peer_id_of(pki[0].trainer_key)
    metrics.served_since_s = NOW - 1  # this process served the trainer 1,000 tokens since before the intervals
    metrics.served(trainer, 1000)
    service = ReceiptService(kept, metrics=metrics, logger=logging.getLogger("test.receipts"))
    with caplog.at_level(logging.INFO, logger="test.receipts"):
        first = deliver(service, signed_for(pki))
        second = deliver(service, signed_for(pki, start=30, microbatches=6))
    assert (first.receipts, first.tokens) == (1, 256)
    assert (second.receipts, second.microbatches, second.tokens) == (2, 10, 640)
    assert kept.totals() == KeptTotals(receipts=2, microbatches=10, tokens=640, trainers=1)
    line = caplog.records[-1].getMessage()
    assert f"trainer {trainer[:12]}.. verified 6 microbatches / 384 tokens at stage 1" in line
    assert "its receipts cover 64% of the 1,000 tokens this process served it" in line
    assert line.endswith("all receipts: 10 microbatches, 640 tokens from 1 trainer")
    assert sample_value(registry, "agora_worker_receipted_tokens_total", {"trainer": trainer}) == 640
    assert sample_value(registry, "agora_worker_receipted_microbatches_total", {"trainer": trainer}) == 10


@pytest.mark.parametrize("case, reason, code", [
    ("bad_signature", "bad_signature", grpc.StatusCode.INVALID_ARGUMENT),
    ("wrong_worker", "wrong_worker", grpc.StatusCode.INVALID_ARGUMENT),
    ("wrong_run", "wrong_run", grpc.StatusCode.INVALID_ARGUMENT),
    ("worker_signed", "wrong_role", grpc.StatusCode.PERMISSION_DENIED),
    ("duplicate", "duplicate", grpc.StatusCode.ALREADY_EXISTS),
    ("oversized", "oversized", grpc.StatusCode.INVALID_ARGUMENT),
    ("not_json", "malformed", grpc.StatusCode.INVALID_ARGUMENT),
])
def test_a_bad_receipt_is_refused_with_its_reason_counted_and_never_kept(kept, pki, case, reason, code):
    registry = CollectorRegistry()
    service = ReceiptService(kept, metrics=WorkerMetrics(registry), logger=logging.getLogger("test.receipts"))
    good = signed_for(pki)
    bad = {
        "bad_signature": dataclasses.replace(good, receipt=dataclasses.replace(good.receipt, tokens=10 ** 6)),
        "wrong_worker": signed_for(pki, worker=pki[2]),
        "wrong_run": signed_for(pki, run_id="run-b"),
        "worker_signed": signed_for(pki, key=pki[4], chain=pki[3]),  # a worker vouching for itself
        "duplicate": good,
        "oversized": json.dumps(receipt_to_json(good) | {"padding": "x" * MAX_RECEIPT_BYTES}),
        "not_json": "{receipt",
    }[case]
    if case == "duplicate":
        deliver(service, good)
    refused = refusal(service, bad)
    assert (refused.code, refused.message.split(":")[0]) == (code, f"receipt refused ({reason})")
    assert sample_value(registry, "agora_worker_receipts_refused_total", {"reason": reason}) == 1
    assert kept.totals().receipts == (1 if case == "duplicate" else 0)


def test_without_a_root_every_receipt_is_refused_as_nothing_can_be_verified(pki):
    refused = refusal(ReceiptService(None, metrics=None, logger=logging.getLogger("test.receipts")), signed_for(pki))
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and "--insecure" in refused.message


def test_the_workers_table_is_append_only(kept, pki):
    kept.keep(signed_for(pki))
    db = sqlite3.connect(kept.table.path)
    for statement in ("UPDATE receipts SET tokens = 1", "DELETE FROM receipts"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            db.execute(statement)
    db.close()


def test_the_kept_receipts_export_in_the_ledgers_form_and_verify_against_the_root(kept, pki):
    for start in (0, 30, 60):
        kept.keep(signed_for(pki, start=start))
    document = json.loads(json.dumps(kept.export()))
    (entry,) = verify_export(document, pki[0].verifier(NOW + 20 * 86400))
    assert (entry.worker, entry.receipts, entry.tokens) == (pki[1], 3, 768)
