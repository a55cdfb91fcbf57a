"""Where a client learns which replicas serve each stage: the DHT's worker records, or a fixed list in tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from agora.dht.swarm import SwarmDHT
from agora.node.inference.routing import ReplicaView
from agora.pipeline.fingerprint import RunFingerprint

__all__ = ["ReplicaDiscovery", "StaticReplicas", "DHTReplicas"]


class ReplicaDiscovery(Protocol):
    async def replicas(self) -> list[ReplicaView]: ...


@dataclass
class StaticReplicas:
    """A fixed list of replicas (peer id, endpoint, stage): for tests without a DHT."""

    views: list[ReplicaView]

    async def replicas(self) -> list[ReplicaView]:
        return [ReplicaView(v.peer_id, v.endpoint, v.stage, v.phase) for v in self.views]


@dataclass
class DHTReplicas:
    """Live worker records of every stage of a run (training members and serve-only workers alike;
    routing keeps those that serve). Records of another run configuration are skipped."""

    swarm: SwarmDHT
    run_id: str
    n_stages: int
    fingerprint: Optional[RunFingerprint] = None

    async def replicas(self) -> list[ReplicaView]:
        by_stage = await self.swarm.all_workers_async(self.run_id, self.n_stages, fingerprint=self.fingerprint)
        return [ReplicaView(peer_id=r.peer_id, endpoint=r.endpoint, stage=r.stage, phase=r.phase,
                            announced_sessions=r.sessions, announced_queue=r.queue_depth)
                for records in by_stage.values() for r in records]
