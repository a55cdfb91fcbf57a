"""The authorizer's settings: a section of the settings schema (pipeline/schema.py), each setting
declared once with its type, default, bounds and help text; ``agora-node authorizer serve``'s
flags are generated from the fields that declare one (node/run_flags.py), and a bad value is one
line naming ``authorizer.<field>`` (or ``authorizer.floors.<field>``) and the value.

Rate limits count callers by address and by network (auth/limits.py): an address is an IPv4
address or an IPv6 /64, a network an IPv4 /24 or an IPv6 /56. Renewals have buckets of their own,
so newcomers never spend what admitted nodes renew with; and newcomers' calls in flight (joins,
preflight streams) may take three quarters of the port's ``max_concurrent_rpcs`` at most, so
renewals find room on a port full of slow newcomers.

A worker is banned once trainers' reports pass the bar: ``ban_after_reports`` distinct trainers
within ``report_window_s`` (auth/reports.py says why one trainer by default, and what a trainer
can then do).

Where the service listens (``host``, ``port``, ``public_host``) is declared here too, as a
worker's is in its options: the command reads it from the same section.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator, model_validator
from pydantic.dataclasses import dataclass

from agora.auth.authority import DEFAULT_CREDENTIAL_LIFETIME_S
from agora.auth.policy import Floors
from agora.auth.reports import ReportBar
from agora.pipeline.schema import SECTION, NoneOr, setting

__all__ = ["AuthorizerSettings", "JOIN_ROLES", "OPEN_ROLES"]

JOIN_ROLES = ("worker", "trainer", "monitor", "client")  # operator credentials are minted offline only
# What a stranger is admitted as by default: a contributor hosting a stage, or a read-only monitor.
# A trainer chooses the data and the targets of every gradient and holds leases, and a client spends
# the workers' inference capacity, so both come from the operator (`authorizer issue`) unless it
# opens them (`--join-roles`).
OPEN_ROLES = ("worker", "monitor")


def _role_list(value: Any) -> Any:
    """Roles as one comma-separated word (`--join-roles worker,trainer`), several, or both."""
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return tuple(role.strip() for item in value for role in item.split(",") if role.strip())
    return value


@dataclass(frozen=True, config=SECTION)
class AuthorizerSettings:
    """How the authorizer admits, limits and bans; the fields with a flag are `authorizer serve`'s options."""

    # ---- where it listens
    host: StrictStr = setting("127.0.0.1", "address to listen on", flag="--host", min_length=1)
    port: StrictInt = setting(0, "port (0: pick a free one)", flag="--port", ge=0, lt=65536)
    public_host: Annotated[StrictStr | None, NoneOr] = setting(
        None, "host nodes dial, written to the join file (default: --host, or this machine's name when --host is "
        "0.0.0.0/::)", flag="--public-host", min_length=1)
    # ---- admission
    floors: Floors = setting(default_factory=Floors)
    max_workers: Annotated[StrictInt | None, NoneOr] = setting(
        None, "cap on admitted workers; more wait in a FIFO queue (default: no cap)", flag="--max-workers", ge=1)
    credential_lifetime_s: StrictFloat = setting(
        DEFAULT_CREDENTIAL_LIFETIME_S, "seconds a credential is valid; nodes renew at half life",
        flag="--credential-lifetime", ge=5)
    join_roles: Annotated[tuple[StrictStr, ...], BeforeValidator(_role_list)] = setting(
        OPEN_ROLES, f"roles a node may join as by itself, comma-separated, of {','.join(JOIN_ROLES)}; the others "
        "need a credential the operator mints with `authorizer issue --role R`, which renews as usual: a trainer "
        "chooses the data and the targets of every gradient, a client (generate/serve) spends the workers' "
        "inference capacity", flag="--join-roles")
    queue_retry_after_s: StrictFloat = setting(5.0, "seconds a queued node waits between polls",
                                               flag="--queue-retry-after", gt=0)
    # ---- the preflight: a worker's link, measured
    preflight_bytes: StrictInt = setting(8 << 20, "bytes moved each way to measure a worker's link",
                                         flag="--preflight-bytes", ge=1)
    latency_probes: StrictInt = setting(5, "round trips timed (their median counts)", flag="--latency-probes", ge=1)
    measurement_ttl_s: StrictFloat = setting(600.0, "a queued node's preflight stays valid this long", gt=0)
    challenge_ttl_s: StrictFloat = setting(60.0, "seconds a join or renewal challenge stays valid", gt=0)
    dialback_timeout_s: StrictFloat = setting(3.0, "seconds the dial-back to a worker's announced port may take",
                                              gt=0)
    local_network: StrictBool = setting(
        False, "the run lives on one host or a private network: the dial-back may reach loopback, private and "
        "link-local addresses (the demo sets it); without it, only public ones", flag="--local-network")
    # ---- rate limits
    join_rate_per_s: StrictFloat = setting(
        0.5, "sustained join attempts per second per address (an IPv4 address or IPv6 /64)", flag="--join-rate", gt=0)
    join_burst: StrictInt = setting(10, "join attempts at once per address", flag="--join-burst", ge=1)
    network_join_rate_per_s: StrictFloat = setting(
        2.0, "sustained join attempts per second per network (an IPv4 /24 or IPv6 /56)", flag="--network-join-rate",
        gt=0)
    network_join_burst: StrictInt = setting(40, "join attempts at once per network", flag="--network-join-burst",
                                            ge=1)
    max_challenges: StrictInt = setting(4096, "join challenges outstanding, in all", ge=1)
    challenges_per_network: StrictInt = setting(
        32, "join challenges one network may hold outstanding (of max_challenges in all)",
        flag="--challenges-per-network", ge=1)
    renew_rate_per_s: StrictFloat = setting(
        0.2, "sustained renewals per second per address and per peer, counted apart from joins so newcomers never "
        "spend them", flag="--renew-rate", gt=0)
    renew_burst: StrictInt = setting(10, "renewals at once per address and per peer", flag="--renew-burst", ge=1)
    max_concurrent_rpcs: StrictInt = setting(
        512, "calls the port serves at once (RESOURCE_EXHAUSTED beyond); newcomers (preflights, joins) may hold "
        "three quarters, so renewals always find room", flag="--max-concurrent-rpcs", ge=4)
    max_calls_per_network: StrictInt = setting(64, "newcomers' calls in flight from one network",
                                               flag="--max-calls-per-network", ge=1)
    # ---- trainers' reports of flagged workers
    ban_after_reports: StrictInt = setting(
        1, "ban a worker once N distinct trainers reported it (their verifiers flagged it) within --report-window; "
        "trainers are the operator's, each applied its own bar, so one is enough by default; 0: keep the reports, "
        "never ban on them", flag="--ban-after-reports", ge=0)
    report_window_s: StrictFloat = setting(
        3600.0, "seconds within which trainers' reports of a worker count together", flag="--report-window", gt=0)

    @property
    def report_bar(self) -> ReportBar:
        return ReportBar(self.ban_after_reports, self.report_window_s)

    @property
    def newcomer_calls(self) -> int:
        """Calls in flight of nodes not yet admitted: three quarters of the port's, so renewals find room."""
        return self.max_concurrent_rpcs * 3 // 4

    @field_validator("join_roles")
    @classmethod
    def _known_roles(cls, roles: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [role for role in roles if role not in JOIN_ROLES]
        if unknown or not roles:
            raise ValueError(f"expected some of {', '.join(JOIN_ROLES)}"
                             + (f" ({', '.join(unknown)} is not one)" if unknown else ""))
        return roles

    @model_validator(mode="after")
    def _agree(self) -> "AuthorizerSettings":
        if self.challenges_per_network > self.max_challenges:
            raise ValueError(f"challenges_per_network: {self.challenges_per_network} is above "
                             f"max_challenges={self.max_challenges}")
        if self.max_calls_per_network > self.newcomer_calls:
            raise ValueError(f"max_calls_per_network: {self.max_calls_per_network} is above {self.newcomer_calls}, "
                             f"three quarters of max_concurrent_rpcs={self.max_concurrent_rpcs}")
        return self
