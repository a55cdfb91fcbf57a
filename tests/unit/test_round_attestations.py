"""Round attestations (auth/round_attestations.py): one worker of a stage signs that another member completed
an averaging round with it; verified against the run's root alone. Any change to a field, a credential of
another stage or role, an attester naming someone else or itself, another root: each refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest

from agora.auth.keys import generate_key, peer_id_of
from agora.auth.round_attestations import (RoundAttestation, SignedAttestation, attestation_from_json,
                                           attestation_problem, attestation_to_json, sign_attestation,
                                           verify_addressed_attestation, verify_attestation)
from agora.auth.signed_statements import StatementError
from receipt_pki import NOW, RUN, receipt_pki

STAGE = 1


@pytest.fixture(scope="module")
def world():
    pki = receipt_pki()
    attester_key, attested_key = generate_key(), generate_key()
    return dataclasses.make_dataclass("World", ["pki", "key", "chain", "attested_key", "attested_chain"])(
        pki, attester_key, pki.credential(attester_key, "worker", STAGE), attested_key,
        pki.credential(attested_key, "worker", STAGE))


def attestation_of(world, **changes) -> RoundAttestation:
    fields = dict(run_id=RUN, stage=STAGE, round=42, attester=peer_id_of(world.key),
                  attested=peer_id_of(world.attested_key), completed_at=NOW + 120.0)
    return RoundAttestation(**(fields | changes))


def refusal(signed, verifier) -> StatementError:
    with pytest.raises(StatementError) as refused:
        verify_attestation(signed, verifier)
    return refused.value


def test_a_signed_attestation_verifies_against_the_runs_root_and_names_its_attester(world):
    signed = sign_attestation(attestation_of(world), world.key, world.chain)
    identity = verify_attestation(signed, world.pki.verifier())
    assert (identity.role, identity.stage, identity.peer_id) == ("worker", STAGE, signed.attestation.attester)
    assert verify_attestation(signed, world.pki.verifier(NOW + 20 * 86400)).peer_id == identity.peer_id  # years on


@pytest.mark.parametrize("field, value, reason", [
    ("run_id", "run-b", "wrong_run"), ("stage", 2, "wrong_stage"), ("round", 43, "bad_signature"),
    ("attested", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "bad_signature"),
    ("completed_at", NOW + 121.0, "bad_signature"),
])
def test_a_change_to_any_field_after_signing_is_refused(world, field, value, reason):
    signed = sign_attestation(attestation_of(world), world.key, world.chain)
    tampered = dataclasses.replace(signed, attestation=dataclasses.replace(signed.attestation, **{field: value}))
    assert refusal(tampered, world.pki.verifier()).reason == reason


def test_a_worker_attesting_itself_is_refused_whoever_reads_it(world):
    mine = peer_id_of(world.key)
    signed = sign_attestation(attestation_of(world, attested=mine), world.key, world.chain)
    error = refusal(signed, world.pki.verifier())
    assert error.reason == "self_attested" and "attests itself" in str(error)


def test_an_attestation_naming_another_attester_is_refused(world):
    signed = sign_attestation(attestation_of(world, attester=peer_id_of(generate_key())), world.key, world.chain)
    error = refusal(signed, world.pki.verifier())
    assert error.reason == "not_signer" and str(error).startswith("attester: the attestation names")


def test_only_a_worker_of_the_rounds_stage_attests_it(world):
    trainer_chain = world.pki.credential(world.key, "trainer")
    other_stage = world.pki.credential(world.key, "worker", STAGE + 1)
    by_trainer = refusal(sign_attestation(attestation_of(world), world.key, trainer_chain), world.pki.verifier())
    assert by_trainer.reason == "wrong_role" and "needs worker" in str(by_trainer)
    by_other_stage = refusal(sign_attestation(attestation_of(world), world.key, other_stage), world.pki.verifier())
    assert by_other_stage.reason == "wrong_stage" and "of stage 1" in str(by_other_stage)


def test_a_credential_of_another_root_or_a_time_outside_its_validity_is_refused(world):
    foreign = receipt_pki().credential(world.key, "worker", STAGE)
    assert refusal(sign_attestation(attestation_of(world), world.key, foreign), world.pki.verifier()).reason == \
        "untrusted"
    late = sign_attestation(attestation_of(world, completed_at=NOW + 2 * 3600), world.key, world.chain)
    error = refusal(late, world.pki.verifier(NOW + 3 * 3600))
    assert error.reason == "expired" and str(error).startswith("completed_at: signed at")


def test_a_signature_by_another_key_is_refused(world):
    signed = sign_attestation(attestation_of(world), world.attested_key, world.chain)
    assert refusal(signed, world.pki.verifier()).reason == "bad_signature"


@pytest.mark.parametrize("changes, field", [
    ({"attester": "not a peer id"}, "attester"), ({"stage": -1}, "stage"), ({"round": 1.5}, "round"),
    ({"round": True}, "round"), ({"completed_at": float("inf")}, "completed_at"), ({"run_id": "a b"}, "run_id"),
])
def test_out_of_bounds_fields_are_named_and_never_signed(world, changes, field):
    attestation = attestation_of(world, **changes)
    assert attestation_problem(attestation).startswith(f"{field}:")
    with pytest.raises(ValueError, match=f"attestation: {field}:"):
        sign_attestation(attestation, world.key, world.chain)
    error = refusal(SignedAttestation(attestation, world.chain, b"x"), world.pki.verifier())
    assert error.reason == "malformed" and str(error).startswith(f"attestation: {field}:")


def test_the_worker_it_names_keeps_it_only_for_itself_and_its_stage(world):
    signed = sign_attestation(attestation_of(world), world.key, world.chain)
    attested, verifier = peer_id_of(world.attested_key), world.pki.verifier()
    assert verify_addressed_attestation(signed, verifier, attested, STAGE).peer_id == signed.attestation.attester
    with pytest.raises(StatementError, match="attested: the attestation is for worker") as other_worker:
        verify_addressed_attestation(signed, verifier, peer_id_of(world.key), STAGE)
    assert other_worker.value.reason == "wrong_worker"
    with pytest.raises(StatementError, match="this worker hosts stage 2") as other_stage:
        verify_addressed_attestation(signed, verifier, attested, STAGE + 1)
    assert other_stage.value.reason == "wrong_stage"


def test_the_json_form_round_trips_and_names_what_is_missing(world):
    signed = sign_attestation(attestation_of(world), world.key, world.chain)
    text = json.dumps(attestation_to_json(signed))
    assert attestation_from_json(json.loads(text)) == signed
    broken = json.loads(text)
    del broken["attestation"]["round"]
    with pytest.raises(StatementError, match="attestation: expected the fields"):
        attestation_from_json(broken)
    with pytest.raises(StatementError, match="chain: expected"):
        attestation_from_json(json.loads(text) | {"chain": 7})
