"""DHT records (pure: dht/records.py, record_fields.py, keys.py, key_families.py): each family's wire form, its
fields' types and bounds, and its keys.

The wire bytes below were produced by the released record code; a peer of this version must
write exactly them and read them back, or peers of the two versions stop seeing each other.
"""

import math
import struct
from typing import Literal, get_args, get_origin

import msgpack
import pytest
from pydantic import ValidationError

from agora.dht.key_families import KEY_FAMILIES, MAX_HEARTBEAT_S, typed_keys
from agora.dht.keys import move_key, rounds_key, trainer_key, units_key, worker_key
from agora.dht.record_fields import RecordError
from agora.dht.records import CLOCK_SKEW_S, MoveRecord, RoundRecord, TrainerRecord, WorkerRecord
from agora.pipeline.config import MAX_MATCHMAKING_S
from record_samples import SAMPLES

WIRE_BYTES = {
    "worker": (
        "de0015a6736368656d6102a46b696e64a6776f726b6572a7706565725f6964a7516d5065657241a672756e5f6964a572756e2d31"
        "a8656e64706f696e74ab5b3a3a315d3a3530303531a5737461676501a86e5f73746167657303aa7468726f756768707574cb405e"
        "e00000000000ab71756575655f646570746802a4737465700aa57068617365a66d656d626572a776657273696f6ea5302e312e30"
        "aa757064617465645f6174cb408f420000000000ab66696e6765727072696e74af736565643d303b7374616765733d33a8736573"
        "73696f6e7304b06d6574726963735f656e64706f696e74ae3132372e302e302e313a39313030b0617665726167696e675f726f75"
        "6e647307b3617665726167696e675f636f6d6d697474656406a8636170616369747908a76372656469747304b1696e5f666c6967"
        "68745f6372656469747302"),
    "trainer": (
        "8ca6736368656d6102a46b696e64a7747261696e6572a7706565725f6964a9516d547261696e6572a672756e5f6964a572756e2d"
        "31ad747261696e65725f696e64657801a7626174636865730ca4737465700ba46c6f7373cb400a000000000000ac746f6b656e73"
        "5f7065725f73cb4097720000000000a776657273696f6ea5302e312e30aa757064617465645f6174cb408f440000000000b06d65"
        "74726963735f656e64706f696e74b1686f73742e6578616d706c653a39313031"),
    "move": (
        "87a6736368656d6102a46b696e64a46d6f7665a7706565725f6964a7516d5065657241a672756e5f6964a572756e2d31aa66726f"
        "6d5f737461676500a8746f5f737461676502aa737461727465645f6174cb408f380000000000"),
    "round": (
        "88a6736368656d6102a46b696e64a5726f756e64a7706565725f6964a7516d5065657241a672756e5f6964a572756e2d31a57374"
        "61676501a5726f756e6407aa737461727465645f6174cb4029000000000000a6636c6f736564c3"),
    # No credential field since the writer's chain rides only as the entry's attachment (dht/entry_value.py):
    # a reader of the version before reads this record with an empty one (its DHT validator has refused
    # the attachment's new format before that).
    "units": (
        "88a6736368656d6102a46b696e64a5756e697473a7706565725f6964a9516d547261696e6572a672756e5f6964a572756e2d31a5"
        "626c6f636b01a9636f6d6d6974746564c42001000000001000000000000000000000000000000000000000000000000000"
        "00a6636c61696d73c412010000000000000024400000000000004440aa757064617465645f6174cb4025000000000000"),
}


def packed(wire: dict) -> bytes:
    """What hivemind's MSGPackSerializer puts on the wire for a plain dict."""
    return msgpack.packb(wire, use_bin_type=True, strict_types=True)


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_every_record_family_writes_the_released_wire_bytes(kind):
    record = SAMPLES[kind]
    assert record.KIND == kind
    assert packed(record.to_wire()).hex() == WIRE_BYTES[kind]


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_every_record_family_reads_the_released_wire_bytes(kind):
    record = SAMPLES[kind]
    wire = msgpack.unpackb(bytes.fromhex(WIRE_BYTES[kind]), raw=False)
    assert type(record).from_wire(wire) == record


def test_a_record_of_an_older_peer_reads_with_the_defaults_and_a_newer_ones_extra_fields_are_ignored():
    wire = SAMPLES["worker"].to_wire()
    for name in ("sessions", "metrics_endpoint", "averaging_rounds", "averaging_committed", "capacity", "credits",
                 "in_flight_credits"):
        del wire[name]
    older = WorkerRecord.from_wire(wire)
    assert (older.sessions, older.metrics_endpoint, older.capacity, older.credits) == (0, "", 0, 0)
    newer = {**SAMPLES["round"].to_wire(), "added_later": [1, 2], 7: "a key msgpack allows", b"k": None}
    assert RoundRecord.from_wire(newer) == SAMPLES["round"]


def test_a_trainers_evaluation_is_on_the_wire_only_once_it_has_one():
    """eval_step and heldout_loss came after the release: a trainer that has not evaluated writes the
    released bytes (above); one that has writes both, and reads back with them."""
    trainer = SAMPLES["trainer"]
    assert "eval_step" not in trainer.to_wire() and "heldout_loss" not in trainer.to_wire()
    evaluated = trainer.replace(eval_step=12, heldout_loss=2.5)
    wire = msgpack.unpackb(packed(evaluated.to_wire()), raw=False)
    assert (wire["eval_step"], wire["heldout_loss"]) == (12, 2.5)
    assert TrainerRecord.from_wire(wire) == evaluated


# A value of the wrong type for each scalar type a field may have (a bool is no int, text no bytes).
WRONG_TYPE = {str: 7, int: "7", float: "7.0", bool: 1, bytes: "bytes as text"}
FIELDS = [(kind, name) for kind, record in sorted(SAMPLES.items()) for name in type(record).model_fields]


def scalar_type(record_type: type, name: str) -> type:
    annotation = record_type.model_fields[name].annotation
    if get_origin(annotation) is Literal:  # a phase: one of some strings
        return type(get_args(annotation)[0])
    return annotation


@pytest.mark.parametrize("kind, name", FIELDS, ids=[f"{kind}.{name}" for kind, name in FIELDS])
def test_a_value_of_the_wrong_type_in_any_field_is_one_line_naming_the_field_and_the_value(kind, name):
    record_type = type(SAMPLES[kind])
    bad = WRONG_TYPE[scalar_type(record_type, name)]
    with pytest.raises(RecordError) as caught:
        record_type.from_wire({**SAMPLES[kind].to_wire(), name: bad})
    message = str(caught.value)
    assert message.startswith(f"{kind}.{name}: ") and message.endswith(f"got {type(bad).__name__} {bad!r}")
    assert "\n" not in message


REQUIRED = [(kind, name) for kind, name in FIELDS if type(SAMPLES[kind]).model_fields[name].is_required()]


@pytest.mark.parametrize("kind, name", REQUIRED, ids=[f"{kind}.{name}" for kind, name in REQUIRED])
def test_a_missing_field_without_a_default_is_named(kind, name):
    wire = SAMPLES[kind].to_wire()
    del wire[name]
    with pytest.raises(RecordError, match=f"^{kind}.{name}: missing$"):
        type(SAMPLES[kind]).from_wire(wire)


OUT_OF_BOUNDS = [
    ("worker", "peer_id", "", "worker.peer_id: string should have at least 1 character, got str ''"),
    ("worker", "version", "v" * 257, "worker.version: string should have at most 256 characters"),
    ("worker", "run_id", "a.b", "worker.run_id: string should match pattern"),
    ("worker", "endpoint", "[::1:80", "worker.endpoint: malformed IPv6 host, got str '[::1:80'"),
    ("worker", "metrics_endpoint", "no-port", "worker.metrics_endpoint: expected 'host:port', got str 'no-port'"),
    ("worker", "stage", 4096, "worker.stage: input should be less than 4096, got int 4096"),
    ("worker", "n_stages", 4097, "worker.n_stages: input should be less than or equal to 4096, got int 4097"),
    ("worker", "throughput", -0.5, "worker.throughput: input should be greater than or equal to 0, got float -0.5"),
    ("worker", "updated_at", math.inf, "worker.updated_at: input should be a finite number, got float inf"),
    ("worker", "phase", "asleep", "worker.phase: input should be 'weight_sync', 'optimizer_sync', 'member', "
                                  "'leaving' or 'serving', got str 'asleep'"),
    ("worker", "capacity", 2**16 + 1, "worker.capacity: input should be less than or equal to 65536, got int 65537"),
    ("worker", "credits", 9, "worker.credits: 9 is above capacity=8"),
    ("worker", "averaging_committed", 8, "worker.averaging_committed: 8 is above averaging_rounds=7"),
    ("worker", "stage", 3, "worker.stage: 3 out of range [0, n_stages=3)"),
    ("trainer", "loss", math.nan, "trainer.loss: input should be a finite number, got float nan"),
    ("trainer", "trainer_index", -1, "trainer.trainer_index: input should be greater than or equal to 0, got int -1"),
    ("move", "to_stage", 0, "move.to_stage: from_stage and to_stage are both 0"),
    ("round", "round", -1, "round.round: input should be greater than or equal to 0, got int -1"),
    ("units", "block", 4096, "units.block: input should be less than 4096, got int 4096"),
    ("units", "committed", b"\x00" * 33, "units.committed: data should have at most 32 bytes"),
    ("units", "claims", b"\x00" * 5, "units.claims: 5 bytes is not a whole number of claims, got bytes"),
    ("units", "claims", struct.pack("<Hdd", 256, 1.0, 2.0), "units.claims: offset 256 or times out of range"),
    ("units", "claims", struct.pack("<Hdd", 0, 1.0, math.nan), "units.claims: offset 0 or times out of range"),
]


@pytest.mark.parametrize("kind, name, value, reason", OUT_OF_BOUNDS,
                         ids=[f"{kind}.{name}={value!r:.12}" for kind, name, value, _ in OUT_OF_BOUNDS])
def test_a_value_out_of_its_fields_bounds_is_refused_naming_the_field(kind, name, value, reason):
    record = SAMPLES[kind]
    with pytest.raises(RecordError) as caught:
        type(record).from_wire({**record.to_wire(), name: value})
    assert str(caught.value).startswith(reason)
    with pytest.raises(RecordError):  # nor can such a record be built locally
        record.replace(**{name: value})


ANYTHING = [None, "x", "", -1, 0, 1.5, True, b"x", [1], {"a": 1}, math.nan, -math.inf, 2**70, "h" * 300,
            b"\x00" * 5000, "a\nb", ("t",)]


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_anything_in_any_field_is_a_record_or_a_one_line_record_error(kind):
    record = SAMPLES[kind]
    for name in type(record).model_fields:
        for value in ANYTHING:
            try:
                type(record).from_wire({**record.to_wire(), name: value})
            except RecordError as error:
                assert "\n" not in str(error) and str(error).startswith(f"{kind}.") and name in str(error)


def test_a_whole_number_where_a_float_belongs_is_stored_as_a_float():
    wire = {**SAMPLES["move"].to_wire(), "started_at": 999}  # a writer that encodes 999.0 as an int
    record = MoveRecord.from_wire(wire)
    assert record == SAMPLES["move"] and isinstance(record.started_at, float)
    assert packed(record.to_wire()).hex() == WIRE_BYTES["move"]


def test_replace_validates_and_records_are_frozen():
    record = SAMPLES["round"]
    assert record.replace(round=8).round == 8 and record.round == 7
    with pytest.raises(RecordError, match="round.stage: input should be a valid integer, got bool True"):
        record.replace(stage=True)
    with pytest.raises(ValidationError):
        record.round = 8


def test_key_builders_check_their_parts_like_the_fields():
    assert worker_key("run-1", 2) == "run-1.stage2.workers" == SAMPLES["worker"].replace(stage=2).dht_key()
    assert trainer_key("run-1") == "run-1.trainers" == SAMPLES["trainer"].dht_key()
    assert move_key("run-1") == "run-1.moves" == SAMPLES["move"].dht_key()
    assert rounds_key("run-1", 1, "sparta") == "run-1.stage1.sparta.rounds"
    assert units_key("run-1", 1) == "run-1.units.b1" == SAMPLES["units"].dht_key()
    refusals = {
        "run_id: string should match pattern": lambda: trainer_key("a.b"),
        "stage: input should be a valid integer, got bool True": lambda: worker_key("run", True),
        "stage: input should be less than 4096, got int 4096": lambda: worker_key("run", 4096),
        "units.block: input should be greater than or equal to 0, got int -1": lambda: units_key("run", -1),
        "method: expected an identifier, got 'a.b'": lambda: rounds_key("run", 0, "a.b"),
    }
    for reason, build in refusals.items():
        with pytest.raises(RecordError) as caught:
            build()
        assert str(caught.value).startswith(reason)


FAMILIES = {family.name: family for family in KEY_FAMILIES}


def test_every_record_type_has_one_key_family_and_each_sample_belongs_under_its_own_key():
    assert sorted(family.record_type.KIND for family in KEY_FAMILIES) == sorted(SAMPLES)
    listed = list(typed_keys("run-1", methods=("sparta", "diloco"), max_stages=4))
    table = {key: (family, slot) for key, family, slot in listed}
    assert len(table) == len(listed) == 2 + 4096 + 4 * 3  # trainers, moves, unit blocks; per stage 1 + 2 methods
    for kind, record in SAMPLES.items():
        key = rounds_key("run-1", record.stage, "diloco") if kind == "round" else record.dht_key()
        family, slot = table[key]
        assert family.record_type is type(record) and family.misfiled(record, "run-1", slot) is None


def test_a_record_under_another_run_slot_or_familys_key_is_misfiled():
    assert FAMILIES["workers"].misfiled(SAMPLES["worker"], "run-1", 2) == \
        "worker: a record of run run-1 stage 1 under the key of run run-1 stage 2"
    assert FAMILIES["units"].misfiled(SAMPLES["units"], "run-1", 0) == \
        "units: a record of run run-1 block 1 under the key of run run-1 block 0"
    assert FAMILIES["trainers"].misfiled(SAMPLES["trainer"], "run-2", None) == \
        "trainer: a record of run run-1 under the key of run run-2"
    assert FAMILIES["rounds"].misfiled(SAMPLES["worker"], "run-1", 1) == \
        "rounds: a worker record where round records belong"


def test_each_family_names_who_may_write_it_and_a_stage_is_written_only_from_its_own():
    roles, stages = ("worker", "trainer", "operator", "monitor", "client"), (None, 0, 1, 2)
    allowed = {name: {(role, stage) for role in roles for stage in stages
                      if family.unauthorized(SAMPLES[family.record_type.KIND], role, stage) is None}
               for name, family in FAMILIES.items()}
    assert allowed == {"workers": {("worker", 1)}, "rounds": {("worker", 1)}, "moves": {("worker", 0)},  # leaves 0
                       "trainers": {("trainer", s) for s in (None, 0, 1, 2)},
                       "units": {(role, s) for role in ("trainer", "operator") for s in (None, 0, 1, 2)}}
    assert FAMILIES["workers"].unauthorized(SAMPLES["worker"], "worker", 2) == \
        "workers: stage 1 from a credential of stage 2"
    assert FAMILIES["units"].unauthorized(SAMPLES["units"], "worker", 0) == \
        "units: a worker credential may not write here (only trainer, operator)"
    assert FAMILIES["workers"].unauthorized(None, "worker", 2) is None  # a tombstone: the role alone
    assert FAMILIES["moves"].unauthorized(None, "trainer", None) is not None


def test_an_entry_may_not_be_stored_to_expire_further_ahead_than_its_family_allows():
    from agora.dht.leases import COMMIT_TTL_S

    now = 1000.0
    assert FAMILIES["workers"].too_lasting(now + 240.0 + CLOCK_SKEW_S, now) is None
    assert FAMILIES["workers"].too_lasting(now + 3600.0, now) == "workers: expires 3600 s from now, more than 240 s"
    assert FAMILIES["workers"].too_lasting(now + 1e9, now) == "workers: expires 1000000000 s from now, more than 240 s"
    assert FAMILIES["trainers"].too_lasting(now + 3600.0, now) is not None
    assert FAMILIES["rounds"].too_lasting(now + 2 * 3600.0, now) is not None
    # Honest writers stay inside, at the longest their settings allow: an announce lives three of the
    # longest heartbeats, a move twelve, a round its longest matchmaking window and a request (shorter),
    # a trainer's commits COMMIT_TTL_S.
    assert FAMILIES["workers"].too_lasting(now + 3 * MAX_HEARTBEAT_S, now) is None
    assert FAMILIES["trainers"].too_lasting(now + 3 * MAX_HEARTBEAT_S, now) is None
    assert FAMILIES["moves"].too_lasting(now + 12 * MAX_HEARTBEAT_S, now) is None
    assert FAMILIES["rounds"].too_lasting(now + 2 * MAX_MATCHMAKING_S - 1, now) is None
    assert FAMILIES["units"].too_lasting(now + COMMIT_TTL_S, now) is None


@pytest.mark.parametrize("command", [["join", "--insecure", "--stage", "0"], ["trainer", "--insecure"],
                                     ["demo", "--insecure"]])
def test_a_heartbeat_longer_than_peers_let_an_announce_live_is_refused_in_one_line(command, capsys):
    from agora.node.cli import main

    try:  # refused before anything starts: by the parser (join), or by the options' schema
        code = main([*command, "--heartbeat", str(2 * MAX_HEARTBEAT_S)])
    except SystemExit as exit_info:
        code = exit_info.code
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and ("--heartbeat" in error or "heartbeat_s: must be <= 60" in error), error
