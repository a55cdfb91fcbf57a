"""Metrics of a node's DHT peer: what its validators refused, and the ban list it holds.

Read at scrape time from ``SwarmDHT.bans`` (dht/bans.py ``NodeBans``), which the node refreshes
every heartbeat together with the ban list: nothing is copied.

- ``agora_dht_refused_total{reason}``: entries this peer's record validator refused, by reason
  (``unknown_key``: a key of no family of the run; ``banned``: a banned writer's new entry;
  ``ban_list``: a list the run's CA did not sign; ``storage``: over this peer's storage bounds;
  ``invalid``: any other bad value).
- ``agora_dht_ban_list_serial``: the serial of the newest ban list held (0: none yet), so an
  operator sees which nodes have the list the authorizer published.
- ``agora_dht_banned_peers``: how many peers it names.
- ``agora_dht_request_seconds{method,kind}``: how long this node waited for each of its DHT
  requests (method: store, get, delete, call; kind: the record family of the key,
  dht/op_timings.py), and ``agora_dht_request_failures_total{method,kind}`` those that failed or
  timed out: how coordination cost grows with the swarm shows here first.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from agora.dht.bans import NodeBans
from agora.dht.op_timings import BUCKETS_S, RequestTimings

__all__ = ["DHTMetrics"]


class DHTMetrics:
    def __init__(self, registry: CollectorRegistry, bans: NodeBans, timings: RequestTimings | None = None):
        self.serial = Gauge("agora_dht_ban_list_serial", "Serial of the newest ban list this node holds (0: none)",
                            registry=registry)
        self.serial.set_function(lambda: 0 if bans.ban_list is None else bans.ban_list.serial)
        self.banned = Gauge("agora_dht_banned_peers", "Peers the ban list this node holds names", registry=registry)
        self.banned.set_function(lambda: len(bans.banned))
        registry.register(_Refused(bans))
        if timings is not None:
            registry.register(_Requests(timings))


class _Refused(Collector):
    """`agora_dht_refused_total{reason}`, read at scrape time."""

    _HELP = "DHT entries this node's record validator refused, by reason"

    def __init__(self, bans: NodeBans):
        self._bans = bans

    def collect(self):
        family = CounterMetricFamily("agora_dht_refused", self._HELP, labels=["reason"])
        for reason, count in sorted(self._bans.refused().items()):
            family.add_metric([reason], count)
        yield family

    def describe(self):
        yield CounterMetricFamily("agora_dht_refused", self._HELP, labels=["reason"])


class _Requests(Collector):
    """`agora_dht_request_seconds` and `agora_dht_request_failures_total`, read at scrape time."""

    _HELP = "Seconds this node waited for its DHT requests, by operation and key family"
    _FAILURES = "DHT requests of this node that failed or timed out, by operation and key family"
    _LABELS = ["method", "kind"]  # the operation; the record family of its key

    def __init__(self, timings: RequestTimings):
        self._timings = timings

    def collect(self):
        seconds = HistogramMetricFamily("agora_dht_request_seconds", self._HELP, labels=self._LABELS)
        failures = CounterMetricFamily("agora_dht_request_failures", self._FAILURES, labels=self._LABELS)
        bounds = [*(f"{b:g}" for b in BUCKETS_S), "+Inf"]
        for (operation, family), stats in sorted(self._timings.snapshot().items()):
            seconds.add_metric([operation, family], list(zip(bounds, stats.cumulative())), stats.total_s)
            failures.add_metric([operation, family], stats.failures)
        yield seconds
        yield failures

    def describe(self):
        yield HistogramMetricFamily("agora_dht_request_seconds", self._HELP, labels=self._LABELS)
        yield CounterMetricFamily("agora_dht_request_failures", self._FAILURES, labels=self._LABELS)
