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
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from agora.dht.bans import NodeBans

__all__ = ["DHTMetrics"]


class DHTMetrics:
    def __init__(self, registry: CollectorRegistry, bans: NodeBans):
        self.serial = Gauge("agora_dht_ban_list_serial", "Serial of the newest ban list this node holds (0: none)",
                            registry=registry)
        self.serial.set_function(lambda: 0 if bans.ban_list is None else bans.ban_list.serial)
        self.banned = Gauge("agora_dht_banned_peers", "Peers the ban list this node holds names", registry=registry)
        self.banned.set_function(lambda: len(bans.banned))
        registry.register(_Refused(bans))


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
