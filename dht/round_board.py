"""RoundBoard: where the replicas of a stage say which averaging round they are in, and how many live.

A ``RoundRecord`` per peer under ``{run}.stage{i}.{method}.rounds``, expiring with the
matchmaking window, so a replica whose own step count is behind can join the round a faster one
is waiting in; the live replica count comes from the workers' records. The averaging loop
(node/averaging/loop.py) reads it every probe; the averager itself is dht/averaging.py.

Only ``ANNOUNCERS`` of a stage's replicas announce a round (``announcers``: the lowest digests of
peer id and round number among the live replicas the last count read saw). The others start it on
their own schedule as the announcers do (they step on the same completed-batch reports); an
announcement is for a replica that will not, and one open entry tells it as well as R do. With
every replica announcing, each rewrote its entry twice a round and every replica's probe carried
all of them back: a probe's bytes grew with R, and so with the swarm. Now a round's board changes
by two entries whatever R. Views of the live replicas differ for a few seconds around a join or a
departure, so a round may get one announcer more or one fewer; two keep a round visible when one
of them is a laggard itself, or dead, or withholds its announcement (a hostile announcer can
still only hide its own). At two replicas both announce, as before.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from typing import Iterable, Optional

from agora.dht.keys import rounds_key
from agora.dht.records import Phase, RoundRecord
from agora.dht.swarm import SwarmDHT

__all__ = ["ANNOUNCERS", "RoundBoard", "announcers"]

logger = logging.getLogger("agora.dht.averaging")  # one logger for everything averaging says

ANNOUNCERS = 2  # replicas of a stage that announce each round (the module docstring)


def announcers(round_number: int, peers: Iterable[str], count: int = ANNOUNCERS) -> frozenset[str]:
    """The ``count`` peers of ``peers`` that announce ``round_number``: those whose digest of peer
    id and round is lowest, so every replica that sees the same peers names the same ones, and the
    duty moves from round to round."""
    def rank(peer_id: str) -> bytes:
        return hashlib.blake2b(f"{peer_id}:{round_number}".encode(), digest_size=8).digest()

    return frozenset(sorted(set(peers), key=rank)[:count])


class RoundBoard:
    """The stage's round announcements and replica count, over a ``SwarmDHT`` (async API)."""

    def __init__(self, swarm: SwarmDHT, *, run_id: str, stage: int, method: str, ttl: float):
        self._swarm = swarm
        self.run_id, self.stage = run_id, stage
        self.key = rounds_key(run_id, stage, method)
        self.ttl = ttl
        self.refused: Counter[str] = Counter()  # announcements refused, by reason (each writer's round once)
        self._refused_seen: set[tuple[str, int]] = set()
        self.peers: frozenset[str] = frozenset()  # the live averaging replicas the last count saw, this one included
        self.strangers = 0  # open announcements read by replicas `peers` leaves out (the count may be stale)

    def announces(self, round_number: int) -> bool:
        """Whether this replica is one of ``round_number``'s announcers (always, before a first count)."""
        return not self.peers or self._swarm.peer_id in announcers(round_number, self.peers)

    async def announce(self, round_number: int) -> None:
        """Tell the stage this replica is starting ``round_number`` (best effort)."""
        record = RoundRecord(peer_id=self._swarm.peer_id, run_id=self.run_id, stage=self.stage,
                             round=round_number, started_at=self._swarm.clock())
        await self._swarm.store_async(self.key, record, self.ttl, subkey=self._swarm.subkey_of(record.peer_id))

    async def close(self, round_number: int) -> None:
        """Tell the stage this replica has left ``round_number`` (best effort). The record replaces
        the announcement (same subkey, later expiry), so a replica that skipped the round does not
        join it after the others are gone and wait out the matchmaking window alone."""
        record = RoundRecord(peer_id=self._swarm.peer_id, run_id=self.run_id, stage=self.stage,
                             round=round_number, started_at=self._swarm.clock(), closed=True)
        await self._swarm.store_async(self.key, record, self.ttl, subkey=self._swarm.subkey_of(record.peer_id))

    async def announced_round(self, at_most: Optional[int] = None) -> Optional[int]:
        """The latest round another replica announced and has not left, if any, and no later than
        `at_most` (the stage's schedule as the caller knows it, with some slack).

        A later one is refused, not joined: a replica that joined it would skip every round up to
        it, so one announcement of round 10**9 would end the stage's averaging, and through the
        checkpointed last round, across restarts too. Each refused (writer, round) is counted once
        in `refused` and said once in a log line naming the writer."""
        entries = await self._swarm.owned_entries_async(self.key, RoundRecord)  # by peer id, ownership checked
        rounds = []
        for peer_id, stored in entries.items():
            record = stored.record
            if peer_id == self._swarm.peer_id or record.stage != self.stage or record.closed:
                continue
            if peer_id not in self.peers:
                self.strangers += 1
            if at_most is not None and record.round > at_most:
                self._refuse(peer_id, record.round, at_most)
                continue
            rounds.append(record.round)
        return max(rounds, default=None)

    def _refuse(self, peer_id: str, round_number: int, at_most: int) -> None:
        if (peer_id, round_number) in self._refused_seen:
            return
        self._refused_seen.add((peer_id, round_number))
        self.refused["past_schedule"] += 1
        logger.warning("stage %d: refused peer %s's announcement of round %d (the stage's schedule allows at "
                       "most %d)", self.stage, peer_id, round_number, at_most,
                       extra={"milestone": "record_refused",
                              "fields": {"kind": "round", "peer": peer_id, "reason": "past_schedule",
                                         "round": round_number, "at_most": at_most}})

    async def replicas(self) -> int:
        """Live replicas of the stage, this one included (even before its first announce lands)."""
        records = await self._swarm.live_workers_async(self.run_id, self.stage)
        # Serve-only workers (phase "serving") share the stage's record key but never average.
        others = {w.peer_id for w in records
                  if w.peer_id != self._swarm.peer_id and w.phase not in (Phase.LEAVING, Phase.SERVING)}
        self.peers = frozenset({self._swarm.peer_id, *others})
        return len(self.peers)
