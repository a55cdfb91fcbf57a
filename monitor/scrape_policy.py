"""Which announced metrics endpoints the monitor's `/sd` hands to Prometheus (pure).

Prometheus scrapes whatever `/sd` lists, from wherever it runs: a listed endpoint is a request the
operator's scraper makes on a peer's say-so, into networks the peer may not reach itself. So a
record's `metrics_endpoint` is listed only where the node may send the scraper anyway:

- A worker: on the host it announced for its gRPC endpoint (the address every trainer dials),
  at the port it announced for its metrics. Another host, or a private or loopback address beside
  a public gRPC endpoint, is left out (`other_host`): a peer may point the scraper at its own
  machine, never at another.
- A trainer announces no gRPC endpoint, so it has no host of its own: its metrics endpoint is
  listed only on a host the operator named to the monitor (the hosts of its static `--target`s,
  and `--trainer-host`), else left out (`unknown_host`). The trainers of an operator's own
  machines are then found without a port in the monitor's flags; a trainer elsewhere is added
  with `--trainer-host` or `--target trainer=HOST:PORT`. Worker hosts are not trusted for
  trainers: that would let a trainer point the scraper at any port of any worker's machine.
- A wildcard host (0.0.0.0, ::) means "this machine" to whoever dials it, so never (`wildcard`).

Addresses are compared as addresses (`::1` and `0:0::1` are one), names as lower-case text: two
names of one machine do not match, which leaves a target out rather than in.

What this cannot stop: a worker's gRPC endpoint is itself its own claim, so a worker that
announces another machine for both (its trainers then fail the TLS handshake, since that machine
holds no credential of its peer id) still points the scraper there.
"""

from __future__ import annotations

import ipaddress
from typing import Iterable, Optional

from agora.dht.record_fields import RecordError, parse_endpoint

__all__ = ["host_key", "worker_target_refusal", "trainer_target_refusal", "REFUSAL_REASONS"]

# Each reason an endpoint is left out, and what it means for the log line.
REFUSAL_REASONS = {"other_host": "not on the host of its gRPC endpoint",
                   "unknown_host": "not on a host the monitor was given (--target, --trainer-host)",
                   "wildcard": "a wildcard address, which means the scraper's own machine"}


def host_key(host: str) -> str:
    """A host as compared here: an address in its canonical form, a name in lower case."""
    host = host.strip().strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower().rstrip(".")


def _host_of(endpoint: str) -> Optional[str]:
    try:
        return host_key(parse_endpoint(endpoint)[0])
    except RecordError:
        return None


def _is_wildcard(key: str) -> bool:
    try:
        return ipaddress.ip_address(key).is_unspecified
    except ValueError:
        return False


def worker_target_refusal(endpoint: str, metrics_endpoint: str) -> Optional[str]:
    """Why a worker's metrics endpoint is left out of `/sd` (a reason of `REFUSAL_REASONS`), or None."""
    metrics_host = _host_of(metrics_endpoint)
    if metrics_host is None:
        return "other_host"  # records refuse a malformed endpoint; fail closed all the same
    if _is_wildcard(metrics_host):
        return "wildcard"
    grpc_host = _host_of(endpoint)
    return None if metrics_host == grpc_host else "other_host"


def trainer_target_refusal(metrics_endpoint: str, known_hosts: Iterable[str]) -> Optional[str]:
    """Why a trainer's metrics endpoint is left out of `/sd`, or None; `known_hosts`: the hosts the
    operator named (already `host_key`s)."""
    metrics_host = _host_of(metrics_endpoint)
    if metrics_host is None:
        return "unknown_host"
    if _is_wildcard(metrics_host):
        return "wildcard"
    return None if metrics_host in set(known_hosts) else "unknown_host"
