"""Heartbeat: keep a node's DHT record alive while the node is, and no longer.

Design choices:

- The record is rebuilt from a callable on every beat, so step, queue depth and
  throughput are current; the heartbeat stamps ``updated_at`` with the DHT clock. Any record
  type works (a worker's, a trainer's): it is stored under its own ``dht_key()``, in this
  peer's subkey.
- Each announce expires after ``3 * interval``: a worker that dies (kill -9) vanishes from
  readers after about three missed beats, with no one having to notice the death.
- Beats run at a rate from the start time, each gap drawn within ``BEAT_JITTER`` of the interval
  (``next_beat_s``); a beat that ran late does not cause a burst of catch-up beats, the schedule
  just restarts from now. The jitter is for nodes that start together (a demo, a swarm coming back
  after an outage): at a fixed rate they would stay in step for ever, every beat of theirs reading
  the ban list from its few holders and storing their stage's key in one burst. In a 32-peer swarm
  whose beats were in step, the ban list's holders took up to 1 s to answer that burst
  (bench/dht_scale.py) where one read alone takes two round trips.
- One failed beat (DHT timeout, an invalid record from the callable) is logged and
  counted, never fatal: the next beat may succeed, and expiration covers the worst case.
- Each beat also reads the run's ban list (``SwarmDHT.refresh_bans``, one get), so a ban
  reaches a node within a beat even when nothing else of it reads the DHT; a failed read is
  logged like a failed announce and changes nothing.
- ``stop()`` cancels the loop, then withdraws the record (tombstone) so trainers stop
  routing to a worker that is leaving before its record would have expired. A store
  still in flight when the loop is cancelled cannot resurrect the record: the tombstone
  is written with a later expiration, and the later expiration wins in hivemind.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Callable, Optional

from agora.dht.records import Record
from agora.dht.swarm import DHTRequestError, SwarmDHT

__all__ = ["BEAT_JITTER", "DEFAULT_INTERVAL", "MISSED_BEATS_TO_EXPIRE", "Heartbeat", "next_beat_s"]

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL = 5.0
MISSED_BEATS_TO_EXPIRE = 3
# A gap between beats is the interval times a factor drawn from 1 +- this (a record outlives 3 beats).
BEAT_JITTER = 0.1


def next_beat_s(due_s: float, interval: float, now_s: float, rng: random.Random) -> float:
    """When the beat after one due at ``due_s`` is due, the last having ended at ``now_s``."""
    due_s += interval * rng.uniform(1.0 - BEAT_JITTER, 1.0 + BEAT_JITTER)
    return max(due_s, now_s)


class Heartbeat:
    """Re-announce ``current_record()`` (a ``Record`` with a ``peer_id``) every ``interval`` seconds until stopped."""

    def __init__(
        self,
        swarm: SwarmDHT,
        current_record: Callable[[], Record],
        *,
        interval: float = DEFAULT_INTERVAL,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"heartbeat interval must be > 0 seconds, got {interval}")
        self._swarm = swarm
        self._current_record = current_record
        self.interval = interval
        self.ttl = MISSED_BEATS_TO_EXPIRE * interval
        self.beats = 0  # announces accepted by the DHT
        self.failures = 0  # beats that raised or were refused
        self._task: Optional[asyncio.Task[None]] = None
        self._last_announced: Optional[Record] = None
        self._accepted = asyncio.Event()  # set by every accepted beat, for wait_beats()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def last_announced(self) -> Optional[Record]:
        """The last record the DHT accepted (None before the first one and after a withdraw)."""
        return self._last_announced

    async def start(self) -> bool:
        """Announce once now, then keep beating in a background task.

        Returns whether the first announce was accepted, so a caller can tell whether it
        is discoverable yet; the loop runs either way.
        """
        if self._task is not None:
            raise RuntimeError("heartbeat already started")
        accepted = await self.beat()
        self._task = asyncio.create_task(self._run(), name="agora-dht-heartbeat")
        return accepted

    async def beat(self) -> bool:
        """Announce the current record now (for example right after a phase change), and read
        the ban list if a beat has passed since the last read."""
        await self._read_bans()
        try:
            record = self._current_record().replace(updated_at=self._swarm.clock())
            previous = self._last_announced
            # One holder's copy is enough to be seen (readers merge every holder's), so the beat
            # does not wait on the slowest of them.
            accepted = await self._swarm.store_async(record.dht_key(), record, self.ttl, await_all=False,
                                                     subkey=self._swarm.subkey_of(record.peer_id))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - a missed beat must not kill the worker
            self.failures += 1
            logger.warning("heartbeat failed: %s: %s", type(error).__name__, error)
            return False
        if not accepted:
            self.failures += 1
            logger.warning("heartbeat refused by the DHT for %s", record.peer_id)
            return False
        self.beats += 1
        self._last_announced = record
        self._accepted.set()
        if previous is not None and (previous.dht_key(), previous.peer_id) != (record.dht_key(), record.peer_id):
            # The node moved (another stage or identity): its old entry must not linger.
            await self._withdraw(previous)
        return True

    async def _read_bans(self) -> None:
        try:
            # Half a beat: a read a beat ago is due, however the beats jitter.
            await self._swarm.refresh_bans_async(self.interval / 2)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the list held stays; the next beat reads again
            logger.warning("reading the ban list failed: %s: %s", type(error).__name__, error)

    async def wait_beats(self, count: int) -> None:
        """Return once `count` beats in all have been accepted (wrap in a timeout: a DHT that
        refuses every beat never gets there)."""
        while self.beats < count:
            self._accepted.clear()
            await self._accepted.wait()

    async def stop(self, *, withdraw: bool = True) -> None:
        """Stop beating; with ``withdraw`` (the default) remove the record right away."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # wait(), not await: the task's CancelledError stays in the task, while a
            # cancellation of stop() itself still propagates.
            await asyncio.wait([task])
        if withdraw and self._last_announced is not None:
            record, self._last_announced = self._last_announced, None
            await self._withdraw(record)

    async def __aenter__(self) -> Heartbeat:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        loop, rng = asyncio.get_running_loop(), random.Random()
        next_beat = next_beat_s(loop.time(), self.interval, loop.time(), rng)
        while True:
            await asyncio.sleep(max(0.0, next_beat - loop.time()))
            await self.beat()
            next_beat = next_beat_s(next_beat, self.interval, loop.time(), rng)

    async def _withdraw(self, record: Record) -> None:
        try:
            await self._swarm.delete_async(record.dht_key(), subkey=self._swarm.subkey_of(record.peer_id))
        except DHTRequestError as error:
            # The record still expires on its own within one ttl.
            logger.warning("could not withdraw %s from the DHT: %s", record.peer_id, error)
