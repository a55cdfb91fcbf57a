"""Receipts (auth/receipts.py): signed by a trainer, verified against the run's root alone; any
change to any field, another run's CA, a worker's credential or another trainer's name is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest

from agora.auth.credentials import issue_credential, make_issuing_ca, make_root_ca
from agora.auth.keys import generate_key, peer_id_of
from agora.auth.receipts import (Receipt, ReceiptError, SignedReceipt, receipt_from_json, receipt_problem,
                                 receipt_to_json, sign_receipt, verify_receipt)
from receipt_pki import NOW, RUN, receipt_pki


@pytest.fixture(scope="module")
def world():
    pki = receipt_pki()
    worker_key = generate_key()
    other_root = make_root_ca(RUN, generate_key(), now=NOW, lifetime_s=30 * 86400)
    other_issuing = make_issuing_ca(other_root, generate_key(), now=NOW, lifetime_s=86400)
    other_chain = issue_credential(other_issuing, pki.trainer_key.public_key(), run_id=RUN, role="trainer",
                                   stage=None, now=NOW, lifetime_s=3600)
    return dataclasses.make_dataclass("World", ["pki", "trainer_key", "trainer_chain", "worker_key",
                                                "worker_chain", "other_chain"])(
        pki, pki.trainer_key, pki.trainer_chain, worker_key, pki.credential(worker_key, "worker", 1), other_chain)


def receipt_of(world, **changes) -> Receipt:
    fields = dict(run_id=RUN, trainer=peer_id_of(world.trainer_key), worker=peer_id_of(world.worker_key), stage=1,
                  interval_start=NOW + 60.0, interval_end=NOW + 120.0, microbatches=12, tokens=12 * 256)
    return Receipt(**(fields | changes))


def verifier_of(world, *, now: float = NOW + 200.0):
    return world.pki.verifier(now)


def test_a_signed_receipt_verifies_against_the_runs_root_and_names_its_trainer(world):
    signed = sign_receipt(receipt_of(world), world.trainer_key, world.trainer_chain)
    identity = verify_receipt(signed, verifier_of(world))
    assert identity.role == "trainer" and identity.peer_id == signed.receipt.trainer


def test_a_receipt_still_verifies_long_after_the_trainers_credential_ran_out(world):
    signed = sign_receipt(receipt_of(world), world.trainer_key, world.trainer_chain)
    assert verify_receipt(signed, verifier_of(world, now=NOW + 20 * 86400)).role == "trainer"


@pytest.mark.parametrize("field, value", [
    ("run_id", "run-b"), ("worker", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"), ("stage", 2),
    ("interval_start", NOW + 61.0), ("interval_end", NOW + 121.0), ("microbatches", 13), ("tokens", 12 * 256 + 1),
])
def test_a_change_to_any_field_after_signing_is_refused(world, field, value):
    signed = sign_receipt(receipt_of(world), world.trainer_key, world.trainer_chain)
    tampered = dataclasses.replace(signed, receipt=dataclasses.replace(signed.receipt, **{field: value}))
    with pytest.raises(ReceiptError) as refused:
        verify_receipt(tampered, verifier_of(world))
    assert refused.value.reason == ("wrong_run" if field == "run_id" else "bad_signature")


def test_a_receipt_naming_another_trainer_is_refused(world):
    receipt = receipt_of(world, trainer=peer_id_of(world.worker_key))
    signed = sign_receipt(receipt, world.trainer_key, world.trainer_chain)
    with pytest.raises(ReceiptError, match="trainer: the receipt names") as refused:
        verify_receipt(signed, verifier_of(world))
    assert refused.value.reason == "not_signer"


def test_a_receipt_signed_under_another_roots_credential_is_refused(world):
    signed = sign_receipt(receipt_of(world), world.trainer_key, world.other_chain)
    with pytest.raises(ReceiptError, match="not signed by this run's CA") as refused:
        verify_receipt(signed, verifier_of(world))
    assert refused.value.reason == "untrusted"


def test_a_worker_cannot_sign_its_own_receipt(world):
    receipt = receipt_of(world, trainer=peer_id_of(world.worker_key))
    signed = sign_receipt(receipt, world.worker_key, world.worker_chain)
    with pytest.raises(ReceiptError, match="needs trainer or operator") as refused:
        verify_receipt(signed, verifier_of(world))
    assert refused.value.reason == "wrong_role"


def test_a_receipt_dated_after_its_credential_ran_out_is_refused(world):
    late = NOW + 2 * 3600
    signed = sign_receipt(receipt_of(world, interval_start=late - 60, interval_end=late), world.trainer_key,
                          world.trainer_chain)
    with pytest.raises(ReceiptError, match="interval_end: signed at") as refused:
        verify_receipt(signed, verifier_of(world, now=late))
    assert refused.value.reason == "expired"


def test_a_signature_by_another_key_with_the_trainers_chain_is_refused(world):
    signed = sign_receipt(receipt_of(world), world.worker_key, world.trainer_chain)
    with pytest.raises(ReceiptError) as refused:
        verify_receipt(signed, verifier_of(world))
    assert refused.value.reason == "bad_signature"


@pytest.mark.parametrize("changes, field", [
    ({"trainer": "not a peer id"}, "trainer"), ({"stage": -1}, "stage"), ({"tokens": 1.5}, "tokens"),
    ({"microbatches": True}, "microbatches"), ({"interval_end": NOW}, "interval_end"),
    ({"interval_start": float("nan")}, "interval_start"), ({"tokens": 3, "microbatches": 4}, "tokens"),
])
def test_out_of_bounds_fields_are_named(world, changes, field):
    problem = receipt_problem(receipt_of(world, **changes))
    assert problem is not None and problem.startswith(f"{field}:")
    signed = SignedReceipt(receipt_of(world, **changes), world.trainer_chain, b"x")
    with pytest.raises(ReceiptError, match=f"receipt: {field}:") as refused:
        verify_receipt(signed, verifier_of(world))
    assert refused.value.reason == "malformed"


def test_the_json_form_round_trips_and_names_what_is_missing(world):
    signed = sign_receipt(receipt_of(world), world.trainer_key, world.trainer_chain)
    text = json.dumps(receipt_to_json(signed))
    assert receipt_from_json(json.loads(text)) == signed
    broken = json.loads(text)
    del broken["receipt"]["tokens"]
    with pytest.raises(ReceiptError, match="receipt: expected the fields"):
        receipt_from_json(broken)
    with pytest.raises(ReceiptError, match="signature: expected base64"):
        receipt_from_json(json.loads(text) | {"signature": "%%"})
