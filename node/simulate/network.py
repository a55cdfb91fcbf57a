"""Links and DHT operations in simulated time.

A node's access link has an upload and a download rate and a round trip to any other node. A
message from A to B holds A's uplink for its bytes at the slower of A's upload and B's download
(one message at a time per uplink: a busy link queues), then travels half the path's round trip,
the path's being the mean of the two nodes' access round trips (as the WAN harness's relay delays
a frame by a quarter of their sum each way). What the message costs in framing and gRPC is the
scenario's `call_overhead_ms`, paid per call.

Slow start after idle (`slow_start_after_idle`, a sender's host setting): Linux restarts an idle
connection's congestion window (tcp_output.c's `tcp_cwnd_restart`, RFC 5681 section 4.1): when the
connection has sent nothing for longer than its retransmission timeout, the window is halved once
per timeout idle, down to the initial window of 10 segments (RFC 6928). A message larger than the
window then goes out in round trips of a window each, the window doubling each (slow start), until
the window holds the path's bandwidth-delay product; each such round costs what its round trip
exceeds its serialization. The timeout is Linux's for a steady path: its round trip plus the 200 ms
floor of the variance term (`tcp_rto_min`). A connection is one sender-receiver pair (gRPC keeps
one per peer), and its window grows by the segments a message put in flight, as ACKs grow it in
slow start, at most to the bandwidth-delay product (more would not send faster).

A DHT operation (a store, a get) takes `base_ms + per_doubling_ms * log2(N)` at N nodes: Kademlia's
lookups take log N hops. Measured tables (`get_ms_at`, `store_ms_at`, `cpu_ms_at`: what the
many-node harness measures at a few N) replace that form: `at_size` reads between them.

A store's record is readable before the store returns (`first_holder_s`): a store
(dht/stores.py, after hivemind's `DHTNode.store_many`) looks up the key's nearest peers (the same
beam search a read of the key makes), then sends the record to all `num_replicas` of them at once,
and returns only when every one has answered. A holder keeps the record on receipt, and a read (`get_many_by_id`) takes what
the holders it asks have, so others can read it one lookup and half a round trip after the store
began, however long the slowest holder takes to answer.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import simpy

from agora.node.simulate.scenario import DHTSection, LinkSection

__all__ = ["NodeLink", "CongestionWindow", "path_rtt_s", "transmit", "at_size", "dht_op_s", "dht_cpu_s",
           "first_holder_s", "INITIAL_WINDOW", "SEGMENT_BYTES", "RTO_FLOOR_S"]

INITIAL_WINDOW = 10  # segments (RFC 6928; Linux's TCP_INIT_CWND)
SEGMENT_BYTES = 1448  # a 1,500-byte MTU less IP and TCP headers with timestamps
RTO_FLOOR_S = 0.200  # Linux's tcp_rto_min: the retransmission timeout's variance term never goes below it


@dataclass
class CongestionWindow:
    """One connection's congestion window, in segments, and when it last sent."""

    segments: float = INITIAL_WINDOW
    last_sent: float = -math.inf

    def restart_after_idle(self, now: float, rtt_s: float) -> None:
        """Linux's `tcp_cwnd_restart`: halve once per timeout idle, never below the initial window."""
        idle, rto = now - self.last_sent, rtt_s + RTO_FLOOR_S
        if idle <= rto:
            return
        floor = min(INITIAL_WINDOW, self.segments)
        while (idle := idle - rto) > 0 and self.segments > floor:
            self.segments /= 2
        self.segments = max(self.segments, floor)

    def send_s(self, nbytes: float, rate_bits: float, rtt_s: float) -> float:
        """The time `nbytes` take beyond their serialization: the slow-start rounds they wait. Each
        round's ACKs grow the window by what it put in flight, but only while the window is below
        twice the largest flight (Linux's `tcp_is_cwnd_limited` in slow start: an application-limited
        connection's window does not grow)."""
        left, extra, largest = math.ceil(nbytes / SEGMENT_BYTES), 0.0, 0.0
        path_segments = rate_bits * rtt_s / 8 / SEGMENT_BYTES
        while left > self.segments and self.segments < path_segments:
            extra += max(0.0, rtt_s - self.segments * SEGMENT_BYTES * 8 / rate_bits)
            left -= self.segments
            largest = self.segments
            self.segments *= 2
        largest = max(largest, min(left, self.segments))
        grown = max(self.segments, min(self.segments + left, 2 * largest))
        self.segments = min(max(path_segments, INITIAL_WINDOW), grown)
        return extra


@dataclass
class NodeLink:
    """One node's access link in a running simulation."""

    kind: LinkSection
    uplink: simpy.Resource = field(repr=False, default=None)
    windows: dict = field(repr=False, default_factory=dict)  # id(receiver) -> CongestionWindow
    counted_from: float = 0.0  # the uplink's busy time counts from here (a run's warm-up)
    busy_s: float = 0.0  # seconds the uplink spent sending since `counted_from`

    @classmethod
    def on(cls, env: simpy.Environment, kind: LinkSection, counted_from: float = 0.0) -> "NodeLink":
        return cls(kind, simpy.Resource(env, capacity=1), counted_from=counted_from)

    @property
    def rtt_s(self) -> float:
        return self.kind.rtt_ms / 1000.0

    def window_to(self, receiver: "NodeLink") -> CongestionWindow:
        return self.windows.setdefault(id(receiver), CongestionWindow())


def path_rtt_s(a: NodeLink, b: NodeLink) -> float:
    return (a.rtt_s + b.rtt_s) / 2


def transmit(env: simpy.Environment, sender: NodeLink, receiver: NodeLink, nbytes: float):
    """A simpy process: `nbytes` from sender to receiver (serialization on the sender's uplink, the
    slow-start rounds of an idle connection when the sender's host restarts them, then half the
    path's round trip)."""
    rate_bits = min(sender.kind.up_mbit, receiver.kind.down_mbit) * 1e6
    rtt, extra = path_rtt_s(sender, receiver), 0.0
    if nbytes > 0:
        with sender.uplink.request() as turn:
            yield turn
            if sender.kind.slow_start_after_idle:
                window = sender.window_to(receiver)
                window.restart_after_idle(env.now, rtt)
                extra = window.send_s(nbytes, rate_bits, rtt)
            if env.now >= sender.counted_from:
                sender.busy_s += nbytes * 8 / rate_bits
            yield env.timeout(nbytes * 8 / rate_bits)
            if sender.kind.slow_start_after_idle:
                window.last_sent = env.now + extra
    yield env.timeout(extra + rtt / 2)


def at_size(table: tuple[tuple[float, float], ...], nodes: int) -> float:
    """A quantity measured at a few swarm sizes, at `nodes`: a power law through the two measured
    sizes around it (a straight line on log-log axes, as Kademlia's costs grow like a power of N or
    slower), the nearest two extended beyond the table; linear in log N where a value is 0; one
    measured size: its value."""
    if len(table) == 1:
        return table[0][1]
    index = min(max(bisect.bisect_left([size for size, _ in table], nodes), 1), len(table) - 1)
    (n0, v0), (n1, v1) = table[index - 1], table[index]
    t = (math.log(nodes) - math.log(n0)) / (math.log(n1) - math.log(n0))
    if v0 > 0 and v1 > 0:
        return math.exp(math.log(v0) + t * (math.log(v1) - math.log(v0)))
    return max(0.0, v0 + t * (v1 - v0))


def dht_op_s(dht: DHTSection, nodes: int, kind: str = "get") -> float:
    """One DHT operation's latency in a swarm of `nodes` (see the module docstring)."""
    table = dht.store_ms_at if kind == "store" and dht.store_ms_at else dht.get_ms_at
    if table:
        return at_size(table, nodes) / 1000.0
    return (dht.base_ms + dht.per_doubling_ms * math.log2(max(2, nodes)) - dht.per_doubling_ms) / 1000.0


def dht_cpu_s(dht: DHTSection, nodes: int) -> float:
    """The CPU one DHT operation costs the swarm's hosts at `nodes` (0 when not given)."""
    return at_size(dht.cpu_ms_at, nodes) / 1000.0 if dht.cpu_ms_at else 0.0


def first_holder_s(dht: DHTSection, nodes: int, rtt_s: float) -> float:
    """From a store's start to its record's being readable at a holder (see the module docstring):
    a read's lookup and half a round trip, never later than the store's return."""
    return min(dht_op_s(dht, nodes, "store"), dht_op_s(dht, nodes, "get") + rtt_s / 2)
