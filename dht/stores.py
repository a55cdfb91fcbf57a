"""How this peer stores an entry: on the holders its last search of the key found (dht/holders.py),
without being sent the key's value.

Design choices:

- Bytes. hivemind's store first searches for the key's ``num_replicas`` nearest peers with the same
  find requests a read sends, and a peer that holds the key answers a find with its whole value: for
  a key with subkeys (a stage's workers, its round board) every entry, each with its writer's
  credential chain. A store of one 2.7 KB worker entry so received 4.5-6.5 dictionaries, as many
  bytes as the reads, growing like the stage. Our search (dht/holders.py) is answered with peers alone.
- Searches. Most stores write a key this peer wrote moments ago (heartbeats, a round's close after its
  announcement, a lease block's claims, renewals and commit), so a store goes to the first
  ``num_replicas`` holders the key's last search found; every ``SEARCH_EVERY``-th store still searches
  again, beside it, and sends the entry to any holder the search finds that was not among them (a peer
  nearer the key joined). Until the search ends a reader's search still reaches the holders the store
  used, among its beam's nearest. In a 64-peer swarm this took store p50 / p95 from 0.55 / 4.0 s to
  0.10 / 0.43 s.
- ``await_all=False``: the store returns at the first holder that accepts and the others are sent
  on in the background (hivemind's ``await_all_replicas=False``), for an entry a reader merges from
  any holder (a heartbeat). A lease's claim waits for every holder: its settle time is measured by
  how long the store took (dht/leases.py).
- Everything else is hivemind's store: the value serialized and signed by the node's record
  validator, sent to the nearest (this peer among them unless ``exclude_self``, its own copy
  validated as a remote one would be), and a store counts if any holder accepts it.
- It runs inside the DHT process through ``run_coroutine`` (module-level, so it pickles by name).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Optional

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

from agora.dht.holders import holders_for, in_background, note_answer, search

__all__ = ["store_entry"]


async def store_entry(_dht: hivemind.DHT, node: Any, *, key: Any, subkey: Optional[Any], value: Any,
                      expiration: float, exclude_self: bool, await_all: bool = True) -> bool:
    """Store ``value`` under ``key`` (and ``subkey``) on the key's nearest peers; True if any accepted."""
    key_id = DHTID.generate(source=key)
    record = _signed(node, key_id, subkey, value, expiration)
    holders, search_beside = holders_for(node, key_id)  # a holder silent lately: its successor takes its turn
    if holders is None:
        holders = await search(node, key_id, exclude_self)
    elif search_beside:
        in_background(_search_and_send(node, key_id, exclude_self, subkey, record, known=_replicas(node, holders)))
    sends = [asyncio.ensure_future(_store_on(node, node_id, peer_id, key_id, subkey, record))
             for node_id, peer_id in _replicas(node, holders).items()]
    if await_all:
        return any(answer is True for answer in await asyncio.gather(*sends))
    pending = set(sends)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if any(send.result() is True for send in done):
            for send in pending:
                in_background(send)
            return True
    return False


def _replicas(node: Any, holders: dict) -> dict:
    """The nearest ``num_replicas`` of a search's peers (nearest first): where hivemind stores."""
    return dict(list(holders.items())[:node.num_replicas])


async def _search_and_send(node: Any, key_id: DHTID, exclude_self: bool, subkey: Optional[Any],
                           record: DHTRecord, known: dict) -> None:
    """Search again beside a store sent to the remembered holders, and send it to any new one."""
    holders = _replicas(node, await search(node, key_id, exclude_self))
    await asyncio.gather(*(_store_on(node, node_id, peer_id, key_id, subkey, record)
                           for node_id, peer_id in holders.items() if node_id not in known))


def _signed(node: Any, key_id: DHTID, subkey: Optional[Any], value: Any, expiration: float) -> DHTRecord:
    """The record as sent: its value serialized and, under a record validator, signed."""
    serializer = node.protocol.serializer
    record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), serializer.dumps(value), expiration)
    validator = node.protocol.record_validator
    return record if validator is None else dataclasses.replace(record, value=validator.sign_value(record))


async def _store_on(node: Any, node_id: DHTID, peer_id: Any, key_id: DHTID, subkey: Optional[Any],
                    record: DHTRecord) -> Optional[bool]:
    """Whether the holder accepted the record; None if it did not answer."""
    if node_id == node.node_id:
        return _store_here(node, key_id, subkey, record)
    answer = await node.protocol.call_store(peer_id, keys=[key_id], values=[record.value],
                                            expiration_time=[record.expiration_time], subkeys=[subkey])
    note_answer(node, key_id, peer_id, bool(answer))
    return bool(answer[0]) if answer else None


def _store_here(node: Any, key_id: DHTID, subkey: Optional[Any], record: DHTRecord) -> bool:
    protocol = node.protocol
    if protocol.record_validator is not None and not protocol.record_validator.validate(record):
        return False
    return bool(protocol.storage.store(key_id, record.value, record.expiration_time, subkey=subkey))
