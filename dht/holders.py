"""Which peers hold a key: the search that finds them, and this DHT process's memory of what it found.

Stores (dht/stores.py) and reads (dht/reads.py) go straight to the peers the last search of a key found
instead of searching for them each time.

Design choices:

- The search looks for the key's *neighbour* id (its lowest bit flipped): no peer holds a value under
  that id, so finds answer with peers alone, never with the key's dictionary (every entry of a stage,
  each with its writer's credential chain), and the peers nearest the neighbour are the peers nearest
  the key (a peer's XOR distance to the two differs only in that bit, so the order of two peers
  changes only if their own ids differ in the lowest bit alone: one chance in 2^159 per pair).
- It keeps ``READ_BEAM`` peers (8, not hivemind's 20), nearest first: a store goes to the first
  ``num_replicas`` (hivemind's 5), a full read asks all of them, as hivemind's read over that beam did.
  A search of 20 visited a third of a 64-peer swarm, waiting on its slowest.
- Why remember. In a 64-peer swarm a search for a key that never changes (a stage's workers) took 2 to
  3 s at the median, where a round key's took 0.44 s (5 round trips), with its holders idle; and most
  requests touch a key this peer touched moments ago: every heartbeat the same stage key, every roster
  refresh the same stage keys, a round's close after its announcement, a lease block's claims.
- When to search again: beside every ``SEARCH_EVERY``-th store of a key or ``READ_SEARCH_EVERY``-th
  read of it, or the first use ``_HOLDERS_TTL_S`` after the last search, never instead of the request
  (it goes to the holders remembered until the search ends): a peer nearer the key that joined is found
  so. Counts, not only time, so the rule is the same at any pace. A request waits on a search only for
  a key never searched (or none of whose holders answers).
- A holder that leaves a request unanswered goes on hivemind's blacklist (``note_answer``: 5 s, doubling
  at each further silence), as its own walk does with a peer that does not answer: requests skip it
  while it is there (``holders_for``) and search beside them for who replaces it, and searches, being
  hivemind's, leave it out. Without that a dead holder was asked again by every request after each
  search, and each time the key was forgotten, the next request walked the DHT.
- The memory is per DHT process and bounded (``_MAX_KEYS``, least recently used out). Everything here
  runs on that process's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

from hivemind.dht.routing import DHTID

from agora.dht.dht_process import READ_BEAM

__all__ = ["HOLDERS", "READ_SEARCH_EVERY", "SEARCH_EVERY", "HolderMemory", "holders_for", "in_background",
           "neighbour_id", "note_answer", "search"]

logger = logging.getLogger(__name__)

# A key's holders are searched for again at every this-many-th store of it (the first included) ...
SEARCH_EVERY = 4
# ... or every this-many-th read: a reader only needs to find a peer that joined nearer the key.
READ_SEARCH_EVERY = 16
_HOLDERS_TTL_S = 300.0
_MAX_KEYS = 1024


def neighbour_id(key_id: DHTID) -> DHTID:
    """The id whose nearest peers are ``key_id``'s and under which nothing is stored."""
    return DHTID(int(key_id) ^ 1)


@dataclasses.dataclass
class _Found:
    holders: dict  # DHTID -> PeerID, nearest first, as the search returned them
    at: float
    stores: int = 0
    reads: int = 0


class HolderMemory:
    """Per key, the holders the last search found and how many stores and reads have used them
    (bounded, least recently used out). Used from one event loop: not thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, search_every: int = SEARCH_EVERY,
                 read_search_every: int = READ_SEARCH_EVERY, ttl_s: float = _HOLDERS_TTL_S,
                 max_keys: int = _MAX_KEYS):
        if search_every < 1 or read_search_every < 1:
            raise ValueError(f"search_every and read_search_every must be >= 1, got {search_every}, "
                             f"{read_search_every}")
        self._clock, self._ttl_s, self._max_keys = clock, ttl_s, max_keys
        self._search_every, self._read_search_every = search_every, read_search_every
        self._found: OrderedDict[DHTID, _Found] = OrderedDict()

    def recall(self, key_id: DHTID, *, reading: bool = False) -> tuple[Optional[dict], bool]:
        """The holders to send a store (or, ``reading``, a read) to now (None: none known, search
        first) and whether to search again beside it. A search due by count or age is started once:
        the holders it replaces serve the requests until it ends (``remember``)."""
        found = self._found.get(key_id)
        if found is None:
            return None, False
        self._found.move_to_end(key_id)
        due = found.reads >= self._read_search_every if reading else found.stores >= self._search_every
        if due or self._clock() - found.at > self._ttl_s:
            found.at, found.stores, found.reads = self._clock(), int(not reading), int(reading)
            return found.holders, True
        if reading:
            found.reads += 1
        else:
            found.stores += 1
        return found.holders, False

    def remember(self, key_id: DHTID, holders: dict, *, reading: bool = False) -> None:
        """A search found ``holders``; the request that searched is their first use."""
        self._found[key_id] = _Found(dict(holders), self._clock(), stores=int(not reading), reads=int(reading))
        self._found.move_to_end(key_id)
        while len(self._found) > self._max_keys:
            self._found.popitem(last=False)

    def forget(self, key_id: DHTID) -> None:
        """What was found is of no use (no other peer, nothing as new as seen): the next request searches."""
        self._found.pop(key_id, None)


HOLDERS = HolderMemory()
_BACKGROUND: set[asyncio.Future] = set()  # sends past the first acceptance, searches beside a request


async def search(node: Any, key_id: DHTID, exclude_self: bool, *, reading: bool = False) -> dict:
    """The key's ``READ_BEAM`` nearest peers, nearest first (remembered for the next requests)."""
    probe = neighbour_id(key_id)
    nearest = await node.find_nearest_nodes([probe], k_nearest=READ_BEAM, beam_size=READ_BEAM,
                                            exclude_self=exclude_self)
    if any(node_id != node.node_id for node_id in nearest[probe]):
        HOLDERS.remember(key_id, nearest[probe], reading=reading)
    else:  # a peer that knows no other yet (it is starting): search again next time
        HOLDERS.forget(key_id)
    return nearest[probe]


def holders_for(node: Any, key_id: DHTID, *, reading: bool = False) -> tuple[Optional[dict], bool]:
    """``HOLDERS.recall`` less the holders hivemind's blacklist holds as silent lately (None: none
    known or none answering, search first), and whether to search beside the request: due, or one
    was left out (then the search finds who replaces it)."""
    holders, search_beside = HOLDERS.recall(key_id, reading=reading)
    if holders is None:
        return None, False
    kept = {node_id: peer_id for node_id, peer_id in holders.items() if peer_id not in node.blacklist}
    return kept or None, search_beside or len(kept) < len(holders)


def note_answer(node: Any, key_id: DHTID, peer_id: Any, answered: bool) -> None:
    """Tell hivemind's blacklist whether ``peer_id`` answered a request for ``key_id``; where the
    blacklist is off (``blacklist_time=0``), a silence makes the key's next request search instead."""
    if answered:
        node.blacklist.register_success(peer_id)
        return
    node.blacklist.register_failure(peer_id)
    if peer_id not in node.blacklist:
        HOLDERS.forget(key_id)


def in_background(work: Any) -> None:
    """Run ``work`` on this loop without waiting for it; its failure is logged, not raised."""
    task = asyncio.ensure_future(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_ended)


def _ended(task: asyncio.Future) -> None:
    _BACKGROUND.discard(task)
    if not task.cancelled() and task.exception() is not None:  # a search beside a request: the next one retries
        logger.debug("background DHT work failed: %r", task.exception())
