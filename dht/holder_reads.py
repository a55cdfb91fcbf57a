"""How this peer's DHT process reads a key: straight from the peers its last search of the key found.

Design choices:

- hivemind's read walks the DHT towards the key at every read, and at 64 peers that was 4 to 7 round
  trips where the holders were one away. So a read goes straight to the peers the key's last search
  found (dht/holders.py, the same memory stores use; a search again beside every
  ``READ_SEARCH_EVERY``-th read): a full read asks all ``READ_BEAM`` of them at once and merges every
  answer (one round trip, the peers hivemind's latest read over that beam would have merged); a quick
  read asks the key's ``num_replicas`` holders one at a time from a random one (readers spread over
  them, not all on the nearest) and stops at the first as new as ``bar``, then the beam's others. This
  peer's own storage is asked first, as hivemind does. A key with no holder known (never searched,
  forgotten, or every holder silent lately) is searched first and then read from the holders found:
  hivemind's walk, which a read used to fall back to, brings every visited peer's whole dictionary
  (at 64 peers a quarter of a node's request bytes, most of them a stage's worker records), where a
  search brings peers only. A holder that does not answer is skipped while hivemind's blacklist
  holds it, the reads meanwhile searching beside them (dht/holders.py ``note_answer``); a quick read
  that no holder could end or a full one that found nothing makes the next read search (the search
  may have been made while this peer knew few others); a read no holder answered, or with no holder
  but this peer found, is hivemind's walk.
- Slow holders. At 64 peers some holders of the keys every peer reads (the ban list, a stage's
  workers) took seconds to answer, idle as far as their CPU showed, and a full read waiting for all
  8 waited for the slowest (the ban list's p95 3.6 s). So a full read returns ``FULL_READ_GRACE_S``
  after ``num_replicas`` (5) of its 8 have answered, if the rest have not: any 5 of the 8 include at
  least 2 of the 5 a store went to, so an entry a store put on every holder is never missed; one
  that reached fewer may be missed by a read and is found by a later one, as a quick read's misses
  are. A read that must not miss even that (a lease's claim: ``wait_all``) waits for every holder.
  A quick read asks the next holder too when the one it asked has not answered within ``HEDGE_S``.
- A full read's copies. With what the reader holds named (dht/changed_finds.py), one holder (the
  first a quick read would ask) sends the changes and the others their digests alone; an entry a
  digest shows the first lacked is then fetched from a holder that has it (one more round trip, only
  then). A lease claim's read (``wait_all``) asks every holder for the entries, as before.
- Which read is full and which quick, and what the owner remembers of the answers: dht/reads.py.
- It runs inside the DHT process through ``run_coroutine`` (module-level, so it pickles by name).
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any, Callable, Optional

from hivemind.dht.node import _SearchState
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils.timed_storage import ValueWithExpiration

from agora.dht.changed_finds import Seen, subkey_digest
from agora.dht.dht_process import READ_BEAM
from agora.dht.holders import HOLDERS, holders_for, in_background, note_answer, search

__all__ = ["FULL_READ_GRACE_S", "HEDGE_S", "read_entry"]

logger = logging.getLogger(__name__)

# A full read stops waiting this long after the first ``num_replicas`` holders answered.
FULL_READ_GRACE_S = 0.25
# A quick read asks the next holder too when the one it asked has not answered in this long.
HEDGE_S = 0.5


async def read_entry(_dht: Any, node: Any, *, key: Any, bar: Optional[float], exclude_self: bool,
                     wait_all: bool = False, held: Optional[Seen] = None) -> Optional[ValueWithExpiration[Any]]:
    """The value under ``key`` as hivemind's read returns it: a full read (``bar`` None: the holders'
    answers merged; ``wait_all``: every holder's, however slow) or a quick one (the first holder
    whose value expires no earlier than ``bar``). With ``held`` (what the reader holds there), the
    holders answer with the entries not in it (dht/changed_finds.py), and so does this.

    What the read says of the holders it asked: a quick read that none of them could end (none as
    new as what this peer saw) makes the next read search for them again. So does a full read that
    found nothing at fewer holders than a store's replica count: a search made while this peer knew
    few others. A full read that found nothing at as many is believed, the key is empty: a round
    board between rounds, searched again at every probe, was a third of an averaging replica's DHT
    requests. Holders that missed peers who joined nearer the key since are found by the searches
    due by count and age (dht/holders.py)."""
    key_id = DHTID.generate(source=key)
    holders, search_beside = holders_for(node, key_id, reading=True)
    if holders is None:
        holders = await _search_first(node, key_id, exclude_self)
    elif search_beside:
        in_background(search(node, key_id, exclude_self, reading=True))
    others = [peer_id for node_id, peer_id in holders.items() if node_id != node.node_id]
    if not others:
        return await _walk(node, key, bar)
    state = _SearchState(key_id, float("inf") if bar is None else bar, serializer=node.protocol.serializer,
                         record_validator=node.protocol.record_validator)
    state.add_candidate(_own_copy(node, key_id), source_node_id=node.node_id)
    digests = getattr(node.protocol, "call_find_changed_digests", None)
    if bar is None and held is not None and digests is not None and not wait_all and len(others) > 1:
        order = _quick_order(others, node.num_replicas)
        answers = await _ask_one_and_digests(node, key_id, order, state, min(len(others), node.num_replicas), held)
    elif bar is None:
        quorum = len(others) if wait_all else min(len(others), node.num_replicas)
        answers = await _ask_all(node, key_id, others, state, quorum, held)
    else:
        answers = await _ask_in_turn(node, key_id, _quick_order(others, node.num_replicas), state, held)
    if answers and all(answer is _UNANSWERED for answer in answers):
        state.future.cancel()
        return await _walk(node, key, bar)
    if not state.finished and (bar is not None or (not state.found_something and len(others) < node.num_replicas)):
        HOLDERS.forget(key_id)  # none of them is as new as what this peer saw, or few had nothing: search again
    state.finish_search()
    return state.future.result()


async def _search_first(node: Any, key_id: DHTID, exclude_self: bool) -> dict:
    """The key's holders, searched for now (the module docstring); none if the search failed."""
    try:
        return await search(node, key_id, exclude_self, reading=True)
    except Exception as error:  # noqa: BLE001 - the read goes on as hivemind's walk
        logger.debug("searching for %s's holders failed: %r", key_id, error)
        return {}


async def _ask_all(node: Any, key_id: DHTID, peers: list, state: _SearchState, quorum: int,
                   held: Optional[Seen]) -> list:
    """Every peer at once, their answers merged into ``state`` (``_answers``' wait)."""
    tasks = {asyncio.ensure_future(_find_on(node, peer_id, key_id, held)) for peer_id in peers}
    return await _answers(tasks, quorum,
                          lambda _task, answer: state.add_candidate(_value(answer), source_node_id=None))


async def _ask_one_and_digests(node: Any, key_id: DHTID, peers: list, state: _SearchState, quorum: int,
                               held: Seen) -> list:
    """A full read's holders, the changes taken from one: ``peers[0]`` is asked for the entries
    ``held`` lacks, the others for their digests (``_answers``' wait); then each holder whose digests
    name an entry newer than what the read has is asked for the entries, one at a time, until none
    is left (or none of them answers). The entries one holder has and the first lacks still come."""
    first = asyncio.ensure_future(_find_on(node, peers[0], key_id, held))
    named = {asyncio.ensure_future(_digests_on(node, peer_id, key_id, held)): peer_id for peer_id in peers[1:]}
    digests: dict[Any, dict[bytes, float]] = {}

    def take(task: asyncio.Future, answer: Any) -> None:
        if task is first:
            state.add_candidate(_value(answer), source_node_id=None)
        elif answer is not _UNANSWERED:
            digests[named[task]] = answer

    answers = await _answers({first, *named}, quorum, take)
    known = dict(held)
    _learn(known, _value(first.result()) if first.done() else None)
    while lacking := [peer_id for peer_id, named_there in digests.items()
                      if any(expiration > known.get(digest, float("-inf")) for digest, expiration in named_there.items())]:
        peer_id = lacking[0]
        del digests[peer_id]
        answer = await _find_on(node, peer_id, key_id, known)
        answers.append(answer)
        state.add_candidate(_value(answer), source_node_id=None)
        _learn(known, _value(answer))
    return answers


def _learn(known: dict, found: Optional[ValueWithExpiration[Any]]) -> None:
    """Add what a changed find returned to ``known`` (digest -> expiration), as its next request names it."""
    if found is not None and isinstance(found.value, DictionaryDHTValue):
        for subkey, item in found.value.items():
            digest = subkey_digest(subkey)
            known[digest] = max(known.get(digest, float("-inf")), item.expiration_time)


async def _answers(tasks: set, quorum: int, take: Callable[[asyncio.Future, Any], None]) -> list:
    """Each task's answer, handed to ``take`` as it comes: until all have answered, or
    ``FULL_READ_GRACE_S`` after ``quorum`` of them did (the others go on in the background)."""
    loop = asyncio.get_running_loop()
    pending = set(tasks)
    answers: list = []
    quorum_at = None
    while pending:
        timeout = None if quorum_at is None else max(0.0, quorum_at + FULL_READ_GRACE_S - loop.time())
        done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            break
        for task in done:
            answers.append(task.result())
            take(task, answers[-1])
        if quorum_at is None and sum(answer is not _UNANSWERED for answer in answers) >= quorum:
            quorum_at = loop.time()
    for task in pending:
        in_background(task)
    return answers


async def _ask_in_turn(node: Any, key_id: DHTID, peers: list, state: _SearchState, held: Optional[Seen]) -> list:
    """One peer at a time until ``state`` has a value as new as its bar: the next is asked when the
    last one answered with less, or had not answered within ``HEDGE_S``."""
    answers: list = []
    waiting: set = set()
    queue = list(peers)
    while not state.finished and (queue or waiting):
        if queue:
            waiting.add(asyncio.ensure_future(_find_on(node, queue.pop(0), key_id, held)))
        done, waiting = await asyncio.wait(waiting, timeout=HEDGE_S if queue else None,
                                           return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            answers.append(task.result())
            state.add_candidate(_value(answers[-1]), source_node_id=None)
    for task in waiting:
        in_background(task)
    return answers


_UNANSWERED = object()


async def _find_on(node: Any, peer_id: Any, key_id: DHTID, held: Optional[Seen]) -> Any:
    """What ``peer_id`` holds under ``key_id`` (None: nothing) that ``held`` lacks, or ``_UNANSWERED``."""
    changed = getattr(node.protocol, "call_find_changed", None)
    if held is not None and changed is not None:
        answer = await changed(peer_id, key_id, held)
    else:
        answer = await node.protocol.call_find(peer_id, [key_id])
    note_answer(node, key_id, peer_id, bool(answer))
    return answer[key_id][0] if answer else _UNANSWERED


async def _digests_on(node: Any, peer_id: Any, key_id: DHTID, held: Seen) -> Any:
    """The digests of what ``peer_id`` holds under ``key_id`` that ``held`` lacks, or ``_UNANSWERED``."""
    answer = await node.protocol.call_find_changed_digests(peer_id, key_id, held)
    note_answer(node, key_id, peer_id, answer is not None)
    return _UNANSWERED if answer is None else answer


def _value(answer: Any) -> Optional[ValueWithExpiration[Any]]:
    return None if answer is _UNANSWERED else answer


def _quick_order(others: list, replicas: int) -> list:
    """The holders a store reaches from a random one of them, then the beam's others."""
    head = others[:replicas]
    start = random.randrange(len(head)) if head else 0
    return head[start:] + head[:start] + others[replicas:]


def _own_copy(node: Any, key_id: DHTID) -> Optional[ValueWithExpiration[Any]]:
    """This peer's stored value, copied: a read merges into its first candidate and must not change it."""
    held = node.protocol.storage.get(key_id)
    if held is None or not isinstance(held.value, DictionaryDHTValue):
        return held
    copy = DictionaryDHTValue(held.value.maxsize)
    for subkey, item in held.value.items():
        copy.store(subkey, item.value, item.expiration_time)
    return ValueWithExpiration(copy, held.expiration_time)


async def _walk(node: Any, key: Any, bar: Optional[float]) -> Optional[ValueWithExpiration[Any]]:
    """hivemind's read, walking the DHT towards the key."""
    if bar is None:
        return await node.get(key, latest=True, beam_size=READ_BEAM)
    return await node.get(key, sufficient_expiration_time=bar, beam_size=READ_BEAM, num_workers=1)
