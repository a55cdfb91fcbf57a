"""The monitor's ledger (monitor/ledger.py): only verified receipts are stored, each once, never changed;
the contributors' totals are the sums of the receipts, and an export re-verifies against the root alone."""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import pytest
from prometheus_client import CollectorRegistry

from agora.auth.credentials import CredentialVerifier, make_root_ca
from agora.auth.keys import generate_key, peer_id_of
from agora.auth.receipts import Receipt, ReceiptError, sign_receipt
from agora.monitor.ledger import (LedgerMetrics, ReceiptLedger, ServedCount, StoredReceipt, contributors,
                                  overclaim, verify_export)
from agora.monitor.metrics import sample_value
from receipt_pki import NOW, RUN, receipt_pki


@pytest.fixture(scope="module")
def pki():
    made = receipt_pki()
    other_root = make_root_ca(RUN, generate_key(), now=NOW, lifetime_s=30 * 86400)
    workers = [peer_id_of(generate_key()) for _ in range(2)]
    return made.root, made.trainer_key, made.trainer_chain, other_root, workers


@pytest.fixture
def ledger(tmp_path, pki):
    root = pki[0]
    registry = CollectorRegistry()
    opened = ReceiptLedger(tmp_path / "ledger.sqlite", CredentialVerifier(root.pem, RUN, clock=lambda: NOW + 600),
                           LedgerMetrics(registry), clock=lambda: NOW + 600)
    yield opened, registry
    opened.close()


def signed(pki, worker: int, start: float, microbatches: int = 4, tokens_each: int = 100):
    _, trainer, chain, _, workers = pki
    return sign_receipt(Receipt(RUN, peer_id_of(trainer), workers[worker], worker, NOW + start, NOW + start + 30,
                                microbatches, microbatches * tokens_each), trainer, chain)


def test_verified_receipts_are_summed_per_contributor(ledger, pki):
    book, registry = ledger
    for start in (0, 30, 60):
        book.append(signed(pki, 0, start))
    book.append(signed(pki, 1, 0, microbatches=2))
    first, second = book.contributors()
    assert (first.worker, first.tokens, first.microbatches, first.receipts) == (pki[4][0], 1200, 12, 3)
    assert (first.first_seen, first.last_seen) == (NOW, NOW + 90)
    assert (second.tokens, second.receipts, second.stages) == (200, 1, [1])
    assert sample_value(registry, "agora_ledger_receipts_total", {}) == 4


def test_a_duplicate_receipt_is_refused_counted_and_moves_no_total(ledger, pki):
    book, registry = ledger
    book.append(signed(pki, 0, 0))
    with pytest.raises(ReceiptError, match="already has a receipt") as refused:
        book.append(signed(pki, 0, 0, microbatches=40))  # same interval, more claimed: still the same interval
    assert refused.value.reason == "duplicate"
    assert book.contributors()[0].tokens == 400
    assert sample_value(registry, "agora_ledger_receipts_refused_total", {"reason": "duplicate"}) == 1


def test_a_receipt_failing_verification_is_counted_and_never_stored(ledger, pki):
    book, registry = ledger
    tampered = signed(pki, 0, 0)
    tampered = dataclasses.replace(tampered, receipt=dataclasses.replace(tampered.receipt, tokens=10 ** 6))
    with pytest.raises(ReceiptError, match="signature:"):
        book.append(tampered)
    assert book.rows() == []
    assert sample_value(registry, "agora_ledger_receipts_refused_total", {"reason": "bad_signature"}) == 1


def test_the_table_refuses_updates_and_deletes(ledger, pki):
    book, _ = ledger
    book.append(signed(pki, 0, 0))
    db = sqlite3.connect(book.path)
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        db.execute("UPDATE receipts SET tokens = 1")
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        db.execute("DELETE FROM receipts")
    db.close()
    assert book.rows()[0].tokens == 400


def test_a_receipt_claiming_more_than_the_worker_served_is_flagged_and_summed_apart(ledger, pki):
    book, registry = ledger
    since = NOW - 10
    assert book.append(signed(pki, 0, 0), ServedCount(tokens=900, since=since)).flag == ""
    flagged = book.append(signed(pki, 0, 30), ServedCount(tokens=700, since=since))  # 800 claimed > 700
    assert "claims 800 tokens" in flagged.flag and "counts 700" in flagged.flag
    entry = book.contributors()[0]
    assert (entry.tokens, entry.flagged_tokens, entry.flagged_receipts) == (400, 400, 1)
    assert sample_value(registry, "agora_ledger_receipts_flagged_total", {}) == 1


def test_overclaim_counts_only_claims_since_the_worker_started():
    assert overclaim(500, ServedCount(tokens=500, since=0.0)) == ""
    assert overclaim(501, ServedCount(tokens=500, since=0.0)).startswith("the trainer claims 501")
    assert overclaim(10 ** 9, None) == ""


def test_an_export_reverifies_against_the_root_and_refuses_a_changed_total_or_another_root(ledger, pki):
    book, _ = ledger
    book.append(signed(pki, 0, 0))
    book.append(signed(pki, 1, 0))
    document = json.loads(json.dumps(book.export()))
    verifier = CredentialVerifier(pki[0].pem, RUN, clock=lambda: NOW + 86400 * 20)
    assert [c.tokens for c in verify_export(document, verifier)] == [400, 400]
    inflated = json.loads(json.dumps(document))
    inflated["contributors"][0]["tokens"] += 1
    with pytest.raises(ReceiptError, match="contributors: the stated totals"):
        verify_export(inflated, verifier)
    edited = json.loads(json.dumps(document))
    edited["receipts"][1]["signed"]["receipt"]["tokens"] = 4000
    with pytest.raises(ReceiptError, match=r"receipts\[1\]: signature:"):
        verify_export(edited, verifier)
    doubled = json.loads(json.dumps(document))
    doubled["receipts"].append(doubled["receipts"][0])
    with pytest.raises(ReceiptError, match=r"receipts\[2\]: a second receipt"):
        verify_export(doubled, verifier)
    with pytest.raises(ReceiptError, match=r"receipts\[0\]: chain: .*not signed by this run's CA"):
        verify_export(document, CredentialVerifier(pki[3].pem, RUN, clock=lambda: NOW))


def test_contributors_is_pure_and_orders_by_tokens():
    rows = [StoredReceipt("T", "a", 0, 5.0, 6.0, 1, 10, 0.0, ""), StoredReceipt("T", "b", 1, 1.0, 2.0, 3, 30, 0.0, ""),
            StoredReceipt("U", "a", 0, 2.0, 9.0, 1, 10, 0.0, "")]
    a_entry = contributors(rows)[1]
    assert [c.worker for c in contributors(rows)] == ["b", "a"]
    assert (a_entry.tokens, a_entry.trainers, a_entry.first_seen, a_entry.last_seen) == (20, ["T", "U"], 2.0, 9.0)
