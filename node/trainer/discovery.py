"""Where a trainer learns which workers exist: the DHT in production, a fixed list in tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from agora.dht.records import Phase
from agora.dht.swarm import SwarmDHT
from agora.pipeline.fingerprint import RunFingerprint
from agora.node.trainer.routing import WorkerView

__all__ = ["Discovery", "StaticDiscovery", "DHTDiscovery"]


class Discovery(Protocol):
    async def workers(self) -> list[WorkerView]: ...


@dataclass
class StaticDiscovery:
    """A fixed list of workers: for tests that run without a DHT."""

    views: list[WorkerView]

    async def workers(self) -> list[WorkerView]:
        # Fresh views each time, as a DHT read gives: what a record announces, none of a trainer's own figures.
        return [WorkerView(v.peer_id, v.endpoint, v.stage, v.phase, announced_samples_per_s=v.announced_samples_per_s,
                           announced_queue=v.announced_queue, announced_credits=v.announced_credits,
                           announced_in_flight_credits=v.announced_in_flight_credits) for v in self.views]


@dataclass
class DHTDiscovery:
    """Live worker records of every stage of a run, as routing views.

    Workers announce throughput in tokens/s; routing compares samples/s, hence `seq_len`.
    With `fingerprint` (this trainer's run), workers of another run configuration are skipped
    (the DHT layer logs the first skip of each, naming the differing field). Serve-only workers
    (phase "serving", join --serve-only) are not a trainer's: they take no training call.
    """

    swarm: SwarmDHT
    run_id: str
    n_stages: int
    seq_len: int
    fingerprint: Optional[RunFingerprint] = None

    async def workers(self) -> list[WorkerView]:
        by_stage = await self.swarm.all_workers_async(self.run_id, self.n_stages, fingerprint=self.fingerprint)
        return [
            WorkerView(peer_id=r.peer_id, endpoint=r.endpoint, stage=r.stage, phase=r.phase,
                       announced_samples_per_s=r.throughput / self.seq_len, announced_queue=r.queue_depth,
                       announced_credits=r.credits, announced_in_flight_credits=r.in_flight_credits)
            for records in by_stage.values() for r in records if r.phase != Phase.SERVING
        ]
