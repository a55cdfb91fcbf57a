"""The authorizer's side of the ban list: sign what ``bans.json`` says and put it in the DHT.

``agora-node authorizer ban``/``unban`` only write ``bans.json`` (auth/authority.py); the serving
authorizer notices the change (a stat every ``check_s``) and publishes the new list at once,
signed by its issuing CA (dht/bans.py), through the client-mode DHT peer it already runs under
its own operator credential to read the workers' coverage. Why that peer: the authorizer holds
the CA and needs no other process to trust; a bootstrap republishing it would have to fetch the
list over a new RPC and could only relay what the authorizer signed anyway. An authorizer served
without ``--initial-peers`` has no DHT peer: its bans only refuse renewals, and it says so.

- Serial: the larger of the time in milliseconds and one past the last serial published (kept in
  ``ban_list.json``), so it rises with every change, across restarts, and a state file lost with
  the clock set back still gives the next list a serial higher than any node holds.
- The list is stored again every ``republish_s`` with a fresh expiration (``ttl_s``, the family's
  bound: an hour), so nodes that start later find it; a store nobody accepted is retried at the
  next check.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Callable, Optional

from agora.auth.authority import RunAuthority
from agora.auth.credentials import Clock
from agora.auth.keys import write_private_file
from agora.dht.bans import sign_ban_list
from agora.dht.key_families import BAN_LIST
from agora.dht.keys import bans_key
from agora.dht.record_fields import RecordError
from agora.dht.records import BanListRecord
from agora.dht.swarm import DHTRequestError, SwarmDHT

__all__ = ["BAN_LIST_FILE", "BanPublisher", "next_serial"]

logger = logging.getLogger(__name__)

BAN_LIST_FILE = "ban_list.json"


def next_serial(last: int, now: float) -> int:
    """A serial above ``last`` and no lower than ``now`` in milliseconds (module docstring)."""
    return max(last + 1, int(now * 1000))


class BanPublisher:
    """Publishes ``authority``'s ban list through ``swarm`` whenever it changes (see the module docstring)."""

    def __init__(self, authority: RunAuthority, swarm: SwarmDHT, *, clock: Clock = time.time, check_s: float = 1.0,
                 republish_s: float = 300.0, ttl_s: float = BAN_LIST.max_ttl_s):
        self.authority, self.swarm = authority, swarm
        self._clock = clock
        self.check_s, self.republish_s, self.ttl_s = check_s, republish_s, ttl_s
        self._path = Path(authority.directory) / BAN_LIST_FILE
        self._last_serial = self._read_last_serial()
        self._record: Optional[BanListRecord] = None  # the list being published
        self._stored_at = -float("inf")  # when a peer last accepted it

    def _read_last_serial(self) -> int:
        try:
            return int(json.loads(self._path.read_text())["serial"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return 0

    def publish_if_due(self) -> Optional[BanListRecord]:
        """Sign a new list if ``bans.json`` changed, store it if it is new or due again; the list
        published (None before the first). ``DHTRequestError`` if the store fails."""
        banned = frozenset(self.authority.bans())
        now = self._clock()
        if self._record is None or self._record.peers() != banned:
            serial = next_serial(self._last_serial, now)
            self._record = sign_ban_list(self.authority.issuing(), run_id=self.authority.run_id, serial=serial,
                                         banned=banned, now=now)
            self._last_serial = serial
            write_private_file(self._path, json.dumps({"serial": serial, "banned": sorted(banned)}).encode(),
                               mode=0o644)
            self._stored_at = -float("inf")
        if now - self._stored_at >= self.republish_s:
            record = self._record
            if self.swarm.store(bans_key(record.run_id), record, self.ttl_s, subkey=str(record.serial)):
                self._stored_at = now
                fields = {"serial": record.serial, "banned": len(banned)}
                logger.info("published ban list %d (%d peers banned)", record.serial, len(banned),
                            extra={"milestone": "ban_list_published", "fields": fields})
            else:
                logger.warning("ban list %d: no DHT peer accepted it; trying again", record.serial)
        return self._record

    async def run(self, before: Callable[[], None] = lambda: None) -> None:
        """Check every ``check_s`` until cancelled (``before`` each time: the caller keeps the DHT
        peer's credential fresh); a failed store is logged and retried."""
        while True:
            try:
                await asyncio.to_thread(before)
                await asyncio.to_thread(self.publish_if_due)
            except DHTRequestError as error:
                logger.warning("publishing the ban list failed: %s", error)
            except RecordError as error:  # more bans than one list holds
                logger.error("cannot publish the ban list: %s", error)
            await asyncio.sleep(self.check_s)
