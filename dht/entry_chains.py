"""A changed find's answer names the writer's credential chain of an entry its asker already holds,
instead of carrying it again.

A typed entry carries its writer's chain (dht/entry_value.py): about 1.9 KB of its 3 KB. A stage's
reader reads each worker entry again every heartbeat (each beat rewrites it), so with R replicas a
stage it received R chains a beat that it held already, and R grows with the swarm: the largest
part of what grew in a node's DHT bytes (bench/results/dht_scale.md). Design choices:

- The asker says, per entry it holds (the changed find's `seen_chains`, beside its subkey digest),
  the tag of the chain that copy came with (the first `TAG_BYTES` of the SHA-256 of the chain's
  bytes as attached). The holder answers an entry whose chain has that tag with the tag in place of
  the chain (`named`): the record, the tag, `REFERENCE_MARK`, the signature. A new writer, or one
  whose credential was renewed since, comes with its whole chain.
- The asker puts the chain back before anything judges the entry (`HeldChains.restore`), byte for
  byte, so the owner's signature, which covers the chain, and the chain's own checks run on the
  entry as its writer stored it. A holder cannot slip in another chain: any other bytes fail the
  signature and the answer is refused, like any bad entry. A tag the asker cannot resolve (its
  bounded memory let the chain go meanwhile) refuses the answer; the read asks again naming no
  chains (dht/changed_finds.py).
- Only a changed find's answer is rewritten, only for the asker that named the tag. Stores and
  hivemind's finds carry whole chains as before, so nothing with a name in it is ever stored or
  forwarded: holders store what writers sent, askers restore before use.
- The entries an asker held and no longer holds (they expired from its memory between two reads of
  the key, as a stage's entries do between the rebalancer's reads every 30 s) still name the chain
  they came with: such a digest is sent as held since time 0, which any entry of it is newer than,
  so the holder answers it as it would an entry never seen, its chain named.
- Memory (the asker's DHT process): `max_chains` chains by tag (a few hundred writers' 2 KB each),
  per key the last `max_entries_per_key` entries' tags, `max_keys` keys; least recently used out.
  Forgetting costs one answer with whole chains, never a wrong one.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Optional

from agora.dht.entry_value import OwnerSignatureValidator, attached_credential_at

__all__ = ["REFERENCE_MARK", "TAG_BYTES", "EntryParts", "HeldChains", "chain_tag", "entry_parts", "named",
           "restore_all", "tag_to_name"]

REFERENCE_MARK = b"agora-chain-ref-1"  # ends an unsigned value whose chain is named (the format's version)
TAG_BYTES = 8  # a wrong match costs one refused answer, and needs a collision among one key's writers


def chain_tag(attachment: bytes) -> bytes:
    return hashlib.sha256(attachment).digest()[:TAG_BYTES]


@dataclass(frozen=True)
class EntryParts:
    """A signed typed entry's value: its record, its writer's chain as attached, the owner's signature."""

    record: bytes
    attachment: bytes
    signature: bytes

    @property
    def tag(self) -> bytes:
        return chain_tag(self.attachment)


def _unsigned_and_signature(value: bytes) -> Optional[tuple[bytes, bytes]]:
    unsigned = OwnerSignatureValidator.unsigned(value)
    if len(unsigned) == len(value) or not value.startswith(unsigned):
        return None  # unsigned, or a signature that is not the value's end
    return unsigned, value[len(unsigned):]


def entry_parts(value: bytes) -> Optional[EntryParts]:
    """The parts of ``value``, or None if it is not a signed entry with a chain attached."""
    split = _unsigned_and_signature(value)
    if split is None:
        return None
    unsigned, signature = split
    at = attached_credential_at(unsigned)
    return None if at < 0 else EntryParts(unsigned[:at], unsigned[at:], signature)


def named(parts: EntryParts) -> bytes:
    """The entry with its chain named by tag (what a holder answers an asker that holds it)."""
    return parts.record + parts.tag + REFERENCE_MARK + parts.signature


def tag_to_name(value: bytes, asker_tag: bytes) -> Optional[bytes]:
    """``value`` with its chain named, if the asker's tag is that chain's; else None (sent whole)."""
    if len(asker_tag) != TAG_BYTES:
        return None
    parts = entry_parts(value)
    return named(parts) if parts is not None and parts.tag == asker_tag else None


class HeldChains:
    """The asker's side: chains of the entries it read, by tag, and per key the tag of each entry it
    read there (while its chain is held: an entry that expired from the reader's memory still names
    its writer's chain, so a reader that comes back to a key after its entries expired, as the
    rebalancer does every 30 s, is answered without the chains it holds).

    Thread-safe: a DHT process answers reads on its event loop and the validators may run elsewhere.
    """

    def __init__(self, max_chains: int = 1024, max_keys: int = 512, max_entries_per_key: int = 512):
        self._max_chains, self._max_keys, self._max_per_key = max_chains, max_keys, max_entries_per_key
        self._chains: OrderedDict[bytes, bytes] = OrderedDict()
        self._tags: OrderedDict[bytes, OrderedDict[bytes, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, key: bytes, subkey_digest: bytes, value: bytes) -> None:
        """Remember the chain ``value`` (an entry judged valid) came with, as this entry's."""
        parts = entry_parts(value)
        if parts is None:
            return
        tag = parts.tag
        with self._lock:
            self._chains[tag] = parts.attachment
            self._chains.move_to_end(tag)
            while len(self._chains) > self._max_chains:
                self._chains.popitem(last=False)
            entries = self._tags.pop(key, None) or OrderedDict()
            self._tags[key] = entries  # re-inserted: the order is the keys' recency
            entries[subkey_digest] = tag
            entries.move_to_end(subkey_digest)
            while len(entries) > self._max_per_key:
                entries.popitem(last=False)
            while len(self._tags) > self._max_keys:
                self._tags.popitem(last=False)

    def tags(self, key: bytes) -> dict[bytes, bytes]:
        """{subkey digest: tag of the chain held for it} under ``key``, chains still held only."""
        with self._lock:
            return {digest: tag for digest, tag in self._tags.get(key, {}).items() if tag in self._chains}

    def restore(self, value: bytes) -> Optional[bytes]:
        """``value`` with a named chain put back; ``value`` itself if it names none; None if the tag
        is not held (the answer cannot be judged)."""
        split = _unsigned_and_signature(value)
        if split is None or not split[0].endswith(REFERENCE_MARK):
            return value
        unsigned, signature = split
        end = len(unsigned) - len(REFERENCE_MARK)
        if end < TAG_BYTES:
            return None
        tag = unsigned[end - TAG_BYTES:end]
        with self._lock:
            attachment = self._chains.get(tag)
            if attachment is not None:
                self._chains.move_to_end(tag)
        return None if attachment is None else unsigned[:end - TAG_BYTES] + attachment + signature

    def __len__(self) -> int:
        with self._lock:
            return len(self._chains)

def restore_all(held: HeldChains, entries: Mapping[object, tuple[bytes, float]]) -> Optional[dict]:
    """{subkey: (restored value, expiration)}, or None if one entry names a chain ``held`` lacks."""
    restored = {}
    for subkey, (value, expiration) in entries.items():
        full = held.restore(value)
        if full is None:
            return None
        restored[subkey] = (full, expiration)
    return restored
