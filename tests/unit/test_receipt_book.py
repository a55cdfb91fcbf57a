"""A trainer's receipt book (node/trainer/receipts.py): accepted work per worker, signed every N global
batches, a flagged worker's interval withheld; and a worker's own count read from its metrics text."""

from __future__ import annotations

from collections import Counter

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agora.auth.keys import peer_id_of
from agora.auth.receipts import verify_receipt
from agora.monitor.served_counts import served_from_metrics
from agora.monitor.worker_metrics import MAX_SERVED_TRAINERS, WorkerMetrics
from agora.node.trainer.receipts import ReceiptBook
from receipt_pki import NOW, RUN, receipt_pki

A, B = "QmWorkerAaaaaaaaaa", "QmWorkerBbbbbbbbbb"


class Clock:
    def __init__(self):
        self.now = NOW + 10

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture(scope="module")
def signer():
    pki = receipt_pki()
    return pki.trainer_key, pki.trainer_chain, pki.verifier(NOW + 100)


def book_of(signer, every: int, flagged=frozenset()):
    key, chain, _ = signer
    delivered = []
    book = ReceiptBook(RUN, peer_id_of(key), every, lambda: (key, chain), flagged=lambda peer: peer in flagged,
                       deliver=delivered.append, wall_clock=Clock())
    return book, delivered


def test_every_n_batches_each_worker_gets_one_receipt_of_its_accepted_share(signer):
    book, delivered = book_of(signer, every=2)
    book.batch_served([Counter({A: 3}), Counter({B: 2})], tokens_per_microbatch=64)
    assert delivered == []  # one batch of two: the interval is open
    book.batch_served([Counter({A: 1}), Counter({B: 0})], tokens_per_microbatch=64)  # a share taken back: no work
    (receipts,) = delivered
    by_worker = {r.receipt.worker: r.receipt for r in receipts}
    assert (by_worker[A].microbatches, by_worker[A].tokens, by_worker[A].stage) == (4, 256, 0)
    assert (by_worker[B].microbatches, by_worker[B].tokens, by_worker[B].stage) == (2, 128, 1)
    for signed in receipts:
        assert verify_receipt(signed, signer[2]).peer_id == signed.receipt.trainer
    assert by_worker[A].interval_start < by_worker[A].interval_end


def test_intervals_follow_one_another_and_the_last_one_closes_however_short(signer):
    book, delivered = book_of(signer, every=1)
    book.batch_served([Counter({A: 2})], 10)
    book.batch_served([Counter({A: 2})], 10)
    assert book.close_interval() == []  # nothing since: no receipt
    first, second = (batch[0].receipt for batch in delivered)
    assert first.interval_end == second.interval_start
    assert book.signed == 2


def test_a_flagged_workers_interval_is_withheld(signer):
    book, delivered = book_of(signer, every=5, flagged={B})
    book.batch_served([Counter({A: 2, B: 2})], 10)
    receipts = book.close_interval()
    assert delivered == [receipts]
    assert [r.receipt.worker for r in receipts] == [A]
    assert book.withheld == {B: 20}


def test_a_workers_own_count_is_read_from_its_metrics_text():
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    metrics.served("QmTrainer1111111111", 300)
    text = generate_latest(registry).decode()
    served = served_from_metrics(text, "QmTrainer1111111111")
    assert served.tokens == 300 and served.since > 0
    assert served_from_metrics(text, "QmNeverServed111111").tokens == 0  # never served: counts nothing
    assert served_from_metrics("", "QmTrainer1111111111") is None  # no such series: unknown, no verdict


def test_the_served_series_are_capped():
    metrics = WorkerMetrics(CollectorRegistry())
    for index in range(MAX_SERVED_TRAINERS + 5):
        metrics.served(f"trainer{index}", 1)
    assert len(metrics._served_trainers) == MAX_SERVED_TRAINERS + 1  # the last five share "other"
