"""How often a caller may ask the authorizer for work, counted where a caller cannot multiply itself.

Design choices:

- A caller is counted twice: by its address (``address_key``: an IPv4 address, or the IPv6 /64 it
  sits in, the smallest block a subscriber is routed, so one host cannot mint buckets by picking
  new addresses inside its own /64) and by its network (``network_prefix``: IPv4 /24, IPv6 /56,
  about what one site or one cloud tenant holds). ``CallerLimits`` needs a token in both buckets
  and spends one from each only when both have one, so a refused attempt costs nothing more.
- An IPv4-mapped IPv6 address (``::ffff:a.b.c.d``, what a dual-stack listener may report) counts
  as the IPv4 address. Anything that is no IP address (a unix socket) is its own key.
- ``TokenBuckets`` refill continuously. Memory is bounded: when the table is full, buckets that
  have refilled are dropped first (they hold no information), then the oldest; a dropped bucket
  starts full again, which only ever favours its caller.
- The authorizer keeps separate buckets for joins and for renewals (auth/service.py), so that
  newcomers cannot spend the tokens the nodes already admitted renew with.
- ``CallSlots`` bounds the newcomers' calls in flight (a preflight stream may take up to a
  minute) per network and in all; the authorizer sets the total below its port's cap, so the
  calls of admitted nodes always find room.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Optional

__all__ = ["ADDRESS_PREFIX_BITS", "NETWORK_PREFIX_BITS", "address_key", "network_prefix", "TokenBuckets",
           "RateLimited", "CallerLimits", "CallSlots"]

ADDRESS_PREFIX_BITS = {4: 32, 6: 64}
NETWORK_PREFIX_BITS = {4: 24, 6: 56}


def _ip(address: str) -> Optional[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _prefix(address: str, bits: dict[int, int]) -> str:
    ip = _ip(address)
    if ip is None:
        return address
    if bits[ip.version] == ip.max_prefixlen:
        return str(ip)
    return str(ipaddress.ip_network((ip, bits[ip.version]), strict=False))


def address_key(address: str) -> str:
    """What one caller is counted as: its IPv4 address, or its IPv6 /64."""
    return _prefix(address, ADDRESS_PREFIX_BITS)


def network_prefix(address: str) -> str:
    """The network a caller is counted in: its IPv4 /24, or its IPv6 /56."""
    return _prefix(address, NETWORK_PREFIX_BITS)


class TokenBuckets:
    """A token bucket per key: ``burst`` attempts at once, ``rate_per_s`` sustained."""

    def __init__(self, rate_per_s: float, burst: int, *, max_keys: int = 65536):
        if rate_per_s <= 0 or burst < 1:
            raise ValueError(f"rate limit: expected a positive rate and a burst of at least 1, got {rate_per_s}, "
                             f"{burst}")
        self.rate_per_s, self.burst, self.max_keys = rate_per_s, burst, max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def _tokens(self, key: str, now: float) -> float:
        tokens, at = self._buckets.get(key, (float(self.burst), now))
        return min(float(self.burst), tokens + max(0.0, now - at) * self.rate_per_s)

    def wait_s(self, key: str, now: float) -> float:
        """0.0 when ``key`` has a token now, else the seconds until it has one (nothing is spent)."""
        return max(0.0, (1.0 - self._tokens(key, now)) / self.rate_per_s)

    def spend(self, key: str, now: float) -> None:
        tokens = self._tokens(key, now)
        if len(self._buckets) >= self.max_keys and key not in self._buckets:
            self._forget_full(now)
        self._buckets[key] = (tokens - 1.0, now)

    def acquire(self, key: str, now: float) -> float:
        """0.0 when an attempt is allowed now (and spends a token), else the seconds to wait."""
        wait = self.wait_s(key, now)
        if wait == 0.0:
            self.spend(key, now)
        return wait

    def _forget_full(self, now: float) -> None:
        """Bound memory: drop buckets that have refilled (they hold no information), then the oldest."""
        for key in [k for k in self._buckets if self._tokens(k, now) >= self.burst]:
            del self._buckets[key]
        while len(self._buckets) >= self.max_keys:
            self._buckets.pop(next(iter(self._buckets)))


@dataclass(frozen=True)
class RateLimited:
    """Which limit refused an attempt: ``scope`` "address" or "network", the key, when to retry."""

    scope: str
    key: str
    retry_after_s: float

    def message(self, what: str) -> str:
        where = self.key if self.scope == "address" else f"network {self.key}"
        return f"rate limit: too many {what} from {where}; retry after {self.retry_after_s:.1f} s"


class CallerLimits:
    """A bucket per caller address (``address_key``) and a larger one per network (``network_prefix``)."""

    def __init__(self, *, address_rate_per_s: float, address_burst: int, network_rate_per_s: float,
                 network_burst: int, max_keys: int = 65536):
        self._addresses = TokenBuckets(address_rate_per_s, address_burst, max_keys=max_keys)
        self._networks = TokenBuckets(network_rate_per_s, network_burst, max_keys=max_keys)

    def acquire(self, caller: str, now: float) -> Optional[RateLimited]:
        """None when ``caller`` may make an attempt now (a token from each of its buckets is spent)."""
        address, network = address_key(caller), network_prefix(caller)
        for scope, buckets, key in (("address", self._addresses, address), ("network", self._networks, network)):
            wait = buckets.wait_s(key, now)
            if wait > 0:
                return RateLimited(scope, key, wait)
        self._addresses.spend(address, now)
        self._networks.spend(network, now)
        return None


class CallSlots:
    """Calls in flight: at most ``per_network`` from one network (``network_prefix``), ``total`` in all."""

    def __init__(self, *, per_network: int, total: int):
        if not 1 <= per_network <= total:
            raise ValueError(f"call slots: expected 1 <= per network <= total, got {per_network}, {total}")
        self.per_network, self.total = per_network, total
        self._by_network: dict[str, int] = {}
        self._held = 0

    def enter(self, caller: str) -> Optional[str]:
        """None when ``caller`` may start a call now (then ``leave`` when it ends), else which cap is full."""
        network = network_prefix(caller)
        if self._held >= self.total:
            return f"{self._held} calls of newcomers in flight (at most {self.total})"
        if self._by_network.get(network, 0) >= self.per_network:
            return f"{self.per_network} calls in flight from network {network}"
        self._by_network[network] = self._by_network.get(network, 0) + 1
        self._held += 1
        return None

    def leave(self, caller: str) -> None:
        network = network_prefix(caller)
        self._held -= 1
        self._by_network[network] -= 1
        if not self._by_network[network]:
            del self._by_network[network]
