"""Which credential chain a DHT token may name instead of carrying: pure state and decisions.

A chain (leaf + issuing CA, PEM) is about 2.7 KB; every DHT request and response carries a token,
so a token that carries it costs more than most of the messages it rides on. Between two peers
that both hold each other's chain a token names it: ``sha256:<hex of the chain's bytes>``.

- ``ChainCache``: the chains this process verified together with the key they certify, by
  digest; a reference resolves only against it (bounded, least recently used out).
- ``PeerChains``: per peer, which of our chains it last said it holds (the *tag*, the first
  ``TAG_BYTES`` of that chain's digest, which every token carries about its counterparty) and
  whether the last request to it went unanswered. ``may_refer`` is the one decision: name our
  chain to a peer only when its last word is that it holds our current chain. A peer that
  restarted has an empty cache and says so in its next token; one that never speaks refuses our
  reference, and a request ended without a valid response makes the next one carry the chain
  (``unanswered``), so a restarted peer is served again after one failed request.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

__all__ = ["REFERENCE_PREFIX", "TAG_BYTES", "ChainCache", "PeerChains", "chain_digest", "holds", "reference_digest",
           "reference_of"]

REFERENCE_PREFIX = "sha256:"
TAG_BYTES = 8  # enough to tell a peer's current chain from its previous ones; a wrong tag costs one refusal
_REFERENCE = re.compile(r"sha256:([0-9a-f]{64})")
_MAX_CHAINS = 1024
_MAX_PEERS = 4096


def chain_digest(chain: bytes) -> bytes:
    return hashlib.sha256(chain).digest()


def holds(tag: bytes, digest: bytes) -> bool:
    """Whether a token's ``tag`` says its sender holds the chain of ``digest`` (no tag: holds none)."""
    return len(tag) == TAG_BYTES and tag == digest[:TAG_BYTES]


def reference_of(digest: bytes) -> str:
    """The token ``username`` that names the chain of ``digest``."""
    return REFERENCE_PREFIX + digest.hex()


def reference_digest(username: str) -> Optional[bytes]:
    """The digest a token's ``username`` names, or None if it is not a reference (a full chain)."""
    match = _REFERENCE.fullmatch(username)
    return None if match is None else bytes.fromhex(match.group(1))


class ChainCache:
    """Chains verified with the key they certify, by digest (at most ``capacity``)."""

    def __init__(self, capacity: int = _MAX_CHAINS):
        self.capacity = capacity
        self._chains: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()

    def add(self, chain: bytes, public_key: bytes) -> bytes:
        """Remember ``chain`` (verified, certifying ``public_key``: the token's bytes); its digest."""
        digest = chain_digest(chain)
        self._chains[digest] = (chain, public_key)
        self._chains.move_to_end(digest)
        while len(self._chains) > self.capacity:
            self._chains.popitem(last=False)
        return digest

    def get(self, digest: bytes) -> Optional[tuple[bytes, bytes]]:
        """(chain, public key) of a held digest, or None."""
        found = self._chains.get(digest)
        if found is not None:
            self._chains.move_to_end(digest)
        return found

    def tag_of(self, digest: Optional[bytes]) -> bytes:
        """What a token says about the counterparty chain of ``digest``: its tag if held, else b""."""
        return digest[:TAG_BYTES] if digest is not None and digest in self._chains else b""


@dataclass
class _Peer:
    holds_ours: bytes = b""  # the tag of our chain it last said it holds
    theirs: Optional[bytes] = None  # the digest of its chain we last verified


class PeerChains:
    """What each peer holds of ours and we of theirs (at most ``capacity`` peers, least recent out)."""

    def __init__(self, capacity: int = _MAX_PEERS):
        self.capacity = capacity
        self._peers: OrderedDict[str, _Peer] = OrderedDict()

    def heard(self, peer_id: str, *, holds_ours: bytes, theirs: bytes) -> None:
        """A valid token from ``peer_id``: its chain's digest, and the tag it says it holds of ours."""
        peer = self._peers.pop(peer_id, None) or _Peer()
        peer.holds_ours, peer.theirs = holds_ours, theirs
        self._peers[peer_id] = peer
        while len(self._peers) > self.capacity:
            self._peers.popitem(last=False)

    def unanswered(self, peer_id: str) -> None:
        """A request to ``peer_id`` ended without a valid response: perhaps it lost our chain (a
        restart, an eviction), so the next request carries it, and its response says again."""
        peer = self._peers.get(peer_id)
        if peer is not None:
            peer.holds_ours = b""

    def may_refer(self, peer_id: Optional[str], own_digest: bytes) -> bool:
        """Whether a request to ``peer_id`` (None: unknown) may name our chain of ``own_digest``."""
        peer = None if peer_id is None else self._peers.get(peer_id)
        return peer is not None and holds(peer.holds_ours, own_digest)

    def theirs(self, peer_id: Optional[str]) -> Optional[bytes]:
        """The digest of ``peer_id``'s chain we last verified, if any."""
        peer = None if peer_id is None else self._peers.get(peer_id)
        return None if peer is None else peer.theirs
