"""How this peer stores an entry: finding its key's nearest peers without being sent the key's value.

Design choices:

- Bytes. hivemind's store first searches for the key's ``num_replicas`` nearest peers with the same
  find requests a read sends, and a peer that holds the key answers a find with its whole value: for
  a key with subkeys (a stage's workers, its round board) every entry, each with its writer's
  credential chain. A store of one 2.7 KB worker entry so received 4.5-6.5 dictionaries, as many
  bytes as the reads, growing like the stage. Here the search looks for the key's *neighbour* id
  (its lowest bit flipped): no peer holds a value under that id, so finds answer with peers alone,
  and the peers nearest the neighbour are the peers nearest the key (a peer's XOR distance to the two
  differs only in that bit, so the order of two peers changes only if their own ids differ in the
  lowest bit alone: one chance in 2^159 per pair).
- Everything else is hivemind's store: the value serialized and signed by the node's record
  validator, sent to the ``num_replicas`` nearest nearest-first (this peer among them unless
  ``exclude_self``, its own copy validated as a remote one would be), and a store counts if any
  holder accepts it.
- It runs inside the DHT process through ``run_coroutine`` (module-level, so it pickles by name).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Optional

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

__all__ = ["neighbour_id", "store_entry"]


def neighbour_id(key_id: DHTID) -> DHTID:
    """The id whose nearest peers are ``key_id``'s and under which nothing is stored."""
    return DHTID(int(key_id) ^ 1)


async def store_entry(_dht: hivemind.DHT, node: Any, *, key: Any, subkey: Optional[Any], value: Any,
                      expiration: float, exclude_self: bool) -> bool:
    """Store ``value`` under ``key`` (and ``subkey``) on the key's nearest peers; True if any accepted."""
    key_id = DHTID.generate(source=key)
    probe = neighbour_id(key_id)
    nearest = await node.find_nearest_nodes([probe], k_nearest=node.num_replicas, exclude_self=exclude_self)
    record = _signed(node, key_id, subkey, value, expiration)
    stores = [_store_on(node, node_id, peer_id, key_id, subkey, record)
              for node_id, peer_id in nearest[probe].items()]
    return any(await asyncio.gather(*stores))


def _signed(node: Any, key_id: DHTID, subkey: Optional[Any], value: Any, expiration: float) -> DHTRecord:
    """The record as sent: its value serialized and, under a record validator, signed."""
    serializer = node.protocol.serializer
    record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), serializer.dumps(value), expiration)
    validator = node.protocol.record_validator
    return record if validator is None else dataclasses.replace(record, value=validator.sign_value(record))


async def _store_on(node: Any, node_id: DHTID, peer_id: Any, key_id: DHTID, subkey: Optional[Any],
                    record: DHTRecord) -> bool:
    if node_id == node.node_id:
        return _store_here(node, key_id, subkey, record)
    answer = await node.protocol.call_store(peer_id, keys=[key_id], values=[record.value],
                                            expiration_time=[record.expiration_time], subkeys=[subkey])
    return bool(answer and answer[0])


def _store_here(node: Any, key_id: DHTID, subkey: Optional[Any], record: DHTRecord) -> bool:
    protocol = node.protocol
    if protocol.record_validator is not None and not protocol.record_validator.validate(record):
        return False
    return bool(protocol.storage.store(key_id, record.value, record.expiration_time, subkey=subkey))
