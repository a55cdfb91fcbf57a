"""The run's ban list in the DHT: who signs it, how a node checks it, which list wins.

A ban by the operator (``agora-node authorizer ban``) must reach every node within a heartbeat,
not only the authorizer's next renewal. So the authorizer publishes the list in the DHT, and
every node reads it back each heartbeat and refuses a banned peer everywhere it looks.

Design choices:

- Signed by the run's issuing CA, the key the authorizer already holds to sign credentials. The
  record carries that CA's certificate (``BanListRecord.signer``); a reader checks that the
  root it pinned signed it directly, that it is a CA and was valid when the list was issued,
  and the signature (RSA-PSS, SHA-256) over the list's fields behind a domain tag of its own
  (the same key signs run descriptions, auth/policy.py ``run_payload``). Nobody else can make
  a list, so whoever stores one only relays it: the DHT accepts a valid list from any admitted
  writer (hivemind re-stores what it finds on nearer peers), and refuses any other value there.
- Newest wins by ``serial``, a number the publisher only ever raises (its time in milliseconds,
  or one past its last serial, whichever is larger, so it also rises across a lost state file).
  A list is never judged by its age: an unban is a newer list without the peer, and a node keeps
  the newest list it has verified for as long as it runs, even when the DHT holds none.
- One subkey per serial under ``{run}.bans``: a store wins in hivemind only with a later
  expiration, so under one subkey an admitted peer could re-store an old list with a far
  expiration and hide the new one from nodes that start later. Under its own subkey a newer
  list is always found; superseded ones expire (``BAN_LIST.max_ttl_s``).
- Each node holds a ``BanBook``: the newest valid list, refusals of invalid ones by reason.
  The DHT process keeps the one its record validator checks stores with; ``fetch_ban_list``
  (run there by ``SwarmDHT.refresh_bans``) reads the key, offers what it found to that book,
  hands the banned set to the token authorizer, and answers the book's state to the node.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import msgpack
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from agora.auth.credentials import Clock, Issuer
from agora.dht.holder_reads import read_entry
from agora.dht.keys import bans_key
from agora.dht.record_fields import RecordError
from agora.dht.records import CLOCK_SKEW_S, BanListRecord
from agora.dht.store_checks import RefusedEntries

__all__ = ["BAN_REFRESH_S", "BanBook", "BanList", "BanListError", "BanStatus", "NodeBans", "fetch_ban_list", "newer",
           "sign_ban_list", "verify_ban_list"]

# How old a node's read of the list may be when it reads the DHT: a heartbeat's default (dht/heartbeat.py).
BAN_REFRESH_S = 5.0
_DOMAIN = b"agora-bans-v1\0"
logger = logging.getLogger(__name__)
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
_MAX_VERDICTS = 256  # lists remembered as checked: each is verified once, not every heartbeat


class BanListError(ValueError):
    """A ban list that does not verify; ``reason`` is short (``malformed``, ``wrong_run``,
    ``untrusted_signer``, ``bad_signature``, ``future``), the message one line."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class BanList:
    """A verified ban list: what a node acts on."""

    run_id: str
    serial: int
    issued_at: float
    banned: frozenset[str]


@dataclass(frozen=True)
class BanStatus:
    """What a node's DHT process holds: the newest verified list (None: none seen yet) and the
    values its record validator refused so far, by reason (ban lists and every other key)."""

    ban_list: Optional[BanList]
    refused: Mapping[str, int]


def _payload(run_id: str, serial: int, issued_at: float, banned: str) -> bytes:
    return _DOMAIN + msgpack.packb([run_id, serial, issued_at, banned], use_bin_type=True)


def sign_ban_list(issuer: Issuer, *, run_id: str, serial: int, banned: Iterable[str], now: float) -> BanListRecord:
    """The list of ``banned`` peer ids as of ``serial``, signed by ``issuer`` (the run's issuing CA)."""
    text = "\n".join(sorted(set(banned)))
    signature = issuer.key.sign(_payload(run_id, serial, float(now), text), _PSS, hashes.SHA256())
    return BanListRecord(run_id=run_id, serial=serial, issued_at=float(now), banned=text, signer=issuer.pem,
                         signature=signature)


def verify_ban_list(record: BanListRecord, *, root: x509.Certificate, run_id: str, now: float) -> BanList:
    """The list ``record`` states if the run's root vouches for it (module docstring), else ``BanListError``."""
    if record.run_id != run_id:
        raise BanListError("wrong_run", f"ban list of run {record.run_id!r}, this is run {run_id!r}")
    if record.issued_at > now + CLOCK_SKEW_S:
        raise BanListError("future", f"ban list issued {record.issued_at - now:.0f} s from now")
    try:
        signer = x509.load_pem_x509_certificate(record.signer)
    except ValueError:
        raise BanListError("malformed", "ban list: its signer is not a PEM certificate") from None
    _check_signer(signer, root, record.issued_at)
    key = signer.public_key()
    if not isinstance(key, rsa.RSAPublicKey):
        raise BanListError("untrusted_signer", "ban list: its signer's key is not an RSA key")
    try:
        key.verify(record.signature, _payload(record.run_id, record.serial, record.issued_at, record.banned), _PSS,
                   hashes.SHA256())
    except InvalidSignature:
        raise BanListError("bad_signature", f"ban list {record.serial}: the signature does not verify") from None
    return BanList(record.run_id, record.serial, record.issued_at, record.peers())


def _check_signer(signer: x509.Certificate, root: x509.Certificate, issued_at: float) -> None:
    try:
        signer.verify_directly_issued_by(root)
    except (ValueError, TypeError, InvalidSignature):
        raise BanListError("untrusted_signer", "ban list: its signer is not a CA of this run's root") from None
    try:
        is_ca = signer.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise BanListError("untrusted_signer", "ban list: its signer is not a CA")
    if not signer.not_valid_before_utc.timestamp() <= issued_at <= signer.not_valid_after_utc.timestamp():
        raise BanListError("untrusted_signer", "ban list: issued outside its signer's validity")


def newer(current: Optional[BanList], candidate: BanList) -> bool:
    """Whether ``candidate`` replaces ``current``: a higher serial, and nothing else."""
    return current is None or candidate.serial > current.serial


class BanBook:
    """The newest verified ban list of a run, and what was refused on the way (not thread-safe:
    one per process, used from one loop or behind the caller's lock)."""

    def __init__(self, root_pem: bytes, run_id: str, *, clock: Clock = time.time):
        self.root = x509.load_pem_x509_certificate(root_pem)
        self.run_id = run_id
        self.key = bans_key(run_id)
        self._clock = clock
        self.current: Optional[BanList] = None
        self.refused: Counter[str] = Counter()  # lists refused, by BanListError.reason
        self._verdicts: dict[tuple, BanList | BanListError] = {}  # by the whole signed content

    @property
    def banned(self) -> frozenset[str]:
        return frozenset() if self.current is None else self.current.banned

    def is_banned(self, peer_id: str) -> bool:
        return self.current is not None and peer_id in self.current.banned

    def check(self, value: Any, subkey: Any) -> BanList:
        """The list a stored ``value`` under ``subkey`` states, or ``BanListError`` (counted)."""
        try:
            record = BanListRecord.from_wire(value)
        except RecordError as error:
            return self._refuse(BanListError("malformed", str(error)))
        if subkey != str(record.serial):
            return self._refuse(BanListError("malformed", f"ban list {record.serial} under subkey {subkey!r:.40}"))
        seen = (record.signature, record.signer, record.serial, record.issued_at, record.banned)
        verdict = self._verdicts.get(seen)
        if verdict is None:
            try:
                verdict = verify_ban_list(record, root=self.root, run_id=self.run_id, now=self._clock())
            except BanListError as error:
                verdict = error
            if len(self._verdicts) >= _MAX_VERDICTS:
                self._verdicts.clear()
            self._verdicts[seen] = verdict
        if isinstance(verdict, BanListError):
            return self._refuse(verdict)
        return verdict

    def _refuse(self, error: BanListError) -> BanList:
        self.refused[error.reason] += 1
        raise error

    def offer(self, entries: Mapping[Any, Any]) -> Optional[BanList]:
        """Take the newest valid list among ``entries`` (subkey -> value, as a read of the key
        gives them) if it is newer than the one held; the list held afterwards."""
        for subkey, value in entries.items():
            try:
                candidate = self.check(value, subkey)
            except BanListError:
                continue
            if newer(self.current, candidate):
                self.current = candidate
        return self.current


class NodeBans:
    """A node's view of the ban list: what its DHT process last answered (``SwarmDHT.refresh_bans``)
    and when. Read from any thread: it is replaced whole, never changed in place."""

    def __init__(self) -> None:
        self._status = BanStatus(None, {})
        self._read_at = -float("inf")  # time.monotonic() of the last read

    @property
    def ban_list(self) -> Optional[BanList]:
        return self._status.ban_list

    @property
    def banned(self) -> frozenset[str]:
        ban_list = self._status.ban_list
        return frozenset() if ban_list is None else ban_list.banned

    def is_banned(self, peer_id: str) -> bool:
        return peer_id in self.banned

    def refused(self) -> dict[str, int]:
        """Values this node's DHT validators refused so far, by reason, as of the last read."""
        return dict(self._status.refused)

    def due(self, max_age_s: float) -> bool:
        """Whether the last read is older than ``max_age_s``; if so, the caller reads now (a failed
        read waits for its next turn too)."""
        now = time.monotonic()
        if now - self._read_at < max_age_s:
            return False
        self._read_at = now
        return True

    def update(self, status: Optional[BanStatus]) -> None:
        if status is None:  # --insecure: no DHT validator keeps a list
            return
        before, self._status = self._status.ban_list, status
        after = status.ban_list
        if after is not None and (before is None or after.serial != before.serial):
            fields = {"serial": after.serial, "banned": len(after.banned), "issued_at": after.issued_at}
            logger.info("ban list %d: %d peers banned", after.serial, len(after.banned),
                        extra={"milestone": "ban_list", "fields": fields})


# Run inside the DHT process through run_coroutine (module-level, so it pickles by name).
async def fetch_ban_list(_dht: Any, node: Any) -> Optional[BanStatus]:
    """Read the ban list's key, let this process's ``BanBook`` (the record validator's) take the
    newest valid list, give the token authorizer its banned set, and answer the book's state.
    None under ``--insecure`` (no validator keeps a book)."""
    validator = _book_keeper(node.protocol.record_validator)
    if validator is None:
        return None
    book = validator.ban_book()
    found = await read_entry(_dht, node, key=book.key, bar=None, exclude_self=node.protocol.client_mode)
    if found is not None and isinstance(found.value, dict):
        book.offer({subkey: item.value for subkey, item in found.value.items()})
    authorizer = node.protocol.authorizer
    if hasattr(authorizer, "banned"):
        authorizer.banned = book.banned
    refused = Counter(validator.refused.snapshot())
    if isinstance(getattr(authorizer, "refused", None), RefusedEntries):
        refused.update(authorizer.refused.snapshot())  # stores refused at the door (dht/store_checks.py)
    return BanStatus(book.current, dict(refused))


def _book_keeper(validator: Any) -> Any:
    """The validator in hivemind's composite that keeps a ban book (dht/security.py), if any."""
    for candidate in getattr(validator, "_validators", [validator]):
        if hasattr(candidate, "ban_book"):
            return candidate
    return None
