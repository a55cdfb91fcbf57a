"""How often a caller may ask the authorizer for work.

- ``JoinRateLimiter``: a token bucket per caller address.
"""

from __future__ import annotations

__all__ = ["JoinRateLimiter"]


class JoinRateLimiter:
    """A token bucket per caller address: ``burst`` attempts at once, ``rate_per_s`` sustained."""

    def __init__(self, rate_per_s: float, burst: int, *, max_addresses: int = 65536):
        if rate_per_s <= 0 or burst < 1:
            raise ValueError(f"--join-rate/--join-burst: expected a positive rate and burst, got {rate_per_s}, {burst}")
        self.rate_per_s, self.burst, self.max_addresses = rate_per_s, burst, max_addresses
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, at)

    def acquire(self, address: str, now: float) -> float:
        """0.0 when an attempt is allowed now (and spends a token), else the seconds to wait."""
        tokens, at = self._buckets.get(address, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate_per_s)
        if tokens < 1.0:
            self._buckets[address] = (tokens, now)
            return (1.0 - tokens) / self.rate_per_s
        if len(self._buckets) >= self.max_addresses and address not in self._buckets:
            self._forget_full(now)
        self._buckets[address] = (tokens - 1.0, now)
        return 0.0

    def _forget_full(self, now: float) -> None:
        """Bound memory: drop buckets that have refilled (they hold no information)."""
        for address, (tokens, at) in list(self._buckets.items()):
            if tokens + (now - at) * self.rate_per_s >= self.burst:
                del self._buckets[address]
        while len(self._buckets) >= self.max_addresses:
            self._buckets.pop(next(iter(self._buckets)))
