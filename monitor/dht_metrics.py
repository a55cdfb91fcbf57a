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
- What its DHT process carried (dht/entry_traffic.py), read from that process at scrape time:
  ``agora_dht_received_entries_total{kind}`` and ``agora_dht_received_entry_bytes_total{kind}``
  (entries other peers stored here or a read's answer brought, whole), and
  ``agora_dht_sent_requests_total{method,kind}``, ``agora_dht_sent_request_bytes_total{method,kind}``
  and ``agora_dht_response_bytes_total{method,kind}`` (each request as sent and its response, by RPC
  and the family of its first key): which record family a node's bandwidth goes to. A scrape while the DHT process does not
  answer leaves them out and counts nothing.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from agora.dht.bans import NodeBans
from agora.dht.op_timings import BUCKETS_S, RequestTimings

__all__ = ["DHTMetrics"]

logger = logging.getLogger(__name__)


class DHTMetrics:
    def __init__(self, registry: CollectorRegistry, bans: NodeBans, timings: RequestTimings | None = None,
                 traffic: Optional[Callable[[], dict]] = None):
        self.serial = Gauge("agora_dht_ban_list_serial", "Serial of the newest ban list this node holds (0: none)",
                            registry=registry)
        self.serial.set_function(lambda: 0 if bans.ban_list is None else bans.ban_list.serial)
        self.banned = Gauge("agora_dht_banned_peers", "Peers the ban list this node holds names", registry=registry)
        self.banned.set_function(lambda: len(bans.banned))
        registry.register(_Refused(bans))
        if timings is not None:
            registry.register(_Requests(timings))
        if traffic is not None:
            registry.register(_Traffic(traffic))


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


class _Traffic(Collector):
    """The DHT process's entries received and requests sent (``SwarmDHT.traffic``), read at scrape time."""

    _ENTRIES = ("agora_dht_received_entries", "DHT entries this node received (stored here or brought by its "
                "reads), by record family")
    _ENTRY_BYTES = ("agora_dht_received_entry_bytes", "Bytes of the DHT entries this node received, whole, by "
                    "record family")
    _REQUESTS = ("agora_dht_sent_requests", "DHT requests this node sent, by RPC and the record family of their key")
    _REQUEST_BYTES = ("agora_dht_sent_request_bytes", "Bytes of the DHT requests this node sent, authorization "
                      "included, by RPC and record family")
    _RESPONSE_BYTES = ("agora_dht_response_bytes", "Bytes of the responses to this node's DHT requests, "
                       "authorization included, by RPC and record family")

    def __init__(self, traffic: Callable[[], dict]):
        self._traffic = traffic

    def collect(self):
        try:
            traffic = self._traffic()
        except Exception as error:  # noqa: BLE001 - a scrape must not fail with the DHT process
            logger.debug("DHT traffic not read for a scrape: %s", error)
            return
        entries = CounterMetricFamily(*self._ENTRIES, labels=["kind"])
        entry_bytes = CounterMetricFamily(*self._ENTRY_BYTES, labels=["kind"])
        for kind, (count, size) in sorted(traffic.get("received", {}).items()):
            entries.add_metric([kind], count)
            entry_bytes.add_metric([kind], size)
        requests, request_bytes, response_bytes = (CounterMetricFamily(*named, labels=["method", "kind"]) for named in
                                                   (self._REQUESTS, self._REQUEST_BYTES, self._RESPONSE_BYTES))
        for name, (calls, out, back) in sorted(traffic.get("sent", {}).items()):
            labels = list(name.partition(" ")[::2])  # "find_changed units": method, kind
            requests.add_metric(labels, calls)
            request_bytes.add_metric(labels, out)
            response_bytes.add_metric(labels, back)
        yield from (entries, entry_bytes, requests, request_bytes, response_bytes)

    def describe(self):
        yield CounterMetricFamily(*self._ENTRIES, labels=["kind"])
        yield CounterMetricFamily(*self._ENTRY_BYTES, labels=["kind"])
        for named in (self._REQUESTS, self._REQUEST_BYTES, self._RESPONSE_BYTES):
            yield CounterMetricFamily(*named, labels=["method", "kind"])
