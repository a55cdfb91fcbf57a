"""`MonitorOptions`: how `agora-node monitor` serves (its HTTP port, how often it reads the DHT,
the scrape targets it is given, its ledger), beside the run it watches (the run id and the
number of stages, which admission settles).

A section of the settings schema (pipeline/schema.py): the fields with a flag are `monitor`'s
options, and a bad value is one line naming `monitor.<field>` and the value (`monitor.targets[0]:
expected ROLE=HOST:PORT ...`). Light (no hivemind, no prometheus_client): the CLI builds its flags
from it.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated

from pydantic import AfterValidator, StrictFloat, StrictInt, StrictStr
from pydantic.dataclasses import dataclass

from agora.dht.record_fields import RecordError, parse_endpoint
from agora.monitor.scrape_policy import host_key
from agora.monitor.swarm_view import StaticTarget
from agora.pipeline.schema import SECTION, setting

__all__ = ["MonitorOptions", "parse_target", "parse_trainer_host"]


def parse_target(text: str) -> StaticTarget:
    """`ROLE=HOST:PORT` (a scrape target the DHT does not announce); ValueError says what is wrong."""
    role, sep, endpoint = text.partition("=")
    if not sep or not role.isidentifier():
        raise ValueError("expected ROLE=HOST:PORT (e.g. authorizer=10.0.0.2:9100)")
    try:
        parse_endpoint(endpoint)
    except RecordError as error:
        raise ValueError(f"{role}: {error}") from None
    return StaticTarget(role, endpoint)


def parse_trainer_host(text: str) -> str:
    """A name or an address (IPv6 with or without brackets), never a wildcard; the host as the
    scrape policy compares it (ValueError says what is wrong)."""
    host = text.strip().strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if not host or any(ch.isspace() or ch in "/:[]" for ch in host):
            raise ValueError("expected a host name or address (no port)") from None
        return host_key(host)
    if address.is_unspecified:
        raise ValueError("a wildcard address (every interface) is not a host trainers run on")
    return host_key(host)


def _target(text: str) -> str:
    parse_target(text)
    return text


@dataclass(frozen=True, config=SECTION)
class MonitorOptions:
    host: StrictStr = setting("127.0.0.1", "address the HTTP port listens on", flag="--host", min_length=1)
    port: StrictInt = setting(9400, "HTTP port (0: pick a free one)", flag="--port", ge=0, lt=65536)
    poll_s: StrictFloat = setting(2.0, "seconds between reads of the DHT", flag="--poll", metavar="S", gt=0)
    targets: tuple[Annotated[StrictStr, AfterValidator(_target)], ...] = setting(
        (), "a metrics endpoint the DHT does not announce (the authorizer's, the bootstrap's), ROLE=HOST:PORT, "
        "listed in /sd with role=ROLE; repeatable (default: none). Trainers announcing a metrics endpoint on the "
        "host of a --target are listed too", flag="--target", metavar="ROLE=HOST:PORT")
    trainer_hosts: tuple[Annotated[StrictStr, AfterValidator(parse_trainer_host)], ...] = setting(
        (), "a host whose trainers' announced metrics endpoints /sd lists (a trainer has no gRPC endpoint to vouch "
        "for its host, so by default only those on a --target's host are); repeatable. Workers are listed on the "
        "host of their gRPC endpoint only", flag="--trainer-host", metavar="HOST")
    ready_file: StrictStr | None = setting(None, "write the status page's URL here once serving", flag="--ready-file")
    ledger: StrictStr | None = setting(
        None, "keep the run's ledger of verified work in this sqlite file: trainers started with --ledger-url post "
        "their signed receipts here, /api/contributors sums them, /api/ledger exports them (needs a monitor "
        "credential: receipts are verified against the run's root; default: no ledger)", flag="--ledger",
        metavar="FILE")

    @property
    def static_targets(self) -> tuple[StaticTarget, ...]:
        return tuple(parse_target(text) for text in self.targets)
