"""A worker's round attestations (node/worker/attestations.py, monitor/attested_rounds.py): kept only when a
worker of its own stage attests it in a round near its own count, once per attester and round; refused
otherwise with a reason, a status and a count; said in a log line at most every few seconds; stored
append-only beside the receipts and exported in the ledger's form, which verifies against the root alone
and counts each round once however many members attest it. And whom a worker attests after a round."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sqlite3
import threading

import grpc
import pytest
from prometheus_client import CollectorRegistry

from agora.auth.keys import generate_key, peer_id_of
from agora.auth.receipts import Receipt, sign_receipt
from agora.auth.round_attestations import RoundAttestation, attestation_to_json, sign_attestation
from agora.auth.signed_statements import StatementError
from agora.dht.averaging import RoundResult
from agora.monitor.attested_rounds import verify_attestations
from agora.monitor.ledger import verify_export
from agora.monitor.metrics import sample_value
from agora.monitor.worker_metrics import WorkerMetrics
from agora.node.averaging.round_attestations import attested_members
from agora.node.rpc.auth_check import Caller
from agora.node.worker.attestations import (LOG_EVERY_S, MAX_ATTESTATION_BYTES, MAX_IN_FLIGHT_PER_CALLER,
                                            ROUND_WINDOW, AttestationService, KeptAttestations)
from agora.node.worker.receipts import KeptReceipts
from agora.protos.attestation_adapter import AttestationDelivery
from agora.protos.stage_adapter import StageRefusal
from fake_clock import FakeClock
from receipt_pki import NOW, RUN, receipt_pki

STAGE = 1
OWN_ROUND = 100  # this worker's round_bound in these tests


@dataclasses.dataclass(frozen=True)
class Member:
    key: object
    chain: bytes

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.key)


@pytest.fixture(scope="module")
def world():
    pki = receipt_pki()

    def member(role="worker", stage=STAGE) -> Member:
        key = generate_key()
        return Member(key, pki.credential(key, role, stage))

    return dataclasses.make_dataclass("World", ["pki", "me", "a", "b", "other_stage", "trainer"])(
        pki, member(), member(), member(), member(stage=STAGE + 1), member("trainer", None))


@pytest.fixture
def kept(tmp_path, world):
    store = KeptAttestations(tmp_path / "receipts.sqlite", world.me.peer_id, STAGE, world.pki.verifier(NOW + 600),
                             clock=lambda: NOW + 600)
    yield store
    store.close()


def attestation(world, by: Member, *, round_number=OWN_ROUND - 2, attested=None, stage=STAGE, run_id=RUN):
    fields = RoundAttestation(run_id, stage, round_number, by.peer_id, attested or world.me.peer_id, NOW + 300)
    return sign_attestation(fields, by.key, by.chain)


def service_of(kept, world, *, carrier: Member | None = None, registry=None, clock=None) -> AttestationService:
    identity = world.pki.verifier(NOW + 600).verify_issued((carrier or world.a).chain)
    service = AttestationService(kept, stage=STAGE, metrics=WorkerMetrics(registry or CollectorRegistry()),
                                 logger=logging.getLogger("test.attestations"),
                                 caller=lambda: Caller.of_identity(identity), clock=clock or FakeClock())
    service.rounds = lambda: OWN_ROUND
    return service


async def delivered(service: AttestationService, signed):
    text = json.dumps(attestation_to_json(signed)) if not isinstance(signed, str) else signed
    return await service.deliver_attestation(AttestationDelivery(text), None)


def deliver(service, signed):
    return asyncio.run(delivered(service, signed))


def refusal(service, signed) -> StageRefusal:
    with pytest.raises(StageRefusal) as refused:
        deliver(service, signed)
    return refused.value


def test_attested_rounds_are_kept_counted_once_each_and_said_at_most_every_few_seconds(kept, world, caplog):
    registry, clock = CollectorRegistry(), FakeClock(1000.0)
    service = service_of(kept, world, registry=registry, clock=clock)
    with caplog.at_level(logging.INFO, logger="test.attestations"):
        first = deliver(service, attestation(world, world.a, round_number=97))  # said at once
        deliver(service, attestation(world, world.b, round_number=97))  # the same round, by another member
        clock.now += 1.0
        deliver(service, attestation(world, world.a, round_number=98))
        deliver(service, attestation(world, world.a, round_number=99))
        assert len(caplog.records) == 1  # within LOG_EVERY_S of the last line
        clock.now += LOG_EVERY_S
        last = deliver(service, attestation(world, world.b, round_number=99))  # the next delivery says 98 and 99
        deliver(service, attestation(world, world.a, round_number=100))
        service.close()  # says the rounds not said yet
    assert (first.rounds, first.attestations, first.attesters) == (1, 1, 1)
    assert (last.rounds, last.attestations, last.attesters) == (3, 5, 2)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == (f"attestations: round 97 of stage {STAGE} attested by {world.a.peer_id[:12]}..; "
                        "all kept: 1 round attested (1 attestation from 1 member)")
    assert lines[1].startswith(f"attestations: 2 rounds (98..99) of stage {STAGE} attested by {world.a.peer_id[:12]}")
    assert lines[1].endswith("all kept: 3 rounds attested (5 attestations from 2 members)")
    assert lines[2].startswith("attestations: round 100 of stage") and len(lines) == 3
    assert sample_value(registry, "agora_worker_attested_rounds_total", {}) == 4
    assert sample_value(registry, "agora_worker_round_attestations_total", {}) == 6


@pytest.mark.parametrize("case, reason, code", [
    ("bad_signature", "bad_signature", grpc.StatusCode.INVALID_ARGUMENT),
    ("wrong_worker", "wrong_worker", grpc.StatusCode.INVALID_ARGUMENT),
    ("wrong_run", "wrong_run", grpc.StatusCode.INVALID_ARGUMENT),
    ("other_stage", "wrong_stage", grpc.StatusCode.PERMISSION_DENIED),
    ("self_attested", "self_attested", grpc.StatusCode.INVALID_ARGUMENT),
    ("by_trainer", "wrong_role", grpc.StatusCode.PERMISSION_DENIED),
    ("ahead", "far_round", grpc.StatusCode.INVALID_ARGUMENT),
    ("long_ago", "far_round", grpc.StatusCode.INVALID_ARGUMENT),
    ("duplicate", "duplicate", grpc.StatusCode.ALREADY_EXISTS),
    ("oversized", "oversized", grpc.StatusCode.INVALID_ARGUMENT),
    ("not_json", "malformed", grpc.StatusCode.INVALID_ARGUMENT),
])
def test_a_bad_attestation_is_refused_with_its_reason_counted_and_never_kept(kept, world, case, reason, code):
    registry = CollectorRegistry()
    service = service_of(kept, world, registry=registry)
    good = attestation(world, world.a)
    bad = {
        "bad_signature": dataclasses.replace(good, attestation=dataclasses.replace(good.attestation, round=99)),
        "wrong_worker": attestation(world, world.a, attested=world.b.peer_id),
        "wrong_run": attestation(world, world.a, run_id="run-b"),
        "other_stage": attestation(world, world.other_stage, stage=STAGE + 1),
        "self_attested": attestation(world, world.me),
        "by_trainer": attestation(world, world.trainer),
        "ahead": attestation(world, world.a, round_number=OWN_ROUND + 1),
        "long_ago": attestation(world, world.a, round_number=OWN_ROUND - ROUND_WINDOW - 1),
        "duplicate": good,
        "oversized": json.dumps(attestation_to_json(good) | {"padding": "x" * MAX_ATTESTATION_BYTES}),
        "not_json": "{attestation",
    }[case]
    if case == "duplicate":
        deliver(service, good)
    refused = refusal(service, bad)
    assert (refused.code, refused.message.split(":")[0]) == (code, f"attestation refused ({reason})")
    assert sample_value(registry, "agora_worker_round_attestations_refused_total", {"reason": reason}) == 1
    assert kept.totals()[1] == (1 if case == "duplicate" else 0)


def test_only_a_worker_of_its_own_stage_may_deliver_and_a_worker_without_rounds_or_root_keeps_none(kept, world):
    carried = refusal(service_of(kept, world, carrier=world.other_stage), attestation(world, world.a))
    assert carried.code == grpc.StatusCode.PERMISSION_DENIED and "only the stage's replicas" in carried.message
    no_loop = service_of(kept, world)
    no_loop.rounds = None
    assert "runs no averaging rounds" in refusal(no_loop, attestation(world, world.a)).message
    insecure = AttestationService(None, stage=STAGE, metrics=None, logger=logging.getLogger("test.attestations"))
    refused = refusal(insecure, attestation(world, world.a))
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and "--insecure" in refused.message
    assert kept.totals() == (0, 0, 0)


def test_one_member_has_at_most_a_few_deliveries_in_verification_at_once(tmp_path, world):
    release = threading.Event()

    class HeldKept(KeptAttestations):  # verification that takes until the test releases it
        def keep(self, signed, round_bound):
            release.wait(10)
            return super().keep(signed, round_bound)

    held = HeldKept(tmp_path / "receipts.sqlite", world.me.peer_id, STAGE, world.pki.verifier(NOW + 600))
    service = service_of(held, world)

    async def main():
        waiting = [asyncio.ensure_future(delivered(service, attestation(world, world.a, round_number=90 + i)))
                   for i in range(MAX_IN_FLIGHT_PER_CALLER)]
        await asyncio.sleep(0)  # each has taken its place
        with pytest.raises(StageRefusal) as busy:
            await delivered(service, attestation(world, world.a, round_number=99))
        release.set()
        return busy.value, await asyncio.gather(*waiting)

    busy, answers = asyncio.run(main())
    held.close()
    assert busy.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "(busy)" in busy.message
    assert max(answer.attestations for answer in answers) == MAX_IN_FLIGHT_PER_CALLER


def test_attestations_are_append_only_beside_the_receipts_and_export_with_them(kept, world, tmp_path):
    receipts = KeptReceipts(kept.table.path, world.me.peer_id, world.pki.verifier(NOW + 600))
    pki = world.pki
    receipts.keep(sign_receipt(Receipt(RUN, peer_id_of(pki.trainer_key), world.me.peer_id, STAGE, NOW + 10, NOW + 20,
                                       2, 64), pki.trainer_key, pki.trainer_chain))
    for by, round_number in ((world.a, 97), (world.b, 97), (world.a, 98)):
        kept.keep(attestation(world, by, round_number=round_number), OWN_ROUND)
    db = sqlite3.connect(kept.table.path)
    for statement in ("UPDATE attestations SET round = 1", "DELETE FROM attestations"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            db.execute(statement)
    db.close()
    document = json.loads(json.dumps({**receipts.export(), **kept.export()}))
    receipts.close()
    later = pki.verifier(NOW + 20 * 86400)
    (contributor,) = verify_export(document, later)
    (rounds,) = verify_attestations(document, later)
    assert (contributor.worker, contributor.tokens) == (world.me.peer_id, 64)
    assert (rounds.worker, rounds.rounds, rounds.attestations, rounds.stages) == (world.me.peer_id, 2, 3, [STAGE])
    assert rounds.attesters == sorted([world.a.peer_id, world.b.peer_id])


def test_an_export_with_a_changed_total_a_repeated_or_a_self_attested_entry_is_refused(kept, world):
    for round_number in (97, 98):
        kept.keep(attestation(world, world.a, round_number=round_number), OWN_ROUND)
    verifier = world.pki.verifier(NOW + 600)
    document = json.loads(json.dumps(kept.export()))
    inflated = json.loads(json.dumps(document))
    inflated["attested_rounds"][0]["rounds"] = 3
    repeated = json.loads(json.dumps(document))
    repeated["attestations"].append(repeated["attestations"][0])
    self_attested = json.loads(json.dumps(document))
    self_attested["attestations"].append({"signed": attestation_to_json(attestation(world, world.me))})
    expected = [(inflated, "malformed", "attested_rounds:"), (repeated, "duplicate", "attestations[2]:"),
                (self_attested, "self_attested", "attestations[2]:")]
    for changed, reason, names in expected:
        with pytest.raises(StatementError) as refused:
            verify_attestations(changed, verifier)
        assert refused.value.reason == reason and str(refused.value).startswith(names)
    assert verify_attestations({"receipts": []}, verifier) == []  # an export without attestations: no rounds


def test_a_committed_round_attests_its_other_members_that_brought_weight():
    result = RoundResult("committed", 5, None, participants=("me", "a", "syncing", "b"), weights=(1.0, 3.0, 0.0, 1.0))
    assert attested_members(result, "me") == ["a", "b"]  # a replica still syncing (weight 0) is not attested
    assert attested_members(dataclasses.replace(result, weights=()), "me") == ["a", "syncing", "b"]
    for outcome in ("alone", "failed", "rejected", "cancelled"):
        assert attested_members(dataclasses.replace(result, outcome=outcome), "me") == []
