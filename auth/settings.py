"""The authorizer's settings (``agora-node authorizer serve`` fills them from its flags).

Rate limits count callers by address and by network (auth/limits.py): an address is an IPv4
address or an IPv6 /64, a network an IPv4 /24 or an IPv6 /56. Renewals have buckets of their own,
so newcomers never spend what admitted nodes renew with; and newcomers' calls in flight (joins,
preflight streams) may take three quarters of the port's ``max_concurrent_rpcs`` at most, so
renewals find room on a port full of slow newcomers.

A worker is banned once trainers' reports pass the bar: ``ban_after_reports`` distinct trainers
within ``report_window_s`` (auth/reports.py says why one trainer by default, and what a trainer
can then do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from agora.auth.authority import DEFAULT_CREDENTIAL_LIFETIME_S
from agora.auth.policy import Floors
from agora.auth.reports import ReportBar

__all__ = ["AuthorizerSettings", "JOIN_ROLES", "OPEN_ROLES"]

JOIN_ROLES = ("worker", "trainer", "monitor", "client")  # operator credentials are minted offline only
# What a stranger is admitted as by default: a contributor hosting a stage, or a read-only monitor.
# A trainer chooses the data and the targets of every gradient and holds leases, and a client spends
# the workers' inference capacity, so both come from the operator (`authorizer issue`) unless it
# opens them (`--join-roles`).
OPEN_ROLES = ("worker", "monitor")


def _positive_rate(flag: str, rate: float, burst: int) -> None:
    if not (rate > 0 and burst >= 1):
        raise ValueError(f"{flag}: expected a positive rate and a burst of at least 1, got {rate}, {burst}")


@dataclass(frozen=True)
class AuthorizerSettings:
    floors: Floors = Floors()
    max_workers: Optional[int] = None  # None: no cap
    credential_lifetime_s: float = DEFAULT_CREDENTIAL_LIFETIME_S
    challenge_ttl_s: float = 60.0
    latency_probes: int = 5
    download_bytes: int = 8 << 20
    upload_bytes: int = 8 << 20
    join_rate_per_s: float = 0.5  # join challenges per address
    join_burst: int = 10
    network_join_rate_per_s: float = 2.0  # join challenges per network
    network_join_burst: int = 40
    max_challenges: int = 4096  # join challenges outstanding, in all
    challenges_per_network: int = 32  # join challenges outstanding per network
    renew_rate_per_s: float = 0.2  # renewal challenges per address, and renewals per peer
    renew_burst: int = 10
    max_concurrent_rpcs: int = 512  # calls the port serves at once (grpc answers RESOURCE_EXHAUSTED beyond)
    max_calls_per_network: int = 64  # newcomers' calls in flight from one network
    dialback_timeout_s: float = 3.0
    # The run lives on one host or a private network (the demo): the dial-back may then reach
    # loopback, private and link-local addresses, which it otherwise refuses.
    local_network: bool = False
    queue_retry_after_s: float = 5.0
    measurement_ttl_s: float = 600.0  # a queued node's preflight stays valid this long
    # Roles a node may join as by itself; the others only with a credential the operator mints
    # (`authorizer issue`), which renews as usual (OPEN_ROLES says why trainers are not among them).
    join_roles: tuple[str, ...] = OPEN_ROLES
    # Trainers' reports of flagged workers: ban once this many distinct trainers reported one within
    # the window (0: keep the reports, never ban on them).
    ban_after_reports: int = 1
    report_window_s: float = 3600.0

    @property
    def report_bar(self) -> ReportBar:
        return ReportBar(self.ban_after_reports, self.report_window_s)

    @property
    def newcomer_calls(self) -> int:
        """Calls in flight of nodes not yet admitted: three quarters of the port's, so renewals find room."""
        return self.max_concurrent_rpcs * 3 // 4

    def validate(self) -> "AuthorizerSettings":
        self.floors.validate()
        if self.credential_lifetime_s < 5:
            raise ValueError(f"--credential-lifetime: at least 5 s, got {self.credential_lifetime_s}")
        if self.latency_probes < 1 or self.download_bytes < 1 or self.upload_bytes < 1:
            raise ValueError("--preflight-bytes / latency probes: expected positive values")
        if self.max_workers is not None and self.max_workers < 1:
            raise ValueError(f"--max-workers: expected at least 1, got {self.max_workers}")
        _positive_rate("--join-rate/--join-burst", self.join_rate_per_s, self.join_burst)
        _positive_rate("--network-join-rate/--network-join-burst", self.network_join_rate_per_s,
                       self.network_join_burst)
        _positive_rate("--renew-rate/--renew-burst", self.renew_rate_per_s, self.renew_burst)
        if not 1 <= self.challenges_per_network <= self.max_challenges:
            raise ValueError(f"--challenges-per-network: expected 1 to {self.max_challenges}, got "
                             f"{self.challenges_per_network}")
        if self.max_concurrent_rpcs < 4:
            raise ValueError(f"--max-concurrent-rpcs: at least 4, got {self.max_concurrent_rpcs}")
        if not 1 <= self.max_calls_per_network <= self.newcomer_calls:
            raise ValueError(f"--max-calls-per-network: expected 1 to {self.newcomer_calls} (three quarters of "
                             f"--max-concurrent-rpcs), got {self.max_calls_per_network}")
        if not (self.queue_retry_after_s > 0 and self.challenge_ttl_s > 0 and self.dialback_timeout_s > 0):
            raise ValueError("--queue-retry-after: expected a positive number of seconds")
        if self.ban_after_reports < 0:
            raise ValueError(f"--ban-after-reports: expected 0 (never) or more trainers, got {self.ban_after_reports}")
        if not self.report_window_s > 0:
            raise ValueError(f"--report-window: expected a positive number of seconds, got {self.report_window_s}")
        unknown = [role for role in self.join_roles if role not in JOIN_ROLES]
        if unknown or not self.join_roles:
            raise ValueError(f"--join-roles: expected some of {', '.join(JOIN_ROLES)}, got {', '.join(self.join_roles)}")
        return self
