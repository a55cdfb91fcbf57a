"""Which per-peer entries a peer believes: the owner of a subkey, and the run a worker is of.

One rule, applied in two places: by the record validator in hivemind's DHT process
(dht/security.py, on every store a peer accepts and every value a find returns) and by
``SwarmDHT``'s readers (which skip and count). An entry under ``<peer id>[owner:<key>]`` is
believed only if

- the record names that peer id (nobody files a record under another peer's subkey),
- the owner key is the key that peer id is derived from (``auth.keys.peer_id_of``): a peer
  can only own entries of its own id, since it can only sign with its own key,
- and, where admission is on, the marker is there at all (an entry without it is unsigned).

The signature itself is hivemind's ``RSASignatureValidator``'s business; readers get values
that passed it. A worker record's run fingerprint is compared with the reader's, naming the
first differing field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from agora.auth.keys import peer_id_of
from agora.dht.keys import split_subkey
from agora.dht.record_fields import RecordError

if TYPE_CHECKING:
    from agora.pipeline.fingerprint import RunFingerprint

__all__ = ["EntryOwnership", "fingerprint_mismatch"]

# Owner keys remembered with their peer id; a bound so that a flood of keys costs no memory.
_MAX_OWNERS = 4096


class EntryOwnership:
    """Checks a subkey against its record; ``require_owner`` refuses unsigned (bare) subkeys."""

    def __init__(self, *, require_owner: bool):
        self.require_owner = require_owner
        self._owners: dict[str, Optional[str]] = {}  # owner key text -> its peer id (None: not an RSA key)

    def __getstate__(self) -> dict:
        return {"require_owner": self.require_owner, "_owners": {}}

    def problem(self, subkey: object, record_peer_id: Optional[str]) -> Optional[str]:
        """Why the entry at ``subkey`` is not to be believed, or None. ``record_peer_id`` is the
        peer id its record names (None for a tombstone, which names nobody)."""
        try:
            peer_id, owner = split_subkey(subkey)
        except RecordError as error:
            return str(error)
        if record_peer_id is not None and record_peer_id != peer_id:
            return f"subkey is not the record's peer_id {record_peer_id!r:.60}"
        if owner is None:
            return "unsigned entry: its subkey names no owner" if self.require_owner else None
        if self.owner_peer_id(owner) != peer_id:
            return "the owner key is not the key of the subkey's peer id"
        return None

    def owner_peer_id(self, owner: str) -> Optional[str]:
        """The peer id of an owner key as a subkey writes it (OpenSSH text), None if it is no RSA key."""
        if owner not in self._owners:
            try:
                key = serialization.load_ssh_public_key(owner.encode("ascii"))
                peer_id = peer_id_of(key) if isinstance(key, rsa.RSAPublicKey) else None
            except (ValueError, UnicodeEncodeError, UnsupportedAlgorithm):
                peer_id = None
            if len(self._owners) >= _MAX_OWNERS:
                self._owners.clear()
            self._owners[owner] = peer_id
        return self._owners[owner]


def fingerprint_mismatch(ours: RunFingerprint, theirs: str) -> Optional[str]:
    """Why a worker announcing fingerprint text ``theirs`` is not of this run, or None if it is."""
    from agora.pipeline.fingerprint import RunFingerprint  # torch: only readers that compare pay for it

    try:
        mismatch = ours.mismatch(RunFingerprint.parse(theirs))
    except ValueError as error:
        return str(error)
    return None if mismatch is None else str(mismatch)
