"""Typed records that peers publish in the DHT, their keys, and their wire form.

Design choices:

- A record is a frozen pydantic model in strict mode whose fields are plain scalars (str, int,
  float, bool, bytes). Each field's type and bounds are declared once, on the field, through the
  field types below (``PeerId``, ``Stage``, ``Count``, ``Seconds``, ...); a rule between two fields
  (a stage below ``n_stages``) is the model's one after-validator. Strict means no coercion: "1"
  is no int, ``True`` no count, 1.5 no step. The one conversion is a whole number where a float
  belongs (a writer in another language may encode 7.0 as the int 7): pydantic stores it as a
  float, so equal records compare and serialize equal.
- The wire form is a flat dict of those scalars plus ``schema`` and ``kind``: exactly what msgpack
  (hivemind's serializer) carries without extension types, so a peer written in another language,
  or a later version of this one, can read it. tests/unit/test_records.py pins the bytes.
- Validation runs on construction, so a record that exists is a valid record. Reading goes
  through ``from_wire``, which turns *anything* (another peer's mistake, an attack, an older
  schema) into either a record or a ``RecordError`` whose message is one line naming the field
  and the bad value. Readers skip and count such values; they never crash on them.
- ``schema`` must match exactly: a breaking change bumps ``SCHEMA_VERSION`` and old readers
  reject new records cleanly. Unknown extra fields are ignored, so adding a field with a default
  does not need a bump.
- Key naming lives here, next to the schemas, so every reader and writer builds the same keys.
  ``run_id`` is restricted to ``[A-Za-z0-9_-]`` so that the dots in keys separate components
  unambiguously. Every record type the DHT holds is declared here with the builder of its key:
  workers, trainers, moves, averaging rounds (``RoundRecord``, read by dht/averaging.py's
  ``RoundBoard``) and leased unit blocks (``UnitBlockRecord``, dht/leases.py). A record knows its
  own key (``dht_key()``), so one heartbeat serves every record type.
- ``KEY_FAMILIES`` is the one statement of which record type each key family holds, and
  ``typed_keys`` lists a run's keys with their family, so a validator that sees only a key's hash
  (hivemind's) can look the schema up. A rule about a family (who may write it) is one more
  field of its ``KeyFamily``.
- Why not hivemind's ``SchemaValidator`` (hivemind/dht/schema.py, DHT values checked against a
  pydantic model): (1) it finds a value's schema by the hash of a static name (a model field's
  name, or ``prefix + "_" + name``), which cannot spell our run-scoped, numbered keys
  (``{run}.stage{i}.workers``), so using it would rename every key and cut this version off from
  the peers already running; (2) it accepts a value only if the model's ``dict()`` equals it, so a
  record lacking a defaulted field (an older peer) or carrying an unknown one (a newer peer) is
  refused; (3) it is written against pydantic's v1 API (``pydantic.v1``); (4) it sees the value
  alone, while our checks need the key (the record's run and stage are its key's, the subkey's
  owner key is the record's peer id's), and its ``BytesWithPublicKey`` wants bytes subkeys where
  ours are text. So records are pydantic v2 models, and ``OwnedRecordValidator`` (dht/security.py,
  a hivemind ``RecordValidatorBase``) looks a key's family up by hash and parses with ``from_wire``.
- Per-peer entries live under subkeys. With admission on (dht/security.py) a subkey is
  ``<peer id>[owner:<ssh-rsa ...>]``: hivemind's ``RSASignatureValidator`` then lets only the
  holder of that key write or tombstone the entry, and readers check that the key is the one
  the peer id is derived from. ``owned_subkey`` / ``split_subkey`` build and parse that form
  (pure string work; the key check needs the key parser and lives with the readers).
- ``WorkerRecord.fingerprint`` is the run fingerprint text (pipeline/fingerprint.py): a record
  of a run with another seed, basis, data or config is skipped by readers that know theirs.
  It is a required field, so schema 2 (records of schema 1 lack it and are refused cleanly).
- Every node that serves Prometheus metrics names its endpoint in its record
  (``metrics_endpoint``, ``host:port``, empty when it serves none): the monitor's service
  discovery lists exactly what the DHT holds. A worker also carries its averaging counts, so
  the monitor shows each stage's averaging health without scraping anyone. A trainer announces
  a ``TrainerRecord`` under ``{run}.trainers`` (its progress, last loss and tokens/s).
- A worker that leaves its stage for another (rebalancing) announces a ``MoveRecord`` under
  ``{run}.moves`` while it is in transit, so no other worker judges the swarm without it.
- The run's ban list (``BanListRecord`` under ``{run}.bans``, family ``BAN_LIST``) is the one
  family that is not per-peer: the operator's authorizer writes it, one subkey per serial, and
  its writer check is the run's CA's signature (dht/bans.py), not a credential's role.
- hivemind's own averaging keys are named here too (``averaging_prefix``, ``averaging_keys``):
  every key an admitted peer may store is listed by ``typed_keys``, ``bans_key`` or
  ``averaging_keys``, and the record validator refuses any other (dht/security.py).
"""

import enum
import math
import re
import struct
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Iterator, Literal, Mapping, Optional, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from agora.pipeline.config import MAX_MATCHMAKING_S

__all__ = ["AVERAGING_GROUP_BITS", "BAN_LIST", "BLOCK_UNITS", "CLOCK_SKEW_S", "COVERING_PHASES", "KEY_FAMILIES",
           "MAX_BANS", "MAX_CLAIM_AGE_S", "MAX_CLAIMS", "MAX_HEARTBEAT_S", "MAX_LEASE_S", "MAX_STAGES",
           "MAX_UNIT_BLOCKS", "OWNER_MARKER", "PHASES", "PHASE_TRANSITIONS", "START_PHASES", "SERVING_PHASES",
           "Phase", "SCHEMA_VERSION", "TRAINING_PHASES", "BanListRecord", "KeyFamily", "MoveRecord", "Record",
           "RecordError", "RoundRecord", "TrainerRecord", "UnitBlockRecord", "WorkerRecord", "averaging_key_parts",
           "averaging_keys", "averaging_prefix", "bans_key", "check_run_id", "claim_problem", "move_key",
           "owned_subkey", "parse_endpoint", "rounds_key", "split_subkey", "trainer_key", "typed_keys", "units_key",
           "worker_key"]

SCHEMA_VERSION = 2
HOUR_S, DAY_S = 3600.0, 24 * 3600.0
# The longest a node may leave between two announces (`join --heartbeat`, `trainer --heartbeat`): an
# announce lives three beats, so no heartbeat family needs its entries to live longer than a few
# minutes, and peers refuse entries meant to (KeyFamily.max_ttl_s).
MAX_HEARTBEAT_S = 60.0
# How far apart peers' clocks may be: hivemind refuses requests whose time is further off than this.
CLOCK_SKEW_S = 60.0
# hivemind's RSASignatureValidator.PUBLIC_KEY_FORMAT, as text: b"[owner:_key_]".
OWNER_MARKER = "[owner:"


class Phase(str, enum.Enum):
    """Where a worker is in its life; announced in its record, so every peer reads the same names.

    A replica joining a stage that is ahead of it starts in weight sync (it has no state worth
    training on yet), then optimizer sync (its weights are the stage's, its Adam moments are still
    warming), then member. Serving is an inference-only worker (join --serve-only). Any phase ends in
    leaving. `PHASE_TRANSITIONS` is the whole life; the worker refuses any other move.
    """

    WEIGHT_SYNC = "weight_sync"
    OPTIMIZER_SYNC = "optimizer_sync"
    MEMBER = "member"
    LEAVING = "leaving"
    SERVING = "serving"

    # Reads, prints, hashes and compares as its name (enum.StrEnum, which does this, is 3.11+).
    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__


# Where a worker may start: a member (nobody is ahead of it, or it is the stage's state), a
# replica behind its stage, or an inference-only worker.
START_PHASES = frozenset({Phase.MEMBER, Phase.WEIGHT_SYNC, Phase.SERVING})
PHASE_TRANSITIONS: Mapping[Phase, frozenset[Phase]] = {
    # to member directly: no member of the stage is left to download from, this replica is its state
    Phase.WEIGHT_SYNC: frozenset({Phase.OPTIMIZER_SYNC, Phase.MEMBER, Phase.LEAVING}),
    Phase.OPTIMIZER_SYNC: frozenset({Phase.MEMBER, Phase.LEAVING}),
    Phase.MEMBER: frozenset({Phase.LEAVING}),
    Phase.SERVING: frozenset({Phase.LEAVING}),
    Phase.LEAVING: frozenset(),
}
# Every phase's name, in the order of a worker's life (metrics and the status page list them so).
PHASES = tuple(phase.value for phase in Phase)
# Phases in which a worker trains on live traffic: trainers route to them, and their step counts
# are the stage's (a worker in weight sync has not got the stage's state yet).
TRAINING_PHASES = frozenset({Phase.MEMBER, Phase.OPTIMIZER_SYNC})
# Phases whose replica holds (or is getting) the stage's weights and counts toward its coverage.
COVERING_PHASES = TRAINING_PHASES | {Phase.WEIGHT_SYNC}
# Phases that answer inference: a training worker whose weights are the stage's, or a serving one.
SERVING_PHASES = TRAINING_PHASES | {Phase.SERVING}
# The record's field: the phase's name, checked against the enum's values (it arrives as text).
PhaseName = Literal[PHASES]
# Generous bounds: they exist to reject garbage cheaply, not to constrain real runs.
MAX_STAGES = 4096
MAX_CREDITS = 2**16  # a worker's queue, and the credits it announces
MAX_TEXT = 256  # characters of any text field
MAX_PACKED = 4096  # bytes of a packed field (a bitmap, fixed-size entries, a credential chain)
BLOCK_UNITS = 256
# Blocks the record validator knows (dht/security.py): 2**20 units, six times the Agora run's.
MAX_UNIT_BLOCKS = 4096
# Lease bounds every peer holds a trainer's claims to (UnitBlockRecord; dht/leases.py says why):
# the longest lease a trainer may take (its `--lease`, 30 s by default, is bounded by it), how long
# one claim may be held by renewals before it must be made anew, and how many claims one trainer's
# entry may hold in a block (a trainer runs a few global batches at once and claims no more than this).
MAX_LEASE_S = 600.0
MAX_CLAIM_AGE_S = 3600.0
MAX_CLAIMS = 64
# Peer ids one ban list may name (about 55 KB at most: every node reads the list each heartbeat).
MAX_BANS = 1024
# Bits of the round number in hivemind's matchmaking key (dht/averaging.py): rounds this many
# apart never meet in time (a replica joins rounds at most a few past the stage's), and so few
# keys per stage let the record validator list every one of them.
AVERAGING_GROUP_BITS = 4
_CLAIM = struct.Struct("<Hdd")  # unit offset in the block, claimed_at, expires_at
_BITMAP_BYTES = BLOCK_UNITS // 8

R = TypeVar("R", bound="Record")


class RecordError(ValueError):
    """A value that is not a valid record; the message is one line naming the field."""


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of ``host:port`` (IPv6 as ``[addr]:port``); ``ValueError`` says what is wrong."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
        raise ValueError("expected 'host:port'")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError("malformed IPv6 host")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("IPv6 hosts must be bracketed ('[::1]:port')")
    if any(ch.isspace() for ch in host):
        raise ValueError("host contains whitespace")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} out of range [1, 65535]")
    return host, port


def _endpoint(text: str) -> str:
    _split_endpoint(text)
    return text


def _optional_endpoint(text: str) -> str:
    return _endpoint(text) if text else text


def _claims(packed: bytes) -> bytes:
    if len(packed) % _CLAIM.size:
        raise ValueError(f"{len(packed)} bytes is not a whole number of claims")
    for offset, claimed_at, expires_at in _CLAIM.iter_unpack(packed):
        if offset >= BLOCK_UNITS or not (math.isfinite(claimed_at) and math.isfinite(expires_at)):
            raise ValueError(f"offset {offset} or times out of range")
    return packed


_BASE58_PEER = re.compile(r"[1-9A-HJ-NP-Za-km-z]{10,128}")


def _banned_peers(text: str) -> str:
    """Peer ids, one a line, sorted and each once: one text for the whole list keeps the record flat."""
    peers = text.split("\n") if text else []
    if len(peers) > MAX_BANS:
        raise ValueError(f"{len(peers)} peers, at most {MAX_BANS}")
    for peer in peers:
        if not _BASE58_PEER.fullmatch(peer):
            raise ValueError(f"{peer!r:.60} is not a base58 peer id")
    if peers != sorted(set(peers)):
        raise ValueError("peer ids must be sorted and each listed once")
    return text


# Field types: each states a field's type and bounds once, for every record that has such a field.
PeerId = Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]
Label = Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]  # a version, a fingerprint
RunId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
Endpoint = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(_endpoint)]
OptionalEndpoint = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(_optional_endpoint)]  # "": none
Stage = Annotated[int, Field(ge=0, lt=MAX_STAGES)]
StageCount = Annotated[int, Field(ge=1, le=MAX_STAGES)]
Block = Annotated[int, Field(ge=0, lt=MAX_UNIT_BLOCKS)]
Count = Annotated[int, Field(ge=0)]
Credits = Annotated[int, Field(ge=0, le=MAX_CREDITS)]
Measure = Annotated[float, Field(ge=0, allow_inf_nan=False)]  # a throughput, a loss, a rate
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]  # DHT time (hivemind's get_dht_time)
Bitmap = Annotated[bytes, Field(min_length=_BITMAP_BYTES, max_length=_BITMAP_BYTES)]  # one bit per unit of a block
Claims = Annotated[bytes, Field(max_length=MAX_PACKED), AfterValidator(_claims)]
BannedPeers = Annotated[str, Field(max_length=MAX_BANS * 129), AfterValidator(_banned_peers)]
Packed = Annotated[bytes, Field(max_length=MAX_PACKED)]
Signature = Annotated[bytes, Field(min_length=1, max_length=1024)]

# The key builders check their arguments with the same field types (a key part is a record field).
_RUN_ID, _STAGE, _BLOCK = TypeAdapter(RunId), TypeAdapter(Stage), TypeAdapter(Block)


def _one_line(where: str, error: ValidationError) -> RecordError:
    """The first problem pydantic found, as one line naming the field and the bad value."""
    first = error.errors(include_url=False)[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, RecordError):
        return RecordError(str(cause))  # a rule between fields names them itself
    field = ".".join(str(part) for part in first["loc"])
    where = f"{where}.{field}" if field else where
    if first["type"] == "missing":
        return RecordError(f"{where}: missing")
    value = first["input"]
    reason = str(cause) if cause is not None else first["msg"][:1].lower() + first["msg"][1:]
    return RecordError(f"{where}: {reason}, got {type(value).__name__} {value!r:.60}")


def _key_part(adapter: TypeAdapter, name: str, value: object) -> Any:
    try:
        return adapter.validate_python(value, strict=True)
    except ValidationError as error:
        raise _one_line(name, error) from None


def check_run_id(run_id: object) -> str:
    """Return ``run_id`` if it can be part of a key, else raise ``RecordError``."""
    return _key_part(_RUN_ID, "run_id", run_id)


def worker_key(run_id: str, stage: int) -> str:
    """The DHT key under which the workers of one stage announce (one subkey per peer)."""
    return f"{check_run_id(run_id)}.stage{_key_part(_STAGE, 'stage', stage)}.workers"


def trainer_key(run_id: str) -> str:
    """The DHT key under which the trainers of a run announce (one subkey per peer)."""
    return f"{check_run_id(run_id)}.trainers"


def move_key(run_id: str) -> str:
    """The DHT key under which workers moving between stages announce it (one subkey per peer)."""
    return f"{check_run_id(run_id)}.moves"


def _stage_of_method(run_id: str, stage: int, method: str) -> str:
    """``{run}.stage{i}`` for an averaging method's keys of one stage, every part checked."""
    if not method.isidentifier():
        raise RecordError(f"method: expected an identifier, got {method!r:.40}")
    return worker_key(run_id, stage).rsplit(".", 1)[0]


def rounds_key(run_id: str, stage: int, method: str) -> str:
    """Where the replicas of one stage announce the rounds they start (one subkey per peer)."""
    return f"{_stage_of_method(run_id, stage, method)}.{method}.rounds"


def units_key(run_id: str, block: int) -> str:
    """The DHT key of one block of units (one subkey per trainer)."""
    return f"{check_run_id(run_id)}.units.b{_key_part(_BLOCK, 'units.block', block)}"


def bans_key(run_id: str) -> str:
    """The DHT key of the run's ban list (one subkey per serial: dht/bans.py)."""
    return f"{check_run_id(run_id)}.bans"


def averaging_prefix(run_id: str, stage: int, method: str) -> str:
    """hivemind's averaging prefix for the replicas of one stage (``DecentralizedAverager(prefix=)``):
    no dots, which hivemind's group keys use as their separator."""
    return f"{_stage_of_method(run_id, stage, method).replace('.', '_')}_{method}"


def averaging_keys(run_id: str, *, methods: tuple[str, ...], max_stages: int = MAX_STAGES) -> Iterator[str]:
    """Every key hivemind's averagers of this run store: the matchmaking key ``{prefix}.0b{bits}``
    of each stage, method and group bits (hivemind's ``GroupKeyManager.current_key``). Nothing
    else: state sharing (``{prefix}.all_averagers``) is off, joiners download over gRPC."""
    for head, bits in averaging_key_parts(run_id, methods=methods, max_stages=max_stages):
        for tail in bits:
            yield head + tail


def averaging_key_parts(run_id: str, *, methods: tuple[str, ...], max_stages: int = MAX_STAGES
                        ) -> Iterator[tuple[str, tuple[str, ...]]]:
    """``averaging_keys`` as (the part every key of one stage and method starts with, the group
    bits that end them): a validator hashes the common part once (dht/key_policy.py)."""
    bits = tuple(format(value, f"0{AVERAGING_GROUP_BITS}b") for value in range(2 ** AVERAGING_GROUP_BITS))
    for stage in range(max_stages):
        for method in methods:
            yield f"{averaging_prefix(run_id, stage, method)}.0b", bits


def owned_subkey(peer_id: str, owner_public_key: str) -> str:
    """A peer's subkey that only the holder of ``owner_public_key`` (OpenSSH text) can write."""
    return f"{peer_id}{OWNER_MARKER}{owner_public_key}]"


def split_subkey(subkey: object) -> tuple[str, Optional[str]]:
    """(peer id, owner public key or None) of a subkey; ``RecordError`` if it is malformed.

    A subkey without a marker is a plain peer id (unsigned: accepted only by ``--insecure``
    readers). The owner part is returned as written; whether it is a key, and the key of that
    peer id, is the reader's check.
    """
    if not isinstance(subkey, str):
        raise RecordError(f"subkey: expected a string, got {type(subkey).__name__}")
    peer_id, marker, owner = subkey.partition(OWNER_MARKER)
    if not peer_id or len(peer_id) > MAX_TEXT:
        raise RecordError(f"subkey: expected a peer id first, got {subkey!r:.80}")
    if not marker:
        return peer_id, None
    if not owner.endswith("]") or "]" in owner[:-1] or "[" in owner or len(owner) < 2:
        raise RecordError(f"subkey: malformed owner marker in {subkey!r:.80}")
    return peer_id, owner[:-1]


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[addr]:port``) into (host, port); raise ``RecordError``."""
    try:
        return _split_endpoint(endpoint)
    except ValueError as error:
        raise RecordError(f"endpoint: {error}, got {endpoint!r:.80}") from None


class Record(BaseModel):
    """Base of DHT records: a frozen, strict pydantic model of scalar fields, valid once built.

    Subclasses set ``KIND``, declare fields with the field types of this module, and state a rule
    between fields in a ``model_validator(mode="after")`` that raises ``RecordError`` naming them.
    A field added to a released family is listed in its ``WRITTEN_WHEN_SET``: left off the wire
    while it holds its default, so such a record is byte for byte what the released code wrote (and
    read), and a released peer ignores the field when it is there.
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")

    KIND: ClassVar[str] = ""
    WRITTEN_WHEN_SET: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, **fields: Any) -> None:
        try:
            super().__init__(**fields)
        except ValidationError as error:
            raise _one_line(self.KIND, error) from None

    def untimely(self, now: float, *, storing: bool) -> Optional[str]:
        """Why this record may not be held (or, with ``storing``, stored) at ``now``, or None. Only
        records whose times other peers act on say anything here (``UnitBlockRecord``)."""
        return None

    def replace(self: R, **changes: Any) -> R:
        """A copy with ``changes``, validated like any new record (``model_copy`` would not check)."""
        return type(self)(**{**self.model_dump(), **changes})

    def dht_key(self) -> str:
        """The DHT key this record is stored under (each peer under its own subkey)."""
        raise NotImplementedError(f"{type(self).__name__} does not say where it is stored")

    def to_wire(self) -> dict[str, Any]:
        """A plain dict that msgpack serializes as is."""
        fields = self.model_dump()
        for name in self.WRITTEN_WHEN_SET:
            if fields[name] == type(self).model_fields[name].default:
                del fields[name]
        return {"schema": SCHEMA_VERSION, "kind": self.KIND, **fields}

    @classmethod
    def from_wire(cls: type[R], value: object) -> R:
        """Parse a value read from the DHT, or raise ``RecordError`` saying why not."""
        if not isinstance(value, Mapping):
            raise RecordError(f"{cls.KIND}: expected a dict, got {type(value).__name__}")
        schema = value.get("schema")
        if schema != SCHEMA_VERSION:
            raise RecordError(f"{cls.KIND}.schema: expected {SCHEMA_VERSION}, got {schema!r:.40}")
        kind = value.get("kind")
        if kind != cls.KIND:
            raise RecordError(f"{cls.KIND}.kind: expected {cls.KIND!r}, got {kind!r:.40}")
        # Only declared fields are passed on: unknown ones (a later version's) are ignored, whatever their keys.
        return cls(**{name: value[name] for name in cls.model_fields if name in value})


class WorkerRecord(Record):
    """What a stage worker announces about itself every heartbeat.

    ``throughput`` is an exponential moving average in samples/s or tokens/s (the run
    decides; trainers only compare workers of one run). ``version`` is the announcing
    software's version string, so trainers can skip peers that speak another protocol.
    ``updated_at`` is DHT time (seconds, hivemind's ``get_dht_time`` clock) of the announce.
    ``fingerprint`` is the run fingerprint text (``RunFingerprint.text()``), compared by readers.
    ``sessions``: inference sessions the worker holds (load for clients' routing; absent in older
    records, hence its default).
    ``metrics_endpoint`` is where its Prometheus metrics are served (empty: none);
    ``averaging_rounds`` / ``averaging_committed`` count its averaging rounds in all / committed.
    ``capacity`` is the Forward/Backward calls it holds at once; ``credits`` and
    ``in_flight_credits`` what a trainer new to it may hold there (calls outstanding, microbatches
    between Forward and Backward; node/worker/flow.py): a trainer starts within them before its
    first reply carries its own. 0: not stated (older records).
    """

    KIND: ClassVar[str] = "worker"

    peer_id: PeerId
    run_id: RunId
    endpoint: Endpoint
    stage: Stage
    n_stages: StageCount
    throughput: Measure
    queue_depth: Count
    step: Count
    phase: PhaseName
    version: Label
    updated_at: Seconds
    fingerprint: Label
    sessions: Count = 0
    metrics_endpoint: OptionalEndpoint = ""
    averaging_rounds: Count = 0
    averaging_committed: Count = 0
    capacity: Credits = 0
    credits: Credits = 0
    in_flight_credits: Credits = 0

    def dht_key(self) -> str:
        return worker_key(self.run_id, self.stage)

    @model_validator(mode="after")
    def _consistent(self) -> "WorkerRecord":
        if self.stage >= self.n_stages:
            raise RecordError(f"worker.stage: {self.stage} out of range [0, n_stages={self.n_stages})")
        if self.credits > self.capacity:
            raise RecordError(f"worker.credits: {self.credits} is above capacity={self.capacity}")
        if self.averaging_committed > self.averaging_rounds:
            raise RecordError(f"worker.averaging_committed: {self.averaging_committed} is above averaging_rounds="
                              f"{self.averaging_rounds}")
        return self


class TrainerRecord(Record):
    """What a trainer announces about itself every heartbeat (under ``trainer_key(run_id)``).

    ``batches`` is the global batches it completed, ``step`` the run-wide step of the last one,
    ``loss`` that batch's mean loss (0 before the first), ``tokens_per_s`` its rate since it
    started, ``metrics_endpoint`` where its Prometheus metrics are served (empty: none),
    ``eval_step`` the step of its last evaluation against the live swarm with a held-out loss and
    ``heldout_loss`` that loss (0: none yet; node/trainer/evals.py).
    """

    KIND: ClassVar[str] = "trainer"
    WRITTEN_WHEN_SET: ClassVar[frozenset[str]] = frozenset({"eval_step", "heldout_loss"})

    peer_id: PeerId
    run_id: RunId
    trainer_index: Count
    batches: Count
    step: Count
    loss: Measure
    tokens_per_s: Measure
    version: Label
    updated_at: Seconds
    metrics_endpoint: OptionalEndpoint = ""
    eval_step: Count = 0
    heldout_loss: Measure = 0.0

    def dht_key(self) -> str:
        return trainer_key(self.run_id)


class MoveRecord(Record):
    """A worker in transit from one stage to another (node/membership/rebalance.py), announced for as long
    as it may take to come back on ``to_stage``; ``started_at`` is DHT time."""

    KIND: ClassVar[str] = "move"

    peer_id: PeerId
    run_id: RunId
    from_stage: Stage
    to_stage: Stage
    started_at: Seconds

    def dht_key(self) -> str:
        return move_key(self.run_id)

    @model_validator(mode="after")
    def _somewhere_else(self) -> "MoveRecord":
        if self.from_stage == self.to_stage:
            raise RecordError(f"move.to_stage: from_stage and to_stage are both {self.from_stage}")
        return self


class RoundRecord(Record):
    """A replica is starting averaging round ``round`` of its stage (``started_at``: DHT time), or,
    with ``closed``, has left it (its result is in, or it gave up): nobody should join it now.
    Stored under ``rounds_key(run_id, stage, method)``; the method is the key's, not the record's."""

    KIND: ClassVar[str] = "round"

    peer_id: PeerId
    run_id: RunId
    stage: Stage
    round: Count
    started_at: Seconds
    closed: bool = False


def claim_problem(claimed_at: float, expires_at: float, updated_at: float) -> Optional[str]:
    """Why a claim (claimed at, expires at) may not stand in an entry written at ``updated_at``, or None.

    Relations between the entry's own times, so they hold whenever the entry is read: a claim
    expires after it was made, was made when its entry was written at the latest, expires at most
    one lease (``MAX_LEASE_S``) after that, and is held by renewals for at most ``MAX_CLAIM_AGE_S``.
    ``CLOCK_SKEW_S`` of slack each, for a writer's clock that stepped. With ``updated_at`` bound to
    the time of the store (``UnitBlockRecord.untimely``) a live claim cannot be dated more than
    ``MAX_CLAIM_AGE_S`` back, nor held further ahead than a lease."""
    if not claimed_at < expires_at:
        return f"expires at {expires_at:.17g}, not after it was claimed at {claimed_at:.17g}"
    if claimed_at > updated_at + CLOCK_SKEW_S:
        return f"claimed {claimed_at - updated_at:.3g} s after its entry was written"
    if expires_at > updated_at + MAX_LEASE_S + CLOCK_SKEW_S:
        return (f"expires {expires_at - updated_at:.3g} s after its entry was written, more than the longest "
                f"lease ({MAX_LEASE_S:g} s)")
    if expires_at - claimed_at > MAX_CLAIM_AGE_S:
        return (f"held {expires_at - claimed_at:.3g} s from its claim to its expiry, more than a claim may be "
                f"held by renewals ({MAX_CLAIM_AGE_S:g} s)")
    return None


class UnitBlockRecord(Record):
    """One trainer's commits and live claims in one block of units (dht/leases.py).

    Its claims are bounded by their entry's ``updated_at`` (``claim_problem``), at most
    ``MAX_CLAIMS`` of them, one per unit; ``updated_at`` is bound to now when the entry is stored
    and is never ahead of now when it is read (``untimely``).
    """

    KIND: ClassVar[str] = "units"

    peer_id: PeerId
    run_id: RunId
    block: Block
    committed: Bitmap  # bit i: unit block*256 + i committed by this trainer
    claims: Claims  # packed (offset, claimed_at, expires_at) per live claim
    updated_at: Seconds
    credential: Packed = b""  # the writer's credential chain (PEM); empty under --insecure

    def dht_key(self) -> str:
        return units_key(self.run_id, self.block)

    @model_validator(mode="after")
    def _claims_bounded(self) -> "UnitBlockRecord":
        claims = list(_CLAIM.iter_unpack(self.claims))
        if len(claims) > MAX_CLAIMS:
            raise RecordError(f"units.claims: {len(claims)} claims, more than one entry may hold ({MAX_CLAIMS})")
        if len({offset for offset, _, _ in claims}) < len(claims):
            raise RecordError("units.claims: a unit is claimed twice in one entry")
        for offset, claimed_at, expires_at in claims:
            problem = claim_problem(claimed_at, expires_at, self.updated_at)
            if problem is not None:
                raise RecordError(f"units.claims: the claim of unit {self.block * BLOCK_UNITS + offset} {problem}")
        return self

    def untimely(self, now: float, *, storing: bool) -> Optional[str]:
        """An entry is written at most ``CLOCK_SKEW_S`` ahead of a reader's clock, whenever it is read
        (time only moves on); a store must be written now, within ``CLOCK_SKEW_S`` either way."""
        if self.updated_at > now + CLOCK_SKEW_S:
            return f"units.updated_at: written {self.updated_at - now:.3g} s ahead of this peer's clock"
        if storing and self.updated_at < now - CLOCK_SKEW_S:
            return (f"units.updated_at: written {now - self.updated_at:.3g} s ago; an entry is stored when it is "
                    f"written (within {CLOCK_SKEW_S:g} s)")
        return None

    def committed_units(self) -> set[int]:
        first = self.block * BLOCK_UNITS
        return {first + i for i in range(BLOCK_UNITS) if self.committed[i // 8] >> (i % 8) & 1}

    def claimed_units(self) -> dict[int, tuple[float, float]]:
        """unit -> (claimed_at, expires_at)."""
        first = self.block * BLOCK_UNITS
        return {first + offset: (claimed_at, expires_at)
                for offset, claimed_at, expires_at in _CLAIM.iter_unpack(self.claims)}

    @classmethod
    def build(cls, peer_id: str, run_id: str, block: int, committed: set[int],
              claims: Mapping[int, tuple[float, float]], now: float, credential: bytes = b"") -> "UnitBlockRecord":
        first = block * BLOCK_UNITS
        bitmap = bytearray(_BITMAP_BYTES)
        for unit in committed:
            offset = unit - first
            bitmap[offset // 8] |= 1 << (offset % 8)
        packed = b"".join(_CLAIM.pack(unit - first, claimed_at, expires_at)
                          for unit, (claimed_at, expires_at) in sorted(claims.items()))
        return cls(peer_id=peer_id, run_id=run_id, block=block, committed=bytes(bitmap), claims=packed,
                   updated_at=now, credential=credential)


class BanListRecord(Record):
    """The peers the run's operator banned, as of ``serial`` (higher serials are newer lists).

    Signed by the run's issuing CA (``signer``: its certificate, PEM, which the pinned root signed;
    ``signature`` over the other fields, dht/bans.py). ``banned``: peer ids, one a line, sorted.
    Stored under ``bans_key(run_id)`` with the serial's decimal text as subkey, so a newer list
    never has to outlive an older one's expiration to be found.
    """

    KIND: ClassVar[str] = "bans"

    run_id: RunId
    serial: Count
    issued_at: Seconds
    banned: BannedPeers
    signer: Packed
    signature: Signature

    def dht_key(self) -> str:
        return bans_key(self.run_id)

    def peers(self) -> frozenset[str]:
        return frozenset(self.banned.split("\n")) if self.banned else frozenset()


@dataclass(frozen=True)
class KeyFamily:
    """A family of DHT keys and the one record type stored under them, each peer under its subkey.

    ``slot`` names the record field that numbers the family's keys (the stage of
    ``{run}.stage{i}.workers``, the block of ``{run}.units.b{block}``); None: one key per run.

    Who may write it: ``writers`` are the credential roles whose entries count, and
    ``writer_stage`` the record field that must be the stage the writer's credential names (a
    worker of stage 1 announces nothing in stage 2). ``lasting`` entries outlive their writer's
    short-lived credential (commits live a week, credentials an hour), so their writer's chain is
    judged as issued, not as valid now; every other family's entries die within heartbeats, well
    inside the credential their writer renews at half its life.

    ``max_ttl_s``: how far ahead of now an entry may be stored to expire. A writer picks its
    entry's expiry, and hivemind keeps an entry until then, so without a bound one store could
    leave a lie in place for good (a dead member's record kept alive, keeping joiners waiting on a
    donor that is gone). Each bound sits just above the longest that settings allow honest writers: a
    heartbeat entry lives three beats of at most ``MAX_HEARTBEAT_S``, a move twelve, a round its
    matchmaking window (at most ``pipeline.config.MAX_MATCHMAKING_S``) and a request, a commit
    ``leases.COMMIT_TTL_S``.
    """

    name: str
    record_type: type[Record]
    slot: Optional[str] = None
    writers: tuple[str, ...] = ()
    writer_stage: Optional[str] = None
    lasting: bool = False
    max_ttl_s: float = HOUR_S

    def too_lasting(self, expiration_time: float, now: float) -> Optional[str]:
        """Why an entry stored at ``now`` may not expire at ``expiration_time``, or None.
        ``CLOCK_SKEW_S`` is allowed on top: the writer's clock may be that far ahead of ours."""
        if expiration_time <= now + self.max_ttl_s + CLOCK_SKEW_S:
            return None
        return f"{self.name}: expires {expiration_time - now:.0f} s from now, more than {self.max_ttl_s:.0f} s"

    def unauthorized(self, record: Optional[Record], role: str, stage: Optional[int]) -> Optional[str]:
        """Why a writer with a credential of ``role`` (for ``stage``) may not store ``record`` under
        this family (None: its tombstone), or None if it may."""
        if role not in self.writers:
            return f"{self.name}: a {role} credential may not write here (only {', '.join(self.writers)})"
        if record is None or self.writer_stage is None:
            return None
        theirs = getattr(record, self.writer_stage)
        if theirs != stage:
            return f"{self.name}: {self.writer_stage} {theirs} from a credential of stage {stage}"
        return None

    def misfiled(self, record: Record, run_id: str, slot: Optional[int]) -> Optional[str]:
        """Why ``record`` does not belong under this family's key of ``run_id`` and ``slot``, or None."""
        if type(record) is not self.record_type:
            return f"{self.name}: a {record.KIND} record where {self.record_type.KIND} records belong"
        theirs = (getattr(record, "run_id"), None if self.slot is None else getattr(record, self.slot))
        if theirs == (run_id, slot):
            return None
        return f"{record.KIND}: a record of {self._where(*theirs)} under the key of {self._where(run_id, slot)}"

    def _where(self, run_id: str, slot: Optional[int]) -> str:
        return f"run {run_id}" if self.slot is None else f"run {run_id} {self.slot} {slot}"


_HEARTBEAT_TTL_S = 4 * MAX_HEARTBEAT_S  # three beats, and room for a late one
WORKERS = KeyFamily("workers", WorkerRecord, slot="stage", writers=("worker",), writer_stage="stage",
                    max_ttl_s=_HEARTBEAT_TTL_S)
TRAINERS = KeyFamily("trainers", TrainerRecord, writers=("trainer",), max_ttl_s=_HEARTBEAT_TTL_S)
# A mover announces its move while it still holds the credential of the stage it leaves.
MOVES = KeyFamily("moves", MoveRecord, writers=("worker",), writer_stage="from_stage",
                  max_ttl_s=12 * MAX_HEARTBEAT_S)  # node/worker/join.py: twelve beats, at least a minute
# matchmaking_s plus one request, which is shorter (pipeline/config.py)
ROUNDS = KeyFamily("rounds", RoundRecord, slot="stage", writers=("worker",), writer_stage="stage",
                   max_ttl_s=2 * MAX_MATCHMAKING_S)
UNIT_BLOCKS = KeyFamily("units", UnitBlockRecord, slot="block", writers=("trainer", "operator"), lasting=True,
                        max_ttl_s=8 * DAY_S)
KEY_FAMILIES = (WORKERS, TRAINERS, MOVES, ROUNDS, UNIT_BLOCKS)
# Not per-peer and written by no credential's role: the CA's signature decides (dht/bans.py).
BAN_LIST = KeyFamily("bans", BanListRecord, max_ttl_s=HOUR_S)


def typed_keys(run_id: str, *, methods: tuple[str, ...], max_stages: int = MAX_STAGES
               ) -> Iterator[tuple[str, KeyFamily, Optional[int]]]:
    """Every key of ``run_id`` that holds records, as (key, its family, its slot or None).

    ``methods`` are the averaging methods that keep a rounds board; stages go up to ``max_stages``.
    """
    yield trainer_key(run_id), TRAINERS, None
    yield move_key(run_id), MOVES, None
    for block in range(MAX_UNIT_BLOCKS):
        yield units_key(run_id, block), UNIT_BLOCKS, block
    for stage in range(max_stages):
        yield worker_key(run_id, stage), WORKERS, stage
        for method in methods:
            yield rounds_key(run_id, stage, method), ROUNDS, stage
