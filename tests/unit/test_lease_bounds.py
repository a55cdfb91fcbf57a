"""The bounds on what a trainer's lease entry may state (dht/records.py, dht/store_checks.py,
dht/leases.py): pure, no DHT. Over a real DHT: tests/integration/test_hostile_leases.py."""

from __future__ import annotations

import logging
import struct
import time

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.dht.storage import DictionaryDHTValue

from agora.dht.entry_value import CHAIN_MARK, record_bytes
from agora.dht.leases import LeaseBoard, renewed_claim
from agora.dht.keys import trainer_key, units_key
from agora.dht.record_fields import RecordError
from agora.dht.records import CLOCK_SKEW_S, MAX_CLAIM_AGE_S, MAX_CLAIMS, MAX_LEASE_S, UnitBlockRecord, claim_problem
from agora.dht.store_checks import RefusedEntries, StoreTimes, refusal_kind
from agora.node.trainer.options import TrainerOptions
from agora.pipeline.schema import ConfigError, checked

NOW = float(int(time.time()))  # a real time: hivemind drops dictionary items that expired by its clock
_CLAIM = struct.Struct("<Hdd")


def entry(claims: dict, updated_at: float = NOW, block: int = 0) -> UnitBlockRecord:
    return UnitBlockRecord.build("QmT", "run", block, set(), claims, updated_at)


def wire_with_claims(packed: bytes, updated_at: float = NOW) -> dict:
    """An entry's wire form with claims that `build` would refuse (what a hostile writer sends)."""
    return {**entry({}, updated_at).to_wire(), "claims": packed}


def test_a_claim_lies_near_its_entry_s_time_and_within_the_longest_lease():
    assert claim_problem(NOW - 10, NOW + 30, NOW) is None  # claimed, stored, renewed: honest
    assert claim_problem(NOW - MAX_CLAIM_AGE_S + 30, NOW + 30, NOW) is None  # held an hour by renewals
    assert claim_problem(NOW + 1, NOW + 31, NOW) is None  # a writer's clock that stepped back a second
    assert "not after it was claimed" in claim_problem(NOW, NOW, NOW)
    assert "claimed 61 s after its entry was written" in claim_problem(NOW + 61, NOW + 90, NOW)
    assert "more than the longest lease (600 s)" in claim_problem(NOW, NOW + MAX_LEASE_S + CLOCK_SKEW_S + 1, NOW)
    # Dated back beyond what renewals may hold, with a short lease: refused (the length alone would pass).
    assert "more than a claim may be held by renewals (3600 s)" in claim_problem(NOW - 7200, NOW + 30, NOW)
    # The squatter of the brief: claimed at the dawn of time, expiring at its end.
    with pytest.raises(RecordError, match=r"units.claims: the claim of unit 3 expires .* longest lease"):
        UnitBlockRecord.from_wire(wire_with_claims(_CLAIM.pack(3, -1e300, 1e300)))
    with pytest.raises(RecordError, match="units.claims: the claim of unit 259 .* held by renewals"):
        UnitBlockRecord.build("QmT", "run", 1, set(), {259: (NOW - 7200, NOW + 30)}, NOW)


def test_an_entry_holds_at_most_max_claims_one_per_unit():
    entry({unit: (NOW, NOW + 30) for unit in range(MAX_CLAIMS)})
    with pytest.raises(RecordError, match=f"units.claims: {MAX_CLAIMS + 1} claims, more than one entry may hold"):
        entry({unit: (NOW, NOW + 30) for unit in range(MAX_CLAIMS + 1)})
    twice = _CLAIM.pack(5, NOW, NOW + 30) + _CLAIM.pack(5, NOW - 1, NOW + 30)
    with pytest.raises(RecordError, match="units.claims: a unit is claimed twice in one entry"):
        UnitBlockRecord.from_wire(wire_with_claims(twice))


def test_an_entry_is_written_now_when_stored_and_never_ahead_of_now_when_read():
    record = entry({3: (NOW - 5, NOW + 30)})
    assert record.untimely(NOW, storing=True) is None
    assert record.untimely(NOW + 3600, storing=False) is None  # an honest entry read an hour later
    assert "written 3.6e+03 s ago" in record.untimely(NOW + 3600, storing=True)
    ahead = entry({3: (NOW + 995, NOW + 1030)}, updated_at=NOW + 1000)
    assert "written 1e+03 s ahead of this peer's clock" in ahead.untimely(NOW, storing=False)
    assert ahead.untimely(NOW, storing=True) is not None


def signed_value(record: UnitBlockRecord | None) -> bytes:
    """A value as it travels: msgpack, the writer's credential, hivemind's signature."""
    attachment = b"ABC" + (3).to_bytes(2, "big") + b"\x01" + CHAIN_MARK  # a one-"certificate" chain
    return MSGPackSerializer.dumps(None if record is None else record.to_wire()) + attachment + b"[signature:xyz]"


def store_request(items: list[tuple[str, bytes, bytes]]) -> dht_pb2.StoreRequest:
    return dht_pb2.StoreRequest(keys=[DHTID.generate(source=key).to_bytes() for key, _, _ in items],
                                subkeys=[tag for _, tag, _ in items], values=[value for _, _, value in items],
                                expiration_time=[NOW + 60] * len(items), in_cache=[False] * len(items))


def test_a_store_of_a_unit_entry_not_written_now_is_refused_whatever_carries_it():
    times = StoreTimes("run", unwrap=record_bytes)
    subkey = MSGPackSerializer.dumps("QmT[owner:ssh-rsa AAAA]")
    fresh, stale = entry({3: (NOW - 5, NOW + 30)}), entry({}, updated_at=NOW - 300)
    assert times.problem(store_request([(units_key("run", 0), subkey, signed_value(fresh))]), NOW) is None
    assert "written 300 s ago" in times.problem(
        store_request([(units_key("run", 0), subkey, signed_value(stale))]), NOW)
    # Behind another item of the same request, and inside a whole dictionary stored at once.
    dictionary = DictionaryDHTValue()
    # hivemind keeps a dictionary item only while it lives by its own clock, and this module's NOW
    # was read at collection, minutes before the test runs in a whole suite.
    dictionary.store("QmT[owner:ssh-rsa AAAA]", signed_value(stale), time.time() + 600)
    whole = store_request([(units_key("run", 7), DHTProtocol.IS_DICTIONARY, MSGPackSerializer.dumps(dictionary))])
    assert "written 300 s ago" in times.problem(whole, NOW)
    mixed = store_request([(units_key("run", 0), subkey, signed_value(fresh)),
                           (units_key("run", 1), subkey, signed_value(stale))])
    assert "written 300 s ago" in times.problem(mixed, NOW)
    # Other keys, another run's blocks, tombstones and unreadable values are the validators' business.
    assert times.problem(store_request([(trainer_key("run"), subkey, signed_value(stale)),
                                        (units_key("other", 0), subkey, signed_value(stale)),
                                        (units_key("run", 2), subkey, signed_value(None)),
                                        (units_key("run", 3), subkey, b"\xc1garbage")]), NOW) is None


def test_renewals_hold_a_claim_for_max_claim_age_then_make_it_anew():
    assert renewed_claim(NOW, NOW + 10, 30.0) == (NOW, NOW + 40)
    assert renewed_claim(NOW, NOW + MAX_CLAIM_AGE_S - 30, 30.0) == (NOW, NOW + MAX_CLAIM_AGE_S)
    late = NOW + MAX_CLAIM_AGE_S - 20
    assert renewed_claim(NOW, late, 30.0) == (late, late + 30)  # claimed anew, now
    claimed_at, expires_at = renewed_claim(NOW, late, 30.0)
    assert claim_problem(claimed_at, expires_at, late) is None


def test_no_trainer_takes_a_lease_peers_would_refuse():
    with pytest.raises(ValueError, match=r"lease_s must be in \(0, 600\]"):
        LeaseBoard(object(), run_id="run", lease_s=MAX_LEASE_S + 1)
    with pytest.raises(ConfigError, match="lease_s"):
        checked(TrainerOptions, "trainer", run_id="run", lease_s=MAX_LEASE_S + 1)
    assert checked(TrainerOptions, "trainer", run_id="run", lease_s=MAX_LEASE_S).lease_s == MAX_LEASE_S


def test_refusals_are_counted_by_kind_and_the_first_of_each_kind_is_a_warning(caplog):
    assert refusal_kind("units.claims: the claim of unit 3 ...", "units") == "units.claims"
    assert refusal_kind("subkey is not the record's peer_id 'Qm...'", "units") == "units"
    refused = RefusedEntries()
    with caplog.at_level(logging.DEBUG, logger="agora.dht.store_checks"):
        for _ in range(3):
            refused.add("units.claims", "refusing a units entry: units.claims: ...")
        refused.add("units.updated_at", "refusing a units entry: units.updated_at: ...")
    assert refused.snapshot() == {"units.claims": 3, "units.updated_at": 1}
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.DEBUG, logging.DEBUG, logging.WARNING]
