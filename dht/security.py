"""The hivemind side of admission: who may talk to the DHT, and who may write which entry.

Three hivemind mechanisms, each given our credentials:

- ``CredentialTokenAuthorizer`` (hivemind's ``TokenAuthorizerBase``, as Pluralis node0 uses
  it; dht/token_authorizer.py): every DHT request and response carries an access token and is signed with the
  sender's node key. Our token *is* the node's credential: ``username`` holds its PEM chain
  (leaf + issuing CA), ``public_key`` the node key in OpenSSH form, ``expiration_time`` the
  leaf's not-after (seconds, informational: the chain decides). A receiver verifies the chain
  against the pinned root for this run (``CredentialVerifier``, cached by chain bytes, times
  checked on every call), that the token's key is the certified key (the peer id is derived
  from it, so a stolen chain is useless without the private key: hivemind checks the
  request's signature against the token's key), and that it has not expired. Nothing is
  asked of the authorizer service on this path.
  Chains by name (dht/chain_references.py): the chain is ~2.7 KB and every request and response
  carries a token, more than most DHT messages themselves, and a latest read asks a beam of 8
  peers. So a receiver keeps the chains it verified with their keys (bounded, by SHA-256 of the
  chain's bytes), and between peers that hold each other's chain ``username`` is
  ``sha256:<hex>`` instead and the key is left out (the signature covers it: the sender signs with
  it in place, the receiver puts back the key of the named chain before checking). A name the
  receiver does not hold is refused like a bad token. A sender names its chain only where it
  knows it is held: every token also says which chain of its counterparty its sender holds (the
  first 8 bytes of its digest, in the token's ``signature`` field: hivemind's base class never
  reads it, the message's signature covers it, and an older peer ignores it, so it is sent full
  chains). A response names the responder's chain when the request said it holds it; a request,
  when the peer's last token said so. A peer that restarted holds nothing and says so in its next
  token; one that is silent refuses our name, and a request that got no valid response makes the
  next one to that peer carry the chain, so it is served again after one refused request.
  hivemind's client stub does not tell an authorizer whom a request goes to: ``use_peer_stubs``
  gives the DHT process stubs that do (before it, the join's first pings carry the chain). A token
  naming a chain is ~100 bytes instead of ~3.1 KB (a message's whole auth part, with its 256-byte
  signature, 0.46 KB instead of 3.5 KB); every other check (times, ban list, key, replay)
  is made on every call as before. A ``monitor`` credential is read-only: its
  ``StoreRequest`` is refused (ping and find are served). A store is also where a unit block
  entry must be dated now (dht/store_checks.py: the validators below cannot tell a store from a
  find); such refusals are counted by kind in ``refused``, the first of each kind logged.
  Replay protection is hivemind's, kept as is: a request carries its DHT time and an 8-byte
  nonce inside the signature; a receiver refuses times more than 60 s from its own clock and
  nonces seen in the last 3 minutes. So peers' clocks must agree within a minute (hivemind's
  DHT needs that anyway), and a captured request is dead after 60 s.
  Renewal: ``get_token`` re-reads ``credential.pem`` through ``NodeCredentials`` (the main
  process replaces the file atomically); ``does_token_need_refreshing`` is true once the file
  changed or half the token's life is gone, so this process needs no message to follow a
  renewal. An uncredentialed or foreign peer gets no answer from an admitted one (its requests
  are dropped, its responses ignored), so it can neither join nor store nor read. Nor can a
  banned one (``banned``: the run's ban list as this process last read it, dht/bans.py): a ban
  cuts a peer off the DHT within a heartbeat of its publication, whatever its credential says.
  For a store it lets through, it marks the request's context for the record validator
  (``STORE_CONTEXT``: who sends it, which entries come one by one).
- ``RSASignatureValidator`` (hivemind's) with the node key: every entry of ours lives under a
  subkey ``<peer id>[owner:<ssh-rsa ...>]`` and its value carries a signature by that key, so
  only the owner can change or tombstone it. ``OwnerSignatureValidator`` is that class with one
  fix: an owner marker that is not a key is a refusal (hivemind's raises ``ValueError`` inside
  the store handler, a stack trace per hostile request).
- ``OwnedRecordValidator`` (ours) for the record types, in place of hivemind's
  ``SchemaValidator`` (dht/records.py says why that one does not fit our keys): our keys are
  ``{run}.stage{i}.workers``, ``{run}.stage{i}.{method}.rounds``, ``{run}.trainers``, ``{run}.moves``
  and the unit blocks ``{run}.units.b{block}``. This validator does the same job with the same
  mechanism (a table from key hash to key family, built from key_families.py's ``typed_keys``
  for this run's keys, every stage up to ``MAX_STAGES``) and the one parser readers use
  (``Record.from_wire``). For those keys it refuses: a plain value (it would replace every
  peer's entry), a subkey without an owner marker (unsigned), an owner key that is not the
  key of the subkey's peer id (announcing under another's id), and a value that is not a valid
  record of that type for that peer, run and stage. Tombstones (None) pass. hivemind's own
  averaging keys take a flag under a peer id; the ban list, a list the run's CA signed
  (dht/bans.py); any other key is refused (dht/key_policy.py lists them all). It runs on every
  store a peer accepts and on every value a find returns, so an honest peer neither keeps nor
  believes such an entry; readers in ``SwarmDHT`` check the same again and count what they skip.
  On an incoming store only (``STORE_CONTEXT``) it also refuses a banned writer's new entry and
  what is over this peer's storage bounds (dht/storage_bounds.py).
  It also decides who may write each family (``KeyFamily.writers`` and ``writer_stage``): a
  worker record or round of stage *i* only from a worker credentialed for stage *i*, a move only
  from a worker of the stage it leaves, trainer records and unit blocks only from trainers. A
  record alone names no role, and a reader may get an entry from a peer that never met its
  writer, so the writer attaches its credential chain to every typed entry it stores: the value
  is ``<msgpack record><the chain's DER, length-delimited from the end>`` (dht/entry_value.py),
  signed as a whole by the signature validator, and this validator checks the chain against the
  run's root (once per chain), that it is the subkey's peer's, then role and stage, and strips it
  before anyone reads the record. An entry an older agora wrote (base64 PEM) is refused as such.
  The whole chain in every store and in hivemind's finds, not a name for it as tokens use: this
  validator runs synchronously on every value a find returns, from a holder that may have met the
  writer when this peer never did, and it cannot fetch a chain it lacks; hivemind refuses a found
  dictionary whole if one entry fails, so one name this peer cannot resolve would hide a stage's
  every entry from that holder. Our changed finds, the reads that repeat, do name chains: the
  reader says which writers' chains it holds, the holder names only those, and the reader puts
  them back before this validator runs (dht/entry_chains.py), so it judges the entry as stored.
  A chain must be valid now, except for unit blocks, which outlive their writer's credential:
  theirs is judged as issued (the store itself needed a live token). An entry may not be stored
  to expire further ahead than its family allows (``KeyFamily.max_ttl_s``: an hour, a commit eight
  days), so no lie outlives that. A record's times must not be ahead of this peer's clock where
  other peers act on them (``Record.untimely``: a unit block's claims, dht/leases.py). Refused
  entries are counted by kind in ``refused`` (a node reads the counts with the ban list); the first
  of each kind is a warning.

``DHTSecurity`` bundles all of it for one node (its state directory, the pinned root, the run):
``SwarmDHT.start(security=DHTSecurity.from_state_dir(d))`` starts an admitted peer, whose
hivemind ``identity_path`` is the node key, so its DHT peer id is its credential's.

Besides, the gRPC channel to an announced endpoint checks the worker's credential for that
stage (TLS target name), so a record that got past all of this still leads nowhere false.

Everything here is picklable (paths, bytes, hivemind's picklable key): hivemind forks its DHT
process with the authorizer and validators, which build their verifier and caches lazily there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from agora.auth.credentials import Clock, CredentialError, CredentialVerifier, Identity
from agora.auth.keys import hivemind_private_key, load_or_create_key, openssh_public_key
from agora.auth.node_state import NodeCredentials
from agora.dht.bans import BanBook, BanListError
from agora.dht.entry_traffic import ReceivedEntries
from agora.dht.entry_value import (OwnerSignatureValidator, attached_credential_at, credential_attachment,
                                   older_credential_format, split_credential)
from agora.dht.key_policy import PLAIN_TAGS, ROUND_METHODS, KeyTable, Refusal
from agora.dht.ownership import EntryOwnership
from agora.dht.key_families import BAN_LIST, KeyFamily
from agora.dht.keys import split_subkey, worker_key
from agora.dht.record_fields import MAX_STAGES, RecordError
from agora.dht.storage_bounds import IncomingStores, StorageLimits
from agora.dht.store_checks import RefusedEntries, refusal_kind
from agora.dht.token_authorizer import DHT_WRITER_ROLES, CredentialTokenAuthorizer

__all__ = [
    "DHT_WRITER_ROLES",
    "CredentialTokenAuthorizer",
    "DHTSecurity",
    "OwnedRecordValidator",
    "OwnerSignatureValidator",
    "ROUND_METHODS",
    "split_credential",
]

logger = logging.getLogger(__name__)



class OwnedRecordValidator(RecordValidatorBase):
    """Schema, ownership and writer of this run's per-peer entries (see the module docstring).

    ``root_pem`` is the run's root the writers' credentials are checked against; ``state_dir``
    (a ``NodeCredentials`` directory) is this node's, whose current chain it attaches to its own
    stores. A validator without one only checks (it can store no typed entry anyone accepts).
    """

    def __init__(self, run_id: str, root_pem: bytes, *, state_dir: Optional[str | Path] = None,
                 methods: tuple[str, ...] = ROUND_METHODS, max_stages: int = MAX_STAGES,
                 limits: StorageLimits = StorageLimits(), clock: Clock = time.time):
        worker_key(run_id, 0)  # validates the run id
        self.run_id = run_id
        self.root_pem = root_pem
        self.state_dir = None if state_dir is None else Path(state_dir)
        self.limits = limits
        self._clock = clock
        self._keys = KeyTable(run_id, methods=tuple(methods), max_stages=max_stages)
        self._writers: Optional[_WriterChains] = None
        self._book: Optional[BanBook] = None
        self._incoming: Optional[IncomingStores] = None
        self._ownership = EntryOwnership(require_owner=True)
        self.refused = RefusedEntries()  # entries refused, by kind (read with the ban list)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for built in ("_writers", "_book", "_incoming"):  # a verifier, the ban book, the ledger: built there
            state[built] = None
        return state

    def ban_book(self) -> BanBook:
        """This process's newest verified ban list (dht/bans.py), against which stores are checked."""
        if self._book is None:
            self._book = BanBook(self.root_pem, self.run_id, clock=self._clock)
        return self._book

    def _incoming_stores(self) -> IncomingStores:
        if self._incoming is None:
            self._incoming = IncomingStores(self.limits, self.ban_book().is_banned)
        return self._incoming

    def _chains(self) -> _WriterChains:
        if self._writers is None:
            self._writers = _WriterChains(self.root_pem, self.run_id, self.state_dir, self._clock)
        return self._writers

    def _carries_credential(self, key: bytes) -> bool:
        family = self._keys.family(key)
        return family is not None and family[0] is not BAN_LIST

    def sign_value(self, record: DHTRecord) -> bytes:
        if not self._carries_credential(record.key) or self.state_dir is None:
            return record.value
        try:
            return record.value + self._chains().own_attachment()
        except CredentialError as error:
            logger.warning("storing an entry without a credential (peers refuse it): %s", error)
            return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        if not self._carries_credential(record.key):
            return record.value
        at = attached_credential_at(record.value)  # the position alone: validate has decoded the chain already
        return record.value if at < 0 else record.value[:at]

    def validate(self, record: DHTRecord) -> bool:
        expected = self._keys.family(record.key)
        try:
            if expected is None:
                writer = self._keys.averaging_writer(record, self._clock())
            elif expected[0] is BAN_LIST:
                self._check_ban_list(record)
                return True  # only the CA makes lists: they need no storage bound
            else:
                self.check(record, *expected)
                writer = split_subkey(MSGPackSerializer.loads(record.subkey))[0]
            self._incoming_stores().admit(record.key, record.subkey, record.value, record.expiration_time, writer,
                                          self._clock())
        except Refusal as refusal:
            self._refuse(refusal.reason, str(refusal))
            return False
        except (RecordError, ValueError, TypeError) as error:
            name = "averaging" if expected is None else expected[0].name
            self._refuse(refusal_kind(str(error), name), f"{name}: {error}")
            return False
        return True

    def _refuse(self, reason: str, message: str) -> None:
        self.refused.add(reason, f"DHT entry refused ({reason}): {message}")

    def _check_ban_list(self, record: DHTRecord) -> None:
        if record.subkey in PLAIN_TAGS:
            raise RecordError("a plain value (each list lives under its serial)")
        problem = BAN_LIST.too_lasting(record.expiration_time, self._clock())
        if problem is not None:
            raise RecordError(problem)
        try:
            self.ban_book().check(MSGPackSerializer.loads(record.value), MSGPackSerializer.loads(record.subkey))
        except BanListError as error:
            raise Refusal("ban_list", str(error)) from None

    def check(self, record: DHTRecord, family: KeyFamily, slot: Optional[int]) -> None:
        """Raise ``RecordError`` saying why ``record`` may not be stored under a key of ``family``."""
        if record.subkey in PLAIN_TAGS:
            raise RecordError("a plain value under a per-peer key")
        problem = family.too_lasting(record.expiration_time, self._clock())
        if problem is not None:
            raise RecordError(problem)
        value_bytes, chain = split_credential(record.value)
        if chain is None and older_credential_format(record.value):  # before its record is parsed: it cannot be
            raise RecordError(f"{family.name}.credential_format: the writer's credential is attached as an older "
                              "agora does (base64 PEM after '[credential:'): the writer must upgrade")
        subkey = MSGPackSerializer.loads(record.subkey)
        value = MSGPackSerializer.loads(value_bytes)
        parsed = None if value is None else family.record_type.from_wire(value)  # None: the owner's tombstone
        problem = self._ownership.problem(subkey, None if parsed is None else getattr(parsed, "peer_id"))
        if problem is not None:
            raise RecordError(problem)
        problem = None if parsed is None else family.misfiled(parsed, self.run_id, slot)
        if problem is None and parsed is not None:
            problem = parsed.untimely(self._clock(), storing=False)  # a find's values are checked here too
        if problem is not None:
            raise RecordError(problem)
        if chain is None:
            raise RecordError(f"{family.name}: no writer credential attached")
        try:
            writer = self._chains().identity(chain, lasting=family.lasting)
        except CredentialError as error:
            raise RecordError(f"{family.name}: the writer's credential: {error}") from None
        if writer.peer_id != split_subkey(subkey)[0]:
            raise RecordError(f"{family.name}: the attached credential is another peer's ({writer.describe()})")
        problem = family.unauthorized(parsed, writer.role, writer.stage)
        if problem is not None:
            raise RecordError(problem)

    @property
    def priority(self) -> int:
        # Below RSASignatureValidator (10): it signs the value with the credential attached (so the
        # signature covers the credential), and strips its signature before this validator runs.
        return 0


class _WriterChains:
    """The credential chains writers attach (each verified once, by the verifier's caches), and
    this node's own current chain."""

    def __init__(self, root_pem: bytes, run_id: str, state_dir: Optional[Path], clock: Clock):
        self._verifier = CredentialVerifier(root_pem, run_id, clock=clock)
        self._node = None if state_dir is None else NodeCredentials(state_dir, clock=clock)
        self._own: tuple[bytes, bytes] = (b"", b"")  # this node's chain and its attachment, made once

    def own_attachment(self) -> bytes:
        """What this node's entries carry after their value: its current chain (entry_value.py)."""
        if self._node is None:
            raise CredentialError("missing", "this validator has no node state directory")
        chain = self._node.current()[0]  # a stat; re-read only when renewed
        if chain != self._own[0]:
            self._own = (chain, credential_attachment(chain))
        return self._own[1]

    def identity(self, chain: bytes, *, lasting: bool) -> Identity:
        return self._verifier.verify_issued(chain) if lasting else self._verifier.verify(chain)


@dataclass(frozen=True)
class DHTSecurity:
    """Everything a DHT peer of an admitted node needs, in one picklable value.

    Build it with ``from_state_dir`` (a ``NodeCredentials`` directory holding a valid credential)
    and pass it to ``SwarmDHT.start(security=...)``; ``None`` there is ``--insecure``.
    """

    state_dir: Path
    root_pem: bytes
    run_id: str
    role: str
    peer_id: str
    owner_public_key: str  # the node key, OpenSSH text: the owner of this node's entries
    limits: StorageLimits = field(default_factory=StorageLimits)  # what other peers' stores may hold here

    @classmethod
    def from_state_dir(cls, state_dir: str | Path, *, clock: Clock = time.time,
                       limits: StorageLimits = StorageLimits()) -> DHTSecurity:
        """Read (and check) a node's state directory; ``CredentialError`` if it holds no valid credential."""
        node = NodeCredentials(state_dir, clock=clock)
        if not node.has_credential():
            raise CredentialError("missing", f"no credential in {state_dir}: join through an authorizer first "
                                             "(or mint one with `agora-node authorizer issue`)")
        _, identity = node.current()
        return cls(state_dir=Path(state_dir), root_pem=node.root_pem(), run_id=identity.run_id, role=identity.role,
                   peer_id=node.peer_id, owner_public_key=openssh_public_key(node.key).decode("ascii"), limits=limits)

    @property
    def may_store(self) -> bool:
        """Whether admitted peers accept this node's DHT stores (a monitor is read-only)."""
        return self.role in DHT_WRITER_ROLES

    @property
    def identity_path(self) -> str:
        """hivemind's ``identity_path``: the node key, so the DHT peer id is the credential's."""
        return str(NodeCredentials(self.state_dir, clock=time.time).identity_path)

    def hivemind_options(self) -> dict[str, Any]:
        """Keyword arguments for ``hivemind.DHT``: identity, authorizer and record validators."""
        key = hivemind_private_key(load_or_create_key(self.state_dir))
        return dict(
            identity_path=self.identity_path,
            # hivemind would dial the swarm for this peer id before starting (seconds, tens of them
            # once dead peers linger in routing tables); one daemon per state directory is held by
            # its lock instead (pipeline/files.hold_folder, node/admission.py).
            check_if_identity_free=False,
            authorizer=CredentialTokenAuthorizer(self.state_dir, self.root_pem, self.run_id),
            record_validators=[ReceivedEntries(self.run_id, methods=ROUND_METHODS,
                                               owner_public_key=self.owner_public_key),
                               OwnerSignatureValidator(key),
                               OwnedRecordValidator(self.run_id, self.root_pem, state_dir=self.state_dir,
                                                    limits=self.limits)],
        )
