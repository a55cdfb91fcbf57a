"""The names of the DHT keys a run uses, and of the subkeys each peer writes under.

Design choices:

- Every key is built here, by one function per family, so every reader and writer builds the same
  keys: ``{run}.stage{i}.workers``, ``{run}.trainers``, ``{run}.moves``,
  ``{run}.stage{i}.{method}.rounds``, ``{run}.units.b{block}``, ``{run}.bans``. Each part is
  checked with its record field's type (dht/record_fields.py): ``run_id`` is restricted to
  ``[A-Za-z0-9_-]`` so that the dots in keys separate components unambiguously. A record knows its
  own key (``dht_key()``, dht/records.py), so one heartbeat serves every record type.
- Names only: which record type a key holds and who may write it is dht/key_families.py's, which
  imports both the records and these builders (the records need the builders for their keys).
- Per-peer entries live under subkeys. With admission on (dht/security.py) a subkey is
  ``<peer id>[owner:<ssh-rsa ...>]``: hivemind's ``RSASignatureValidator`` then lets only the
  holder of that key write or tombstone the entry, and readers check that the key is the one
  the peer id is derived from. ``owned_subkey`` / ``split_subkey`` build and parse that form
  (pure string work; the key check needs the key parser and lives with the readers).
- hivemind's own averaging keys are named here too (``averaging_prefix``, ``averaging_keys``):
  every key an admitted peer may store is listed by ``typed_keys``, ``bans_key`` or
  ``averaging_keys``, and the record validator refuses any other (dht/security.py).
"""

from typing import Any, Iterator, Optional

from pydantic import TypeAdapter, ValidationError

from agora.dht.record_fields import MAX_STAGES, MAX_TEXT, Block, RecordError, RunId, Stage, one_line_error

__all__ = ["AVERAGING_GROUP_BITS", "OWNER_MARKER", "averaging_key_parts", "averaging_keys", "averaging_prefix",
           "bans_key", "check_run_id", "move_key", "owned_subkey", "rounds_key", "split_subkey", "trainer_key",
           "units_key", "worker_key"]

# hivemind's RSASignatureValidator.PUBLIC_KEY_FORMAT, as text: b"[owner:_key_]".
OWNER_MARKER = "[owner:"
# Bits of the round number in hivemind's matchmaking key (dht/averaging.py): rounds this many
# apart never meet in time (a replica joins rounds at most a few past the stage's), and so few
# keys per stage let the record validator list every one of them.
AVERAGING_GROUP_BITS = 4
# The key builders check their arguments with the same field types (a key part is a record field).
_RUN_ID, _STAGE, _BLOCK = TypeAdapter(RunId), TypeAdapter(Stage), TypeAdapter(Block)


def _key_part(adapter: TypeAdapter, name: str, value: object) -> Any:
    try:
        return adapter.validate_python(value, strict=True)
    except ValidationError as error:
        raise one_line_error(name, error) from None


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
