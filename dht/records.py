"""Typed records that peers publish in the DHT, and their wire form.

Design choices:

- Every record type the DHT holds is declared here: workers, trainers, moves, averaging rounds
  (``RoundRecord``, read by dht/round_board.py's ``RoundBoard``), leased unit blocks
  (``UnitBlockRecord``, dht/leases.py) and the ban list. Their keys are named in dht/keys.py, and
  which key holds which record in dht/key_families.py.
- A record is a frozen pydantic model in strict mode whose fields are plain scalars (str, int,
  float, bool, bytes). Each field's type and bounds are declared once, on the field, through the
  field types of dht/record_fields.py (``PeerId``, ``Stage``, ``Count``, ``Seconds``, ...); a
  rule between two fields (a stage below ``n_stages``) is the model's one after-validator. Strict means no coercion: "1"
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
"""

import enum
from typing import Any, ClassVar, Literal, Mapping, Optional, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from agora.dht.keys import bans_key, move_key, trainer_key, units_key, worker_key
from agora.dht.record_fields import (BITMAP_BYTES, BLOCK_UNITS, CLAIM_LAYOUT, BannedPeers, Bitmap, Block, Claims, Count,
                                     Credits, Endpoint, Label, Measure, OptionalEndpoint, Packed, PeerId, RecordError,
                                     RunId, Seconds, Signature, Stage, StageCount, one_line_error)

__all__ = ["CLOCK_SKEW_S", "COVERING_PHASES", "MAX_CLAIM_AGE_S", "MAX_CLAIMS", "MAX_LEASE_S", "PHASES",
           "PHASE_TRANSITIONS", "START_PHASES", "SERVING_PHASES", "Phase", "SCHEMA_VERSION", "TRAINING_PHASES",
           "BanListRecord", "MoveRecord", "Record", "RoundRecord", "TrainerRecord", "UnitBlockRecord", "WorkerRecord",
           "claim_problem"]

SCHEMA_VERSION = 2
# How far apart peers' clocks may be: hivemind refuses requests whose time is further off than this.
CLOCK_SKEW_S = 60.0


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
# Lease bounds every peer holds a trainer's claims to (UnitBlockRecord; dht/leases.py says why):
# the longest lease a trainer may take (its `--lease`, 30 s by default, is bounded by it), how long
# one claim may be held by renewals before it must be made anew, and how many claims one trainer's
# entry may hold in a block (a trainer runs a few global batches at once and claims no more than this).
MAX_LEASE_S = 600.0
MAX_CLAIM_AGE_S = 3600.0
MAX_CLAIMS = 64

R = TypeVar("R", bound="Record")


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
            raise one_line_error(self.KIND, error) from None

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

    def dht_key(self) -> str:
        return units_key(self.run_id, self.block)

    @model_validator(mode="after")
    def _claims_bounded(self) -> "UnitBlockRecord":
        claims = list(CLAIM_LAYOUT.iter_unpack(self.claims))
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
                for offset, claimed_at, expires_at in CLAIM_LAYOUT.iter_unpack(self.claims)}

    @classmethod
    def build(cls, peer_id: str, run_id: str, block: int, committed: set[int],
              claims: Mapping[int, tuple[float, float]], now: float) -> "UnitBlockRecord":
        first = block * BLOCK_UNITS
        bitmap = bytearray(BITMAP_BYTES)
        for unit in committed:
            offset = unit - first
            bitmap[offset // 8] |= 1 << (offset % 8)
        packed = b"".join(CLAIM_LAYOUT.pack(unit - first, claimed_at, expires_at)
                          for unit, (claimed_at, expires_at) in sorted(claims.items()))
        return cls(peer_id=peer_id, run_id=run_id, block=block, committed=bytes(bitmap), claims=packed,
                   updated_at=now)


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
