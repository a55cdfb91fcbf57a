"""Typed records that peers publish in the DHT, and their wire form.

Design choices:

- A record is a frozen dataclass whose fields are plain scalars (str, int, float, bool, and
  bytes of at most ``MAX_BYTES_LENGTH`` for a packed field such as a bitmap).
  Its wire form is a flat dict of those scalars plus ``schema`` and ``kind``: exactly what
  msgpack (hivemind's serializer) carries without extension types, so a peer written in
  another language, or a later version of this one, can read it.
- Validation runs on construction, so a record that exists is a valid record. Reading
  goes through ``from_wire``, which turns *anything* (another peer's mistake, an attack,
  an older schema) into either a record or a ``RecordError`` whose message is one readable
  line naming the field. Readers skip and count such values; they never crash on them.
- ``schema`` must match exactly: a breaking change bumps ``SCHEMA_VERSION`` and old
  readers reject new records cleanly. Unknown extra fields are ignored, so adding a field
  with a default does not need a bump.
- Key naming lives here, next to the schemas, so every reader and writer builds the same
  keys. ``run_id`` is restricted to ``[A-Za-z0-9_-]`` so that the dots in keys separate
  components unambiguously.
- Every record type the DHT holds is declared here, with the builder of its key: workers,
  trainers, moves, averaging rounds (``RoundRecord``, used by dht/averaging.py's ``RoundBoard``)
  and leased unit blocks (``UnitBlockRecord``, used by dht/leases.py). A new type subclasses
  ``Record``, declares scalar fields, sets ``KIND``, and puts range checks in ``check()``.
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
- A record knows its own key (``dht_key()``), so one heartbeat serves every record type.
"""

import dataclasses
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, TypeVar

__all__ = [
    "MAX_STAGES",
    "BLOCK_UNITS",
    "MAX_UNIT_BLOCKS",
    "MoveRecord",
    "PHASES",
    "TRAINING_PHASES",
    "SCHEMA_VERSION",
    "Record",
    "RecordError",
    "RoundRecord",
    "TrainerRecord",
    "UnitBlockRecord",
    "WorkerRecord",
    "OWNER_MARKER",
    "check_run_id",
    "move_key",
    "owned_subkey",
    "parse_endpoint",
    "rounds_key",
    "split_subkey",
    "trainer_key",
    "units_key",
    "worker_key",
]

SCHEMA_VERSION = 2
# hivemind's RSASignatureValidator.PUBLIC_KEY_FORMAT, as text: b"[owner:_key_]".
OWNER_MARKER = "[owner:"
# "serving": a worker that answers inference only (join --serve-only); trainers never route to it.
PHASES = frozenset({"weight_sync", "optimizer_sync", "member", "leaving", "serving"})
# Phases in which a worker trains on live traffic: trainers route to them, and their step counts
# are the stage's (a worker in weight sync has not got the stage's state yet).
TRAINING_PHASES = ("member", "optimizer_sync")
# Generous bounds: they exist to reject garbage cheaply, not to constrain real runs.
MAX_STAGES = 4096
MAX_CREDITS = 2**16  # a worker's queue, and the credits it announces
BLOCK_UNITS = 256
# Blocks the record validator knows (dht/security.py): 2**20 units, six times the Agora run's.
MAX_UNIT_BLOCKS = 4096
_CLAIM = struct.Struct("<Hdd")  # unit offset in the block, claimed_at, expires_at
_BITMAP_BYTES = BLOCK_UNITS // 8
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SCALAR_TYPES = (str, int, float, bool, bytes)

R = TypeVar("R", bound="Record")


class RecordError(ValueError):
    """A value that is not a valid record; the message is one line naming the field."""


def check_run_id(run_id: object) -> str:
    """Return ``run_id`` if it can be part of a key, else raise ``RecordError``."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise RecordError(f"run_id: expected 1-64 characters of [A-Za-z0-9_-], got {run_id!r:.80}")
    return run_id


def worker_key(run_id: str, stage: int) -> str:
    """The DHT key under which the workers of one stage announce (one subkey per peer)."""
    check_run_id(run_id)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < MAX_STAGES:
        raise RecordError(f"stage: expected an int in [0, {MAX_STAGES}), got {stage!r}")
    return f"{run_id}.stage{stage}.workers"


def trainer_key(run_id: str) -> str:
    """The DHT key under which the trainers of a run announce (one subkey per peer)."""
    return f"{check_run_id(run_id)}.trainers"


def move_key(run_id: str) -> str:
    """The DHT key under which workers moving between stages announce it (one subkey per peer)."""
    return f"{check_run_id(run_id)}.moves"


def check_metrics_endpoint(kind: str, endpoint: str) -> None:
    """Empty (no metrics served) or a valid ``host:port``."""
    if endpoint:
        try:
            parse_endpoint(endpoint)
        except RecordError as error:
            raise RecordError(f"{kind}.metrics_{error}") from None


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
    if not peer_id or len(peer_id) > Record.MAX_STRING_LENGTH:
        raise RecordError(f"subkey: expected a peer id first, got {subkey!r:.80}")
    if not marker:
        return peer_id, None
    if not owner.endswith("]") or "]" in owner[:-1] or "[" in owner or len(owner) < 2:
        raise RecordError(f"subkey: malformed owner marker in {subkey!r:.80}")
    return peer_id, owner[:-1]


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[addr]:port``) into (host, port); raise ``RecordError``."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
        raise RecordError(f"endpoint: expected 'host:port', got {endpoint!r:.80}")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise RecordError(f"endpoint: malformed IPv6 host in {endpoint!r:.80}")
        host = host[1:-1]
    elif ":" in host:
        raise RecordError(f"endpoint: IPv6 hosts must be bracketed ('[::1]:port'), got {endpoint!r:.80}")
    if any(ch.isspace() for ch in host):
        raise RecordError(f"endpoint: host contains whitespace: {endpoint!r:.80}")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise RecordError(f"endpoint: port {port} out of range [1, 65535]")
    return host, port


@dataclass(frozen=True)
class Record:
    """Base of DHT records: a frozen dataclass of scalar fields, validated on construction.

    Subclasses set ``KIND`` and override ``check()`` for range checks. Field annotations
    must be real types (no ``from __future__ import annotations`` in subclass modules),
    because the type check reads them at runtime.
    """

    KIND: ClassVar[str] = ""
    MAX_STRING_LENGTH: ClassVar[int] = 256
    MAX_BYTES_LENGTH: ClassVar[int] = 4096  # a packed field (a bitmap, fixed-size entries)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            expected = _field_type(type(self), field)
            if not _is_instance(value, expected):
                raise RecordError(
                    f"{self.KIND}.{field.name}: expected {expected.__name__}, got {type(value).__name__}"
                )
            if isinstance(value, str) and len(value) > self.MAX_STRING_LENGTH:
                raise RecordError(
                    f"{self.KIND}.{field.name}: {len(value)} characters, at most {self.MAX_STRING_LENGTH}"
                )
            if isinstance(value, bytes) and len(value) > self.MAX_BYTES_LENGTH:
                raise RecordError(f"{self.KIND}.{field.name}: {len(value)} bytes, at most {self.MAX_BYTES_LENGTH}")
            if expected is float:
                # Normalize whole numbers so equal records compare and serialize equal.
                try:
                    number = float(value)
                except OverflowError:  # an int beyond float range
                    number = math.inf
                if not math.isfinite(number):
                    raise RecordError(f"{self.KIND}.{field.name}: must be finite, got {number}")
                object.__setattr__(self, field.name, number)
        self.check()

    def check(self) -> None:
        """Range and consistency checks; raise ``RecordError`` naming the field."""

    def dht_key(self) -> str:
        """The DHT key this record is stored under (each peer under its own subkey)."""
        raise NotImplementedError(f"{type(self).__name__} does not say where it is stored")

    def to_wire(self) -> dict[str, Any]:
        """A plain dict that msgpack serializes as is."""
        wire: dict[str, Any] = {"schema": SCHEMA_VERSION, "kind": self.KIND}
        wire.update(dataclasses.asdict(self))
        return wire

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
        kwargs = {}
        for field in dataclasses.fields(cls):
            if field.name in value:
                kwargs[field.name] = value[field.name]
            elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise RecordError(f"{cls.KIND}.{field.name}: missing")
        return cls(**kwargs)


def _field_type(cls: type, field: dataclasses.Field) -> type:
    if field.type not in _SCALAR_TYPES:
        raise TypeError(f"{cls.__name__}.{field.name}: record fields must be str, int, float, bool or bytes")
    return field.type


def _is_instance(value: object, expected: type) -> bool:
    # bool is a subclass of int in Python, but a bool where a count belongs is a bug.
    if expected is not bool and isinstance(value, bool):
        return False
    if expected is float:
        # A writer in another language may encode a whole float as a msgpack int.
        return isinstance(value, (float, int))
    return isinstance(value, expected)


@dataclass(frozen=True)
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

    peer_id: str
    run_id: str
    endpoint: str
    stage: int
    n_stages: int
    throughput: float
    queue_depth: int
    step: int
    phase: str
    version: str
    updated_at: float
    fingerprint: str
    sessions: int = 0
    metrics_endpoint: str = ""
    averaging_rounds: int = 0
    averaging_committed: int = 0
    capacity: int = 0
    credits: int = 0
    in_flight_credits: int = 0

    def dht_key(self) -> str:
        return worker_key(self.run_id, self.stage)

    def check(self) -> None:
        if not self.peer_id:
            raise RecordError("worker.peer_id: empty")
        check_run_id(self.run_id)
        parse_endpoint(self.endpoint)
        if not 1 <= self.n_stages <= MAX_STAGES:
            raise RecordError(f"worker.n_stages: {self.n_stages} out of range [1, {MAX_STAGES}]")
        if not 0 <= self.stage < self.n_stages:
            raise RecordError(f"worker.stage: {self.stage} out of range [0, n_stages={self.n_stages})")
        for name in ("throughput", "queue_depth", "step", "updated_at", "sessions", "averaging_rounds",
                     "averaging_committed"):
            if getattr(self, name) < 0:
                raise RecordError(f"worker.{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("capacity", "credits", "in_flight_credits"):
            if not 0 <= getattr(self, name) <= MAX_CREDITS:
                raise RecordError(f"worker.{name}: {getattr(self, name)} out of range [0, {MAX_CREDITS}]")
        if self.credits > self.capacity:
            raise RecordError(f"worker.credits: {self.credits} is above capacity={self.capacity}")
        if self.averaging_committed > self.averaging_rounds:
            raise RecordError(f"worker.averaging_committed: {self.averaging_committed} is above averaging_rounds="
                              f"{self.averaging_rounds}")
        check_metrics_endpoint("worker", self.metrics_endpoint)
        if self.phase not in PHASES:
            raise RecordError(f"worker.phase: expected one of {sorted(PHASES)}, got {self.phase!r:.40}")
        if not self.version:
            raise RecordError("worker.version: empty")
        if not self.fingerprint:
            raise RecordError("worker.fingerprint: empty")


@dataclass(frozen=True)
class TrainerRecord(Record):
    """What a trainer announces about itself every heartbeat (under ``trainer_key(run_id)``).

    ``batches`` is the global batches it completed, ``step`` the run-wide step of the last one,
    ``loss`` that batch's mean loss (0 before the first), ``tokens_per_s`` its rate since it
    started, ``metrics_endpoint`` where its Prometheus metrics are served (empty: none).
    """

    KIND: ClassVar[str] = "trainer"

    peer_id: str
    run_id: str
    trainer_index: int
    batches: int
    step: int
    loss: float
    tokens_per_s: float
    version: str
    updated_at: float
    metrics_endpoint: str = ""

    def dht_key(self) -> str:
        return trainer_key(self.run_id)

    def check(self) -> None:
        if not self.peer_id:
            raise RecordError("trainer.peer_id: empty")
        check_run_id(self.run_id)
        for name in ("trainer_index", "batches", "step", "loss", "tokens_per_s", "updated_at"):
            if getattr(self, name) < 0:
                raise RecordError(f"trainer.{name}: must be >= 0, got {getattr(self, name)}")
        if not self.version:
            raise RecordError("trainer.version: empty")
        check_metrics_endpoint("trainer", self.metrics_endpoint)


@dataclass(frozen=True)
class MoveRecord(Record):
    """A worker in transit from one stage to another (node/worker/rebalance.py), announced for as long
    as it may take to come back on ``to_stage``; ``started_at`` is DHT time."""

    KIND: ClassVar[str] = "move"

    peer_id: str
    run_id: str
    from_stage: int
    to_stage: int
    started_at: float

    def dht_key(self) -> str:
        return move_key(self.run_id)

    def check(self) -> None:
        if not self.peer_id:
            raise RecordError("move.peer_id: empty")
        check_run_id(self.run_id)
        for name in ("from_stage", "to_stage"):
            if not 0 <= getattr(self, name) < MAX_STAGES:
                raise RecordError(f"move.{name}: {getattr(self, name)} out of range [0, {MAX_STAGES})")
        if self.from_stage == self.to_stage:
            raise RecordError(f"move: from_stage and to_stage are both {self.from_stage}")


def rounds_key(run_id: str, stage: int, method: str) -> str:
    """Where the replicas of one stage announce the rounds they start (one subkey per peer)."""
    base = worker_key(run_id, stage).rsplit(".", 1)[0]  # "{run}.stage{i}", validated there
    if not method.isidentifier():
        raise RecordError(f"method: expected an identifier, got {method!r:.40}")
    return f"{base}.{method}.rounds"


@dataclass(frozen=True)
class RoundRecord(Record):
    """A replica is starting averaging round ``round`` of its stage (``started_at``: DHT time), or,
    with ``closed``, has left it (its result is in, or it gave up): nobody should join it now."""

    KIND: ClassVar[str] = "round"

    peer_id: str
    run_id: str
    stage: int
    round: int
    started_at: float
    closed: bool = False

    def check(self) -> None:
        if not self.peer_id:
            raise RecordError("round.peer_id: empty")
        check_run_id(self.run_id)
        if self.stage < 0 or self.round < 0 or self.started_at < 0:
            raise RecordError("round.stage/round/started_at: must be >= 0")


def units_key(run_id: str, block: int) -> str:
    """The DHT key of one block of units (one subkey per trainer)."""
    check_run_id(run_id)
    if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < MAX_UNIT_BLOCKS:
        raise RecordError(f"units.block: expected an int in [0, {MAX_UNIT_BLOCKS}), got {block!r}")
    return f"{run_id}.units.b{block}"


@dataclass(frozen=True)
class UnitBlockRecord(Record):
    """One trainer's commits and live claims in one block of units."""

    KIND: ClassVar[str] = "units"

    peer_id: str
    run_id: str
    block: int
    committed: bytes  # bitmap of the block's units this trainer committed (bit i: unit block*256 + i)
    claims: bytes  # packed (offset, claimed_at, expires_at) per live claim
    updated_at: float
    credential: bytes = b""  # the writer's credential chain (PEM); empty under --insecure

    def check(self) -> None:
        if not self.peer_id:
            raise RecordError("units.peer_id: empty")
        units_key(self.run_id, self.block)
        if len(self.committed) != _BITMAP_BYTES:
            raise RecordError(f"units.committed: expected a {_BITMAP_BYTES}-byte bitmap, got {len(self.committed)}")
        if len(self.claims) % _CLAIM.size:
            raise RecordError(f"units.claims: {len(self.claims)} bytes is not a whole number of claims")
        for offset, claimed_at, expires_at in _CLAIM.iter_unpack(self.claims):
            if offset >= BLOCK_UNITS or not (math.isfinite(claimed_at) and math.isfinite(expires_at)):
                raise RecordError(f"units.claims: offset {offset} or times out of range")
        if self.updated_at < 0:
            raise RecordError("units.updated_at: must be >= 0")

    def dht_key(self) -> str:
        return units_key(self.run_id, self.block)

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
