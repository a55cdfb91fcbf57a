"""`RequestTimings`: how long this node's DHT requests take, by operation and key family.

How coordination cost grows with a swarm's size shows first in the DHT: every heartbeat, averaging
board probe, lease block, round record and monitor poll is a store or get whose latency grows with
the hops a Kademlia lookup takes and with how busy the peers it visits are. So every request
`SwarmDHT` sends is timed here, from the send to the answer (what the caller waits, the DHT
process's queue included), and counted by outcome; the node's metrics read it at scrape time
(monitor/dht_metrics.py) and the many-node bench compares nodes of swarms of different sizes.

Design choices:

- **Labels stay few.** An operation is `store`, `get`, `delete` or `call` (a coroutine run in the
  DHT process: the ban list, the peer's addresses); a key is named by its record family
  (`workers`, `rounds`, ...), never by its run, stage or block, and a key of no known family is
  `other`, so a peer cannot grow this table by the keys it makes us read.
- **Fixed buckets, plain counts.** The histogram's bounds are set once (1 ms to 30 s, about x2.5
  apart: a loopback get is a few ms, a lookup across continents a few hundred, the request timeout
  tens of seconds), as Prometheus histograms are; a quantile is read from them by interpolation
  (`quantile`), the way `histogram_quantile` does, so what the bench reports is what a dashboard
  shows.
- Thread-safe: `SwarmDHT` is called from threads (`*_async` twins) and the metrics are scraped from
  another.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, field
from typing import Iterable, Optional

__all__ = ["BUCKETS_S", "FAMILIES", "OPERATIONS", "OperationStats", "RequestTimings", "key_family", "quantile"]

BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OPERATIONS = ("store", "get", "delete", "call")
FAMILIES = ("workers", "trainers", "moves", "rounds", "units", "bans")


def key_family(key: Optional[str]) -> str:
    """The record family a DHT key belongs to (dht/keys.py's key shapes), `other` if none;
    `call` requests have no key (None) and are named by what they fetch instead."""
    if not key:
        return "other"
    parts = key.split(".")
    last = parts[-1]
    if len(parts) >= 2 and last[:1] == "b" and last[1:].isdigit():
        last = parts[-2]  # units.b<block>
    return last if last in FAMILIES else "other"


@dataclass
class OperationStats:
    """One (operation, family)'s requests: cumulative bucket counts as Prometheus keeps them."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))  # the last is +Inf
    count: int = 0
    total_s: float = 0.0
    failures: int = 0

    def add(self, seconds: float, failed: bool) -> None:
        self.buckets[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.count += 1
        self.total_s += seconds
        self.failures += int(failed)

    def cumulative(self) -> list[int]:
        """Counts at or below each bound of `BUCKETS_S`, then the total (+Inf)."""
        running, out = 0, []
        for n in self.buckets:
            running += n
            out.append(running)
        return out

    def merged(self, other: "OperationStats") -> "OperationStats":
        return OperationStats([a + b for a, b in zip(self.buckets, other.buckets)], self.count + other.count,
                              self.total_s + other.total_s, self.failures + other.failures)


class RequestTimings:
    """Per (operation, family) latency histograms of one node's DHT requests."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stats: dict[tuple[str, str], OperationStats] = {}

    def record(self, operation: str, family: str, seconds: float, *, failed: bool = False) -> None:
        if operation not in OPERATIONS:
            raise ValueError(f"operation must be one of {OPERATIONS}, got {operation!r}")
        with self._lock:
            self._stats.setdefault((operation, family), OperationStats()).add(max(0.0, seconds), failed)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per "operation family" with requests: how many, how many failed, their mean and median ms
        (the mean exact, the median read from the buckets): what a run's summary keeps."""
        return {f"{operation} {family}": {
            "requests": stats.count, "failed": stats.failures, "mean_ms": round(1000.0 * stats.total_s / stats.count, 3),
            "p50_ms": round(1000.0 * quantile(0.5, stats.cumulative()), 3)}
            for (operation, family), stats in sorted(self.snapshot().items()) if stats.count}

    def snapshot(self) -> dict[tuple[str, str], OperationStats]:
        """A copy of every (operation, family)'s figures so far."""
        with self._lock:
            return {key: OperationStats(list(s.buckets), s.count, s.total_s, s.failures)
                    for key, s in self._stats.items()}


def quantile(q: float, cumulative: Iterable[int]) -> float:
    """The `q` quantile (0..1) of a histogram given as cumulative counts over `BUCKETS_S` then +Inf,
    interpolated linearly inside its bucket as Prometheus' `histogram_quantile` does; NaN if empty.
    A quantile in the +Inf bucket is reported as the largest bound."""
    counts = list(cumulative)
    if len(counts) != len(BUCKETS_S) + 1:
        raise ValueError(f"expected {len(BUCKETS_S) + 1} cumulative counts, got {len(counts)}")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within [0, 1], got {q}")
    total = counts[-1]
    if total == 0:
        return math.nan
    rank = q * total
    index = bisect.bisect_left(counts, rank)
    if index >= len(BUCKETS_S):
        return BUCKETS_S[-1]
    lower = 0.0 if index == 0 else BUCKETS_S[index - 1]
    below = 0 if index == 0 else counts[index - 1]
    inside = counts[index] - below
    if inside == 0:
        return BUCKETS_S[index]
    return lower + (BUCKETS_S[index] - lower) * (rank - below) / inside
