"""The ``*_async`` twins of ``SwarmDHT``'s blocking methods (dht/swarm.py), one place for them all.

Each runs its blocking twin in a thread (``asyncio.to_thread``), so an event loop never blocks on
the DHT; ``SwarmDHT`` inherits them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Optional, TypeVar

from agora.dht.bans import BAN_REFRESH_S

if TYPE_CHECKING:
    from agora.dht.bans import BanList
    from agora.dht.entry_reader import Stored
    from agora.dht.records import Record, WorkerRecord
    from agora.pipeline.fingerprint import RunFingerprint

__all__ = ["AsyncTwins"]

R = TypeVar("R", bound="Record")


class AsyncTwins:
    """Mixin: ``SwarmDHT``'s async methods, each its blocking twin in a thread."""

    async def visible_maddrs_async(self) -> list[str]:
        return await asyncio.to_thread(self.visible_maddrs)

    async def announce_worker_async(self, record: WorkerRecord, ttl: float) -> bool:
        return await asyncio.to_thread(self.announce_worker, record, ttl)

    async def live_workers_async(
        self, run_id: str, stage: int, *, latest: bool = True, fingerprint: Optional[RunFingerprint] = None
    ) -> list[WorkerRecord]:
        return await asyncio.to_thread(self.live_workers, run_id, stage, latest=latest, fingerprint=fingerprint)

    async def all_workers_async(
        self, run_id: str, n_stages: int, *, latest: bool = True, fingerprint: Optional[RunFingerprint] = None
    ) -> dict[int, list[WorkerRecord]]:
        return await asyncio.to_thread(self.all_workers, run_id, n_stages, latest=latest, fingerprint=fingerprint)

    async def withdraw_async(self, run_id: str, stage: int, peer_id: str) -> bool:
        return await asyncio.to_thread(self.withdraw, run_id, stage, peer_id)

    async def store_async(self, key: str, record: Record, ttl: float, *, subkey: Optional[str] = None,
                          await_all: bool = True) -> bool:
        return await asyncio.to_thread(self.store, key, record, ttl, subkey=subkey, await_all=await_all)

    async def delete_async(self, key: str, *, subkey: Optional[str] = None) -> bool:
        return await asyncio.to_thread(self.delete, key, subkey=subkey)

    async def get_record_async(
        self, key: str, record_type: type[R], *, latest: bool = True
    ) -> Optional[Stored[R]]:
        return await asyncio.to_thread(self.get_record, key, record_type, latest=latest)

    async def get_entries_async(
        self, key: str, record_type: type[R], *, latest: bool = True, full: bool = False
    ) -> dict[str, Stored[R]]:
        return await asyncio.to_thread(self.get_entries, key, record_type, latest=latest, full=full)

    async def owned_entries_async(
        self, key: str, record_type: type[R], *, latest: bool = True, full: bool = False
    ) -> dict[str, Stored[R]]:
        return await asyncio.to_thread(self.owned_entries, key, record_type, latest=latest, full=full)

    async def refresh_bans_async(self, max_age_s: float = BAN_REFRESH_S) -> Optional[BanList]:
        return await asyncio.to_thread(self.refresh_bans, max_age_s)

    async def shutdown_async(self) -> None:
        await asyncio.to_thread(self.shutdown)

