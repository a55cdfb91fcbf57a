"""Calls a node's gRPC server serves at once, in three pools: probes, link probes and everything else.

Design choices:
- grpc's own `maximum_concurrent_rpcs` counts every call alike. Health checks and reflection are
  open to every credentialed role (auth/grpc_policy.py) and a health Watch lasts as long as its
  client likes, so any peer holding Watch streams open took the calls a trainer's Forward needed.
  Health checks and reflection (**probes**) therefore have a small pool of their own
  (`probe_calls`), every other call the pool `calls`: a probe never takes a call's place, nor a
  call a probe's.
- A would-be member's link probe (`Stage/ProbeLink`, node/worker/link_probe.py: megabytes each way,
  from a caller not yet admitted) has a pool of its own too on a worker (`link_probe_calls`, a
  worker's `LINK_PROBE_CALLS`), one call per caller: however many probe credentials call at once,
  they hold at most that many transfers, and never a training call's place.
- The pools are counted by a `CallHook` innermost in the chain (`create_server` puts it there),
  after the credential check: a call refused there never takes a slot, and the caller is known.
  One caller (its credential's peer id; the host under --insecure or on the authorizer's
  plaintext port) may hold at most half the probe pool, rounded up, so one peer's Watch streams
  cannot lock out the operator's own probes. The `calls` pool has no per-caller share here: the
  worker's queues give each caller its share of the work (node/replica/bounds.py).
- grpc's limit stays as the bound in sum (`grpc_limit`): the pools plus `REFUSAL_ROOM`, room for
  calls being refused (the credential check reading a refused stream to its end, a full pool's
  answer), which grpc counts until their status is out.
- A full pool answers RESOURCE_EXHAUSTED naming the pool and the setting that sizes it; the
  refusal is counted by reason (`refused`: the worker's refusal counts, a metric) and logged as a
  milestone once each time the pool fills, not per call (the logging interceptor already logs each
  refused call, and a caller retrying in a loop would flood the log). A refused stage stream is
  read to its end first (bounded), so its client sees the status (grpc/grpc#36066); of a refused
  reflection stream only the first request is read: its client sends one and waits, so reading
  that one is enough (a status sent while it was still being written reached the client as
  INTERNAL), and waiting for the end of a stream its client keeps open would hold grpc's refusal
  room.
- Slots are taken and given back on the event loop only (hooks run there): no lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from agora.node.rpc.interceptors import CallHook, CallInfo, CallRecord
from agora.protos.link_probe_adapter import LINK_PROBE_FULL_METHOD
from agora.protos.serving import DRAIN_S, drain

__all__ = ["CallPool", "CallSlots", "PROBE_SERVICES", "DEFAULT_PROBE_CALLS", "LINK_PROBE_CALLS", "REFUSAL_ROOM",
           "is_probe"]

# Health checking and both versions of server reflection (what grpc_health_probe and grpcurl call).
PROBE_SERVICES = frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection"})
DEFAULT_PROBE_CALLS = 8
LINK_PROBE_CALLS = 2  # link probes served at once, one per caller
REFUSAL_ROOM = 16
# A refused stream is read to its end before the status goes out, but no further than this many parts.
_DRAIN_PARTS = 4096
# A refused probe stream's first request comes at once, or not at all (a client holding it open unsent).
_PROBE_DRAIN_S = 1.0


def is_probe(method: str) -> bool:
    """``/grpc.health.v1.Health/Watch`` -> True; any method of our services -> False."""
    parts = method.split("/")
    return len(parts) == 3 and parts[1] in PROBE_SERVICES


@dataclass
class CallPool:
    """`capacity` calls at once, at most `per_caller` of them by one caller (pure; loop-only)."""

    name: str  # "health and reflection calls", for messages
    capacity: int
    per_caller: int
    setting: str  # the setting that sizes it, for messages
    in_use: int = 0
    _held: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.per_caller <= self.capacity:
            raise ValueError(f"{self.setting}: need 0 < per_caller <= capacity, got {self.per_caller} and "
                             f"{self.capacity}")

    def refusal(self, owner: str) -> Optional[tuple[str, str]]:
        """(reason, message) when `owner` may not take a slot now, else None."""
        if self.in_use >= self.capacity:
            return "full", (f"this node serves at most {self.capacity} {self.name} at once ({self.setting}); "
                            "retry when one ends")
        held = self._held.get(owner, 0)
        if held >= self.per_caller:
            return "caller_limit", (f"this caller already holds {held} of this node's {self.capacity} "
                                    f"{self.name} ({self.setting}), at most {self.per_caller} per caller; "
                                    "close one first")
        return None

    def take(self, owner: str) -> None:
        if self.refusal(owner) is not None:
            raise RuntimeError(f"{self.name}: no slot for {owner}")  # a bug in the caller: check refusal first
        self._held[owner] = self._held.get(owner, 0) + 1
        self.in_use += 1

    def give_back(self, owner: str) -> None:
        left = self._held[owner] - 1
        if left:
            self._held[owner] = left
        else:
            del self._held[owner]
        self.in_use -= 1

    def held_by(self, owner: str) -> int:
        return self._held.get(owner, 0)


def _host_owner(call: CallInfo) -> str:
    return call.host


class CallSlots(CallHook):
    """The pools as a hook (module docstring). `calls=None`: other calls are not counted (a server
    without a limit); `link_probe_calls=0`: no link-probe pool (a server that serves no ProbeLink);
    `owner(call)`: who a call counts for; `refused(reason)`: counts a refusal."""

    def __init__(self, *, calls: Optional[int] = None, probe_calls: int = DEFAULT_PROBE_CALLS,
                 link_probe_calls: int = 0,
                 calls_setting: str = "max_concurrent_rpcs", probe_setting: str = "max_probe_calls",
                 owner: Callable[[CallInfo], str] = _host_owner,
                 refused: Callable[[str], None] = lambda reason: None,
                 logger: Optional[logging.Logger] = None):
        super().__init__()
        self.probes = CallPool("health and reflection calls", probe_calls, (probe_calls + 1) // 2, probe_setting)
        self.link_probes = CallPool("link probes", link_probe_calls, 1, "LINK_PROBE_CALLS") if link_probe_calls \
            else None
        self.calls = None if calls is None else CallPool("calls", calls, calls, calls_setting)
        self._owner = owner
        self._refused = refused
        self._logger = logger or logging.getLogger("agora.node.rpc")
        self._full: set[str] = set()  # pools whose filling was logged and that have not had room since

    @property
    def grpc_limit(self) -> Optional[int]:
        """What grpc's own `maximum_concurrent_rpcs` is set to: the pools and the refusal room."""
        if self.calls is None:
            return None
        link_probes = self.link_probes.capacity if self.link_probes is not None else 0
        return self.calls.capacity + self.probes.capacity + link_probes + REFUSAL_ROOM

    def pool_of(self, method: str) -> Optional[CallPool]:
        if method == LINK_PROBE_FULL_METHOD and self.link_probes is not None:
            return self.link_probes
        return self.probes if is_probe(method) else self.calls

    async def before(self, call: CallInfo, context: Any) -> Any:
        pool = self.pool_of(call.method)
        if pool is None:
            return None
        owner = self._owner(call)
        refusal = pool.refusal(owner)
        if refusal is None:
            pool.take(owner)
            return owner
        reason, message = refusal
        self._note_refusal(pool, reason, owner, call.method)
        if call.request_stream is not None:
            await drain(call.request_stream, max_parts=1 if pool is self.probes else _DRAIN_PARTS,
                        timeout_s=_PROBE_DRAIN_S if pool is self.probes else DRAIN_S)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{call.method}: {message}")  # raises

    def release(self, call: CallInfo, held: Any, record: CallRecord) -> None:
        pool = self.pool_of(call.method)
        if pool is None:
            return
        pool.give_back(held)
        self._full.discard(pool.setting)

    def _note_refusal(self, pool: CallPool, reason: str, owner: str, method: str) -> None:
        kind = "probe" if pool is self.probes else "call" if pool is self.calls else "link_probe"
        self._refused(f"{kind}_{reason}")
        if reason != "full" or pool.setting in self._full:
            return
        self._full.add(pool.setting)
        self._logger.warning("%s: all %d slots held; refusing %s from %s until one ends", pool.setting,
                             pool.capacity, method, owner,
                             extra={"milestone": "call_pool_full",
                                    "fields": {"pool": pool.setting, "capacity": pool.capacity,
                                               "method": method, "caller": owner}})
