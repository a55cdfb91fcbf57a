"""The field types every DHT record and key part is checked with, their bounds, and ``RecordError``.

Design choices:

- Each field's type and bounds are declared once, as an ``Annotated`` type here (``PeerId``,
  ``Stage``, ``Count``, ``Seconds``, ...), and every record that has such a field uses it
  (dht/records.py); the key builders check a key's parts with the same types (dht/keys.py), so a
  run id or a stage that could not be a record's field cannot be part of a key either.
- The bounds are generous: they exist to reject garbage cheaply, not to constrain real runs.
- A bad value is a ``RecordError`` whose message is one line naming the field and the value
  (``one_line_error`` turns pydantic's report into it). Records and keys both raise it, so it
  lives below both.
"""

import math
import re
import struct
from typing import Annotated

from pydantic import AfterValidator, Field, ValidationError

__all__ = ["BITMAP_BYTES", "BLOCK_UNITS", "CLAIM_LAYOUT", "MAX_BANS", "MAX_CREDITS", "MAX_PACKED", "MAX_STAGES",
           "MAX_TEXT", "MAX_UNIT_BLOCKS", "BannedPeers", "Bitmap", "Block", "Claims", "Count", "Credits", "Endpoint",
           "Label", "Measure", "OptionalEndpoint", "Packed", "PeerId", "RecordError", "RunId", "Seconds", "Signature",
           "Stage", "StageCount", "one_line_error", "parse_endpoint"]

MAX_STAGES = 4096
MAX_CREDITS = 2**16  # a worker's queue, and the credits it announces
MAX_TEXT = 256  # characters of any text field
MAX_PACKED = 4096  # bytes of a packed field (a bitmap, fixed-size entries, a credential chain)
BLOCK_UNITS = 256
# Blocks the record validator knows (dht/security.py): 2**20 units, six times the Agora run's.
MAX_UNIT_BLOCKS = 4096
# Peer ids one ban list may name (about 55 KB at most: every node reads the list each heartbeat).
MAX_BANS = 1024
CLAIM_LAYOUT = struct.Struct("<Hdd")  # unit offset in the block, claimed_at, expires_at
BITMAP_BYTES = BLOCK_UNITS // 8


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
    if len(packed) % CLAIM_LAYOUT.size:
        raise ValueError(f"{len(packed)} bytes is not a whole number of claims")
    for offset, claimed_at, expires_at in CLAIM_LAYOUT.iter_unpack(packed):
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
Bitmap = Annotated[bytes, Field(min_length=BITMAP_BYTES, max_length=BITMAP_BYTES)]  # one bit per unit of a block
Claims = Annotated[bytes, Field(max_length=MAX_PACKED), AfterValidator(_claims)]
BannedPeers = Annotated[str, Field(max_length=MAX_BANS * 129), AfterValidator(_banned_peers)]
Packed = Annotated[bytes, Field(max_length=MAX_PACKED)]
Signature = Annotated[bytes, Field(min_length=1, max_length=1024)]

def one_line_error(where: str, error: ValidationError) -> RecordError:
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


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[addr]:port``) into (host, port); raise ``RecordError``."""
    try:
        return _split_endpoint(endpoint)
    except ValueError as error:
        raise RecordError(f"endpoint: {error}, got {endpoint!r:.80}") from None
