"""How this peer stores an entry: finding its key's nearest peers without being sent the key's value,
and not searching again for the peers its last store of that key found.

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
- The search keeps ``READ_BEAM`` peers, as reads do, not hivemind's 20: a store lands where reads
  look, and a search of 20 visited a third of a 64-peer swarm, waiting on its slowest.
- Searches. Most stores write a key this peer wrote moments ago: every heartbeat the same stage
  key, a round's close after its announcement, a lease block's claim, renewals and commit. In a
  64-peer swarm a fixed key's search took 2 to 3 s at the median where a round key's took 0.44 s
  (5 round trips), so ``HolderMemory`` keeps the peers a search found per key and the next stores go
  straight to them. Every ``SEARCH_EVERY``-th store of a key, or one ``_HOLDERS_TTL_S`` after the
  last search, still goes to them and searches again beside it, sending the entry to any holder the
  search finds that was not among them (a peer nearer the key joined): a store waits on a search only
  for a key it never stored or after a holder left a store unanswered (it may have left). Until the
  search ends a reader's search still reaches the holders the store used, among its beam's nearest.
- ``await_all=False``: the store returns at the first holder that accepts and the others are sent
  on in the background (hivemind's ``await_all_replicas=False``), for an entry a reader merges from
  any holder (a heartbeat). A lease's claim waits for every holder: its settle time is measured by
  how long the store took (dht/leases.py).
- Everything else is hivemind's store: the value serialized and signed by the node's record
  validator, sent to the nearest (this peer among them unless ``exclude_self``, its own copy
  validated as a remote one would be), and a store counts if any holder accepts it.
- It runs inside the DHT process through ``run_coroutine`` (module-level, so it pickles by name);
  the holder memory is that process's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

from agora.dht.dht_process import READ_BEAM

__all__ = ["SEARCH_EVERY", "HolderMemory", "neighbour_id", "store_entry"]

logger = logging.getLogger(__name__)

# A key's holders are searched for again at every this-many-th store of it (the first included).
SEARCH_EVERY = 4
_HOLDERS_TTL_S = 300.0
_MAX_KEYS = 1024


def neighbour_id(key_id: DHTID) -> DHTID:
    """The id whose nearest peers are ``key_id``'s and under which nothing is stored."""
    return DHTID(int(key_id) ^ 1)


@dataclasses.dataclass
class _Found:
    holders: dict  # DHTID -> PeerID, as the search returned them
    at: float
    stores: int = 0


class HolderMemory:
    """Per key, the holders the last search found and how many stores have used them (bounded,
    least recently stored out). Used from one event loop: not thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, search_every: int = SEARCH_EVERY,
                 ttl_s: float = _HOLDERS_TTL_S, max_keys: int = _MAX_KEYS):
        if search_every < 1:
            raise ValueError(f"search_every must be >= 1, got {search_every}")
        self._clock, self._search_every, self._ttl_s, self._max_keys = clock, search_every, ttl_s, max_keys
        self._found: OrderedDict[DHTID, _Found] = OrderedDict()

    def recall(self, key_id: DHTID) -> tuple[Optional[dict], bool]:
        """The holders to store to now (None: none known, search first) and whether to search again
        beside this store. A search due by count or age is started once: the holders it replaces
        serve the stores until it ends (``remember``)."""
        found = self._found.get(key_id)
        if found is None:
            return None, False
        self._found.move_to_end(key_id)
        if found.stores >= self._search_every or self._clock() - found.at > self._ttl_s:
            found.stores, found.at = 1, self._clock()
            return found.holders, True
        found.stores += 1
        return found.holders, False

    def remember(self, key_id: DHTID, holders: dict) -> None:
        """A search found ``holders``; its own store is their first use."""
        self._found[key_id] = _Found(dict(holders), self._clock(), stores=1)
        self._found.move_to_end(key_id)
        while len(self._found) > self._max_keys:
            self._found.popitem(last=False)

    def forget(self, key_id: DHTID) -> None:
        """A holder left a store unanswered: the next store searches."""
        self._found.pop(key_id, None)


_MEMORY = HolderMemory()
_BACKGROUND: set[asyncio.Future] = set()  # sends past the first acceptance, searches beside a store


async def store_entry(_dht: hivemind.DHT, node: Any, *, key: Any, subkey: Optional[Any], value: Any,
                      expiration: float, exclude_self: bool, await_all: bool = True) -> bool:
    """Store ``value`` under ``key`` (and ``subkey``) on the key's nearest peers; True if any accepted."""
    key_id = DHTID.generate(source=key)
    record = _signed(node, key_id, subkey, value, expiration)
    holders, search_beside = _MEMORY.recall(key_id)
    if holders is None:
        holders = await _search(node, key_id, exclude_self)
    elif search_beside:
        _in_background(_search_and_send(node, key_id, exclude_self, subkey, record, known=set(holders)))
    sends = [asyncio.ensure_future(_store_on(node, node_id, peer_id, key_id, subkey, record))
             for node_id, peer_id in holders.items()]
    if await_all:
        return any(answer is True for answer in await asyncio.gather(*sends))
    pending = set(sends)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if any(send.result() is True for send in done):
            for send in pending:
                _in_background(send)
            return True
    return False


async def _search(node: Any, key_id: DHTID, exclude_self: bool) -> dict:
    """The key's nearest peers (remembered for the next stores)."""
    probe = neighbour_id(key_id)
    nearest = await node.find_nearest_nodes([probe], k_nearest=node.num_replicas, beam_size=READ_BEAM,
                                            exclude_self=exclude_self)
    _MEMORY.remember(key_id, nearest[probe])
    return nearest[probe]


async def _search_and_send(node: Any, key_id: DHTID, exclude_self: bool, subkey: Optional[Any],
                           record: DHTRecord, known: set) -> None:
    """Search again beside a store sent to the remembered holders, and send it to any new one."""
    holders = await _search(node, key_id, exclude_self)
    await asyncio.gather(*(_store_on(node, node_id, peer_id, key_id, subkey, record)
                           for node_id, peer_id in holders.items() if node_id not in known))


def _in_background(work: Any) -> None:
    task = asyncio.ensure_future(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_ended)


def _ended(task: asyncio.Future) -> None:
    _BACKGROUND.discard(task)
    if not task.cancelled() and task.exception() is not None:  # a search beside a store: the next one retries
        logger.debug("a store's background search failed: %r", task.exception())


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
    if not answer:
        _MEMORY.forget(key_id)  # the holder may have left: the next store searches
        return None
    return bool(answer[0])


def _store_here(node: Any, key_id: DHTID, subkey: Optional[Any], record: DHTRecord) -> bool:
    protocol = node.protocol
    if protocol.record_validator is not None and not protocol.record_validator.validate(record):
        return False
    return bool(protocol.storage.store(key_id, record.value, record.expiration_time, subkey=subkey))
