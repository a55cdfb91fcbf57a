"""Which replica of a stage serves a generation session: pure decisions over observed state.

A client keeps a `ReplicaRoster`: what the DHT says about every worker (phase, the sessions it
holds, its training queue) merged with what this client saw itself (its own sessions on each
replica, the round trips it measured, failures). A session's route is one replica per stage,
picked when the session opens and kept for the whole session: its attention cache lives there,
and moving costs a replay. Only a failure moves it (`ban` the replica, pick another).

Expected time of one more decode step on replica r:
    (load(r) + 1) * seconds_per_call(r)
load: the larger of the sessions the worker announces and this client's own open on it (a
session is a decode call per token for as long as it runs), plus its announced training queue
(inference shares the stage's compute thread with training). seconds_per_call: this client's
EMA of r's round trips, else the slowest known one's (a replica not measured yet is tried
when it is the least loaded, without being flooded), else 1 s. Ties go by peer id.
Nothing here touches a socket or the wall clock: callers pass `now`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agora.dht.records import SERVING_PHASES

__all__ = ["ReplicaView", "ReplicaRoster", "pick_replica"]

_DEFAULT_SECONDS = 1.0


@dataclass
class ReplicaView:
    peer_id: str
    endpoint: str
    stage: int
    phase: str = "serving"
    announced_sessions: int = 0
    announced_queue: int = 0
    seconds: float | None = None  # this client's EMA of one call's round trip
    open_sessions: int = 0  # this client's sessions routed here now
    failures: int = 0
    banned_until: float = 0.0

    def load(self) -> int:
        return max(self.announced_sessions, self.open_sessions) + self.announced_queue


def pick_replica(candidates: list[ReplicaView], now: float,
                 exclude: frozenset[str] = frozenset()) -> ReplicaView | None:
    """The serving, unbanned candidate with the earliest expected step (module docstring)."""
    usable = [v for v in candidates
              if v.phase in SERVING_PHASES and v.banned_until <= now and v.peer_id not in exclude]
    if not usable:
        return None
    known = [v.seconds for v in usable if v.seconds is not None]
    fallback = max(known) if known else _DEFAULT_SECONDS
    return min(usable, key=lambda v: ((v.load() + 1) * (fallback if v.seconds is None else v.seconds), v.peer_id))


@dataclass
class ReplicaRoster:
    """A client's view of the serving replicas, refreshed from DHT records and its own calls."""

    ema_decay: float = 0.8
    ban_base_s: float = 2.0
    ban_max_s: float = 60.0
    replicas: dict[str, ReplicaView] = field(default_factory=dict)

    def refresh(self, announced: list[ReplicaView]) -> None:
        """Replace the DHT-derived fields; keep this client's observations of replicas still present."""
        fresh = {}
        for view in announced:
            known = self.replicas.get(view.peer_id)
            if known is not None and known.endpoint == view.endpoint and known.stage == view.stage:
                known.phase = view.phase
                known.announced_sessions, known.announced_queue = view.announced_sessions, view.announced_queue
                view = known
            fresh[view.peer_id] = view
        self.replicas = fresh

    def of_stage(self, stage: int) -> list[ReplicaView]:
        return [v for v in self.replicas.values() if v.stage == stage]

    def choose(self, stage: int, now: float, exclude: frozenset[str] = frozenset()) -> ReplicaView | None:
        return pick_replica(self.of_stage(stage), now, exclude)

    def opened(self, peer_id: str) -> None:
        if peer_id in self.replicas:
            self.replicas[peer_id].open_sessions += 1

    def closed(self, peer_id: str) -> None:
        if peer_id in self.replicas:
            view = self.replicas[peer_id]
            view.open_sessions = max(0, view.open_sessions - 1)

    def succeeded(self, peer_id: str, seconds: float) -> None:
        view = self.replicas.get(peer_id)
        if view is None:
            return
        view.failures = 0
        view.seconds = seconds if view.seconds is None else self.ema_decay * view.seconds + (1 - self.ema_decay) * seconds

    def failed(self, peer_id: str, now: float) -> float:
        """A call to the replica failed (unreachable, deadline, broken reply): ban it with backoff; the ban's length."""
        view = self.replicas.get(peer_id)
        if view is None:
            return 0.0
        view.failures += 1
        ban = min(self.ban_base_s * 2 ** (view.failures - 1), self.ban_max_s)
        view.banned_until = max(view.banned_until, now + ban)
        return ban
