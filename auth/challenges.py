"""The authorizer's challenges: the newcomers' book, and the renewals' own.

Design choices:

- ``ChallengeBook`` (joins): single-use, short-lived challenges bound to the caller's address,
  with the preflight measurements recorded against them. It holds at most ``capacity`` in all and
  ``per_network`` per caller network (auth/limits.py ``network_prefix``), so one network cannot
  take the whole book from everyone else. Challenges all live ``ttl_s``, so the book's insertion
  order is their expiry order and pruning stops at the first live one.
- A challenge's measurements run one at a time and each kind once (``ChallengeState.begin``):
  concurrent transfers would share the link and spoil each other's figures, and one challenge
  must not buy more than one download's worth of the authorizer's bandwidth.
- ``RenewalChallenges``: a renewal proves the key of a live credential, so its challenge needs no
  record until it is used. A nonce is its expiry, random bytes and a MAC under a secret of this
  process; checking one costs a hash and no memory, so no number of requests (a flood of newcomers,
  or someone replaying the public credential chains of others) can fill anything renewals need.
  A nonce is remembered as used only once a signature proved the key that uses it; a renewing
  node asks again when the authorizer restarts (its old nonces no longer verify).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Callable, Optional

from agora.auth.limits import network_prefix
from agora.auth.policy import LinkMeasurement, download_mbit, median_rtt_ms, upload_mbit

__all__ = ["ChallengeError", "ChallengeState", "ChallengeBook", "RenewalChallenges", "MEASUREMENTS"]

MEASUREMENTS = ("latency", "download", "upload")
_UNKNOWN = "challenge: unknown, expired or already used; request a new one"


class ChallengeError(ValueError):
    """``kind``: ``unknown`` (expired, used or never issued), ``wrong_caller``, ``full`` (too many
    outstanding, in all or from the caller's network), ``busy`` (a measurement of the challenge is
    running), ``repeated`` (that measurement already ran). ``retry_after_s``: when ``full``."""

    def __init__(self, kind: str, message: str, retry_after_s: Optional[float] = None):
        super().__init__(message)
        self.kind, self.retry_after_s = kind, retry_after_s


@dataclass
class ChallengeState:
    """One challenge and what the authorizer measured against it (mutable, owned by the book)."""

    nonce: bytes
    dial_token: bytes
    caller: str
    role: str
    expires_at: float
    latency_probes: int
    download_bytes: int
    upload_bytes: int
    rtts_s: list[float] = field(default_factory=list)
    download: Optional[tuple[int, float]] = None  # (bytes acknowledged, seconds)
    upload: Optional[tuple[int, float]] = None
    started: set[str] = field(default_factory=set)  # measurements begun (each kind runs once)
    measuring: Optional[str] = None  # the one running now

    def link(self) -> Optional[LinkMeasurement]:
        """The measurements, once the challenge's whole preflight ran."""
        if len(self.rtts_s) < self.latency_probes or self.download is None or self.upload is None:
            return None
        rtt = median_rtt_ms(self.rtts_s)
        return LinkMeasurement(rtt_ms=rtt, download_mbit=download_mbit(*self.download, min(self.rtts_s)),
                               upload_mbit=upload_mbit(*self.upload))

    def begin(self, kind: str) -> None:
        """Start the ``kind`` measurement (one of MEASUREMENTS); ``end`` when it stops, however."""
        if self.measuring is not None:
            raise ChallengeError("busy", f"{kind}: the {self.measuring} measurement of this challenge is still "
                                         "running; a challenge's measurements run one at a time")
        if kind in self.started:
            raise ChallengeError("repeated", f"{kind}: already measured for this challenge (once per challenge)")
        self.started.add(kind)
        self.measuring = kind

    def end(self) -> None:
        self.measuring = None


class ChallengeBook:
    """Outstanding join challenges: single use, ``ttl_s`` long, bound to the caller that asked."""

    def __init__(self, ttl_s: float, *, random_bytes: Callable[[int], bytes], capacity: int = 4096,
                 per_network: Optional[int] = None):
        self.ttl_s, self.capacity = ttl_s, capacity
        self.per_network = capacity if per_network is None else per_network
        self._random_bytes = random_bytes
        self._open: dict[bytes, ChallengeState] = {}  # in order of issue, so of expiry
        self._by_network: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._open)

    def _remove(self, nonce: bytes) -> ChallengeState:
        state = self._open.pop(nonce)
        network = network_prefix(state.caller)
        self._by_network[network] -= 1
        if not self._by_network[network]:
            del self._by_network[network]
        return state

    def _prune(self, now: float) -> None:
        while self._open:
            nonce, state = next(iter(self._open.items()))
            if state.expires_at > now:
                return
            self._remove(nonce)

    def _retry_after(self, now: float, network: Optional[str] = None) -> float:
        """Seconds until the oldest open challenge (of ``network``, when given) expires."""
        for state in self._open.values():
            if network is None or network_prefix(state.caller) == network:
                return max(0.0, state.expires_at - now)
        return 0.0

    def issue(self, caller: str, role: str, now: float, *, latency_probes: int = 0, download_bytes: int = 0,
              upload_bytes: int = 0) -> ChallengeState:
        self._prune(now)
        network = network_prefix(caller)
        if len(self._open) >= self.capacity:
            wait = self._retry_after(now)
            raise ChallengeError("full", f"challenge: the authorizer has {len(self._open)} challenges outstanding; "
                                         f"retry in {wait:.0f} s", retry_after_s=wait)
        if self._by_network.get(network, 0) >= self.per_network:
            wait = self._retry_after(now, network)
            raise ChallengeError("full", f"challenge: {self.per_network} challenges outstanding for network "
                                         f"{network}; use or let them expire, retry in {wait:.0f} s",
                                 retry_after_s=wait)
        state = ChallengeState(nonce=self._random_bytes(32), dial_token=self._random_bytes(16), caller=caller,
                               role=role, expires_at=now + self.ttl_s, latency_probes=latency_probes,
                               download_bytes=download_bytes, upload_bytes=upload_bytes)
        self._open[state.nonce] = state
        self._by_network[network] = self._by_network.get(network, 0) + 1
        return state

    def peek(self, nonce: bytes, caller: str, now: float) -> ChallengeState:
        """An open challenge, for its preflight (not consumed)."""
        state = self._open.get(nonce)
        if state is None or state.expires_at <= now:
            raise ChallengeError("unknown", _UNKNOWN)
        if state.caller != caller:
            raise ChallengeError("wrong_caller", f"challenge: issued to {state.caller}, presented by {caller}")
        return state

    def consume(self, nonce: bytes, caller: str, now: float) -> ChallengeState:
        """Take a challenge for the Join it was issued for: it cannot be used again."""
        self.peek(nonce, caller, now)
        return self._remove(nonce)


class RenewalChallenges:
    """Renewal nonces that verify without a record: expiry (ms) + random + MAC under ``secret``."""

    _TAG = b"agora-renewal-challenge-v1\0"

    def __init__(self, ttl_s: float, *, random_bytes: Callable[[int], bytes], max_used: int = 65536):
        self.ttl_s, self.max_used = ttl_s, max_used
        self._random_bytes = random_bytes
        self._secret = random_bytes(32)
        self._used: dict[bytes, float] = {}  # nonce -> expiry, roughly in order of expiry

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._secret, self._TAG + body, hashlib.sha256).digest()

    def issue(self, now: float) -> bytes:
        body = int((now + self.ttl_s) * 1000).to_bytes(8, "big") + self._random_bytes(16)
        return body + self._mac(body)

    def check(self, nonce: bytes, now: float) -> None:
        """ChallengeError ``unknown`` unless ``nonce`` is one of ours, unexpired and unused."""
        body, mac = nonce[:24], nonce[24:]
        if len(nonce) != 56 or not hmac.compare_digest(mac, self._mac(body)):
            raise ChallengeError("unknown", _UNKNOWN)
        if int.from_bytes(body[:8], "big") / 1000 <= now or nonce in self._used:
            raise ChallengeError("unknown", _UNKNOWN)

    def spend(self, nonce: bytes, now: float) -> None:
        """Remember ``nonce`` as used (a proof of possession used it) until it expires."""
        while self._used and (next(iter(self._used.values())) <= now or len(self._used) >= self.max_used):
            self._used.pop(next(iter(self._used)))
        self._used[nonce] = int.from_bytes(nonce[:8], "big") / 1000
