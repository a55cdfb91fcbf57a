"""The authorizer's outstanding challenges.

- ``ChallengeBook``: single-use, short-lived challenges bound to the caller's address, with the
  preflight measurements recorded against them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from agora.auth.policy import LinkMeasurement, download_mbit, median_rtt_ms, upload_mbit

__all__ = ["ChallengeError", "ChallengeState", "ChallengeBook"]


class ChallengeError(ValueError):
    """``kind``: ``unknown`` (expired, used or never issued), ``wrong_caller``, ``full`` (too many
    outstanding)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class ChallengeState:
    """One challenge and what the authorizer measured against it (mutable, owned by the book)."""

    nonce: bytes
    dial_token: bytes
    caller: str
    role: str
    renewal: bool
    expires_at: float
    latency_probes: int
    download_bytes: int
    upload_bytes: int
    rtts_s: list[float] = field(default_factory=list)
    download: Optional[tuple[int, float]] = None  # (bytes acknowledged, seconds)
    upload: Optional[tuple[int, float]] = None

    def link(self) -> Optional[LinkMeasurement]:
        """The measurements, once the challenge's whole preflight ran."""
        if len(self.rtts_s) < self.latency_probes or self.download is None or self.upload is None:
            return None
        rtt = median_rtt_ms(self.rtts_s)
        return LinkMeasurement(rtt_ms=rtt, download_mbit=download_mbit(*self.download, min(self.rtts_s)),
                               upload_mbit=upload_mbit(*self.upload))


class ChallengeBook:
    """Outstanding challenges: single use, ``ttl_s`` long, bound to the caller that asked."""

    def __init__(self, ttl_s: float, *, random_bytes: Callable[[int], bytes], capacity: int = 4096):
        self.ttl_s, self.capacity = ttl_s, capacity
        self._random_bytes = random_bytes
        self._open: dict[bytes, ChallengeState] = {}

    def _prune(self, now: float) -> None:
        for nonce in [n for n, c in self._open.items() if c.expires_at <= now]:
            del self._open[nonce]

    def issue(self, caller: str, role: str, renewal: bool, now: float, *, latency_probes: int = 0,
              download_bytes: int = 0, upload_bytes: int = 0) -> ChallengeState:
        self._prune(now)
        if len(self._open) >= self.capacity:
            raise ChallengeError("full", f"the authorizer has {len(self._open)} challenges outstanding; retry "
                                         f"in {self.ttl_s:.0f} s")
        state = ChallengeState(nonce=self._random_bytes(32), dial_token=self._random_bytes(16), caller=caller,
                               role=role, renewal=renewal, expires_at=now + self.ttl_s,
                               latency_probes=latency_probes, download_bytes=download_bytes,
                               upload_bytes=upload_bytes)
        self._open[state.nonce] = state
        return state

    def peek(self, nonce: bytes, caller: str, now: float) -> ChallengeState:
        """An open challenge, for its preflight (not consumed)."""
        state = self._open.get(nonce)
        if state is None or state.expires_at <= now:
            raise ChallengeError("unknown", "challenge: unknown, expired or already used; request a new one")
        if state.caller != caller:
            raise ChallengeError("wrong_caller", f"challenge: issued to {state.caller}, presented by {caller}")
        return state

    def consume(self, nonce: bytes, caller: str, now: float) -> ChallengeState:
        """Take a challenge for the Join or Renew it was issued for: it cannot be used again."""
        state = self.peek(nonce, caller, now)
        del self._open[nonce]
        return state
