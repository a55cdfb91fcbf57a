"""Links and DHT operations in simulated time.

A node's access link has an upload and a download rate and a round trip to any other node. A
message from A to B holds A's uplink for its bytes at the slower of A's upload and B's download
(one message at a time per uplink: a busy link queues), then travels half the path's round trip,
the path's being the mean of the two nodes' access round trips (as the WAN harness's relay delays
a frame by a quarter of their sum each way). What
the message costs in framing and gRPC is the scenario's `call_overhead_ms`, paid per call.

A DHT operation (a store, a get) takes `base_ms + per_doubling_ms * log2(N)` at N nodes: Kademlia's
lookups take log N hops, and what one costs at a given N is what the many-node harness measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import simpy

from agora.node.simulate.scenario import DHTSection, LinkSection

__all__ = ["NodeLink", "path_rtt_s", "transmit", "dht_op_s"]


@dataclass
class NodeLink:
    """One node's access link in a running simulation."""

    kind: LinkSection
    uplink: simpy.Resource = field(repr=False, default=None)

    @classmethod
    def on(cls, env: simpy.Environment, kind: LinkSection) -> "NodeLink":
        return cls(kind, simpy.Resource(env, capacity=1))

    @property
    def rtt_s(self) -> float:
        return self.kind.rtt_ms / 1000.0


def path_rtt_s(a: NodeLink, b: NodeLink) -> float:
    return (a.rtt_s + b.rtt_s) / 2


def transmit(env: simpy.Environment, sender: NodeLink, receiver: NodeLink, nbytes: float):
    """A simpy process: `nbytes` from sender to receiver (serialization on the sender's uplink, then
    half the path's round trip)."""
    rate_bits = min(sender.kind.up_mbit, receiver.kind.down_mbit) * 1e6
    if nbytes > 0:
        with sender.uplink.request() as turn:
            yield turn
            yield env.timeout(nbytes * 8 / rate_bits)
    yield env.timeout(path_rtt_s(sender, receiver) / 2)


def dht_op_s(dht: DHTSection, nodes: int) -> float:
    """One DHT operation's latency in a swarm of `nodes` (see the module docstring)."""
    return (dht.base_ms + dht.per_doubling_ms * math.log2(max(2, nodes)) - dht.per_doubling_ms) / 1000.0
