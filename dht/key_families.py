"""Which record type each DHT key family holds, who may write it, and how long its entries may live.

Design choices:

- ``KEY_FAMILIES`` is the one statement of which record type each key family holds, and
  ``typed_keys`` lists a run's keys with their family, so a validator that sees only a key's hash
  (hivemind's) can look the schema up (dht/key_policy.py, dht/security.py). A rule about a family
  (who may write it) is one more field of its ``KeyFamily``.
- The families sit above both the record schemas (dht/records.py) and the key names
  (dht/keys.py): a family pairs the two, and a record needs its key's builder, so neither of
  those can hold the pairing without an import cycle.
- Entry lifetimes are bounded here because they are a family's rule: a writer picks its entry's
  expiry, and the longest heartbeat (``MAX_HEARTBEAT_S``) sets how long an honest announce lives.
- The run's ban list (``BAN_LIST``) is the one family that is not per-peer and that no
  credential's role writes: the run's CA's signature decides (dht/bans.py).
"""

from dataclasses import dataclass
from typing import Iterator, Optional

from agora.dht.keys import move_key, rounds_key, trainer_key, units_key, worker_key
from agora.dht.record_fields import MAX_STAGES, MAX_UNIT_BLOCKS
from agora.dht.records import (CLOCK_SKEW_S, BanListRecord, MoveRecord, Record, RoundRecord, TrainerRecord,
                               UnitBlockRecord, WorkerRecord)
from agora.pipeline.config import MAX_MATCHMAKING_S

__all__ = ["BAN_LIST", "DAY_S", "HOUR_S", "KEY_FAMILIES", "MAX_HEARTBEAT_S", "KeyFamily", "typed_keys"]

HOUR_S, DAY_S = 3600.0, 24 * 3600.0
# The longest a node may leave between two announces (`join --heartbeat`, `trainer --heartbeat`): an
# announce lives three beats, so no heartbeat family needs its entries to live longer than a few
# minutes, and peers refuse entries meant to (KeyFamily.max_ttl_s).
MAX_HEARTBEAT_S = 60.0


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
