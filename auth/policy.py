"""The authorizer's decisions, as pure functions and small clock-free classes (time is passed in).

What is decided here, tested without sockets (tests/unit/test_authorizer_policy.py):

- Floors (``Floors``, ``check_floors``): link rate and RTT measured by the authorizer, hardware
  reported by the node; the defaults are the Agora report's (200 Mbit/s each way, 80 ms RTT,
  24 GB accelerator memory, 80 GB RAM; decimal GB, because a "24 GB" card reports 23.99 GiB).
  A refusal names the floor, its flag and the measured value.
- The preflight arithmetic: an RTT is the median of the probes (robust to one slow probe); the
  download clock runs from the authorizer's first byte to the node's acknowledgement of the
  last, so one round trip (the fastest probe) is taken off, never more than half the elapsed
  time: a node that delays its echoes to inflate the RTT can at most double its apparent rate.
- The announced address a worker will be dialled on: never 0.0.0.0 or ``::`` ("every
  interface" on the node is no address for anyone else). The dial-back connects only to globally
  routable addresses unless the run is local (``dialback_allowed``): a stranger must not make the
  authorizer connect into its own host or network.
- Stage assignment: the requested stage when given, else the stage with the least announced
  throughput (ties to the lowest index).
- ``ContributorSlots``: the cap on admitted workers and its FIFO queue. A slot frees when its
  credential expires unrenewed or the peer is banned; a queued node that stops polling drops
  out after ``stale_s``, so a dead node never holds up the queue.
- Proof of possession: RSA-PSS/SHA-256 signatures over the adapter's canonical payload, and the
  signed run description an admitted node checks against the issuing CA of its credential.
- When to renew: SPIRE's rule, once less than half the credential's lifetime remains, earlier by
  a random jitter of up to 10% of the lifetime so a swarm admitted together does not renew
  together; retries back off exponentially with jitter.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
import random
import re
import statistics
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from pydantic import StrictFloat
from pydantic.dataclasses import dataclass as pydantic_dataclass

from agora.auth.credentials import CLOCK_SKEW_S
from agora.pipeline.schema import SECTION, setting
from agora.protos.authorizer_adapter import Hardware

__all__ = [
    "DEFAULT_FLOORS",
    "Floors",
    "LinkMeasurement",
    "Refusal",
    "FloorVerdict",
    "floor_verdicts",
    "check_floors",
    "check_announce",
    "dialback_allowed",
    "assign_stage",
    "jobs_per_microbatch",
    "median_rtt_ms",
    "download_mbit",
    "upload_mbit",
    "ContributorSlots",
    "DIALBACK_PREFIX",
    "dialback_answer",
    "sign_proof",
    "proof_is_valid",
    "run_payload",
    "credential_lifetime_s",
    "renewal_delay_s",
    "retry_delay_s",
]

_GB = 1e9


@pydantic_dataclass(frozen=True, config=SECTION)
class Floors:
    """The least a worker must bring; 0 (or inf for RTT) disables a floor. A section of the
    authorizer's settings (auth/settings.py): each floor is `serve`'s flag of the same name."""

    min_upload_mbit: StrictFloat = setting(200.0, "worker floor: least upload rate, measured by the authorizer",
                                           flag="--min-upload-mbit", ge=0)
    min_download_mbit: StrictFloat = setting(200.0, "worker floor: least download rate, measured by the authorizer",
                                             flag="--min-download-mbit", ge=0)
    max_rtt_ms: StrictFloat = setting(80.0, "worker floor: largest round-trip time to the authorizer (inf: none)",
                                      flag="--max-rtt-ms", ge=0)
    min_accelerator_gb: StrictFloat = setting(24.0, "worker floor: least accelerator memory (decimal GB, reported)",
                                              flag="--min-accelerator-gb", ge=0)
    min_ram_gb: StrictFloat = setting(80.0, "worker floor: least RAM (decimal GB, reported)", flag="--min-ram-gb",
                                      ge=0)


DEFAULT_FLOORS = Floors()


@dataclass(frozen=True)
class LinkMeasurement:
    """What the authorizer measured on its own clock."""

    rtt_ms: float
    download_mbit: float
    upload_mbit: float


@dataclass(frozen=True)
class Refusal:
    """Why a node is not admitted: ``field`` names the floor or field, ``reason`` is one line."""

    field: str
    reason: str


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class FloorVerdict:
    """One floor held against one figure: ``passed``, and ``reason`` (one line) when not."""

    name: str  # the floor's field in Floors
    what: str
    measured: float
    floor: float
    unit: str
    at_least: bool  # the figure must reach the floor (else stay under it)
    passed: bool
    reason: str = ""


def floor_verdicts(floors: Floors, hardware: Hardware, link: LinkMeasurement) -> list[FloorVerdict]:
    """Every floor of the run against this worker (``hardware`` is what the node reported): what
    a Join checks, and what `agora-node doctor` shows."""
    checks = (
        ("max_rtt_ms", "round-trip time to the authorizer", link.rtt_ms, floors.max_rtt_ms, "ms", False),
        ("min_upload_mbit", "upload rate", link.upload_mbit, floors.min_upload_mbit, "Mbit/s", True),
        ("min_download_mbit", "download rate", link.download_mbit, floors.min_download_mbit, "Mbit/s", True),
        ("min_accelerator_gb", f"accelerator memory ({hardware.device or 'no device'})",
         hardware.accelerator_memory_bytes / _GB, floors.min_accelerator_gb, "GB", True),
        ("min_ram_gb", "RAM", hardware.ram_bytes / _GB, floors.min_ram_gb, "GB", True),
    )
    verdicts = []
    for name, what, measured, floor, unit, at_least in checks:
        passed = not ((measured < floor) if at_least else (measured > floor))
        reason = ""
        if not passed:
            relation = "below the floor" if at_least else "above the limit"
            how = "reported" if name in ("min_accelerator_gb", "min_ram_gb") else "measured"
            reason = (f"{what} {how} {measured:.1f} {unit}, {relation} {name}={floor:g} {unit} of this run (the "
                      f"operator sets it with {_flag(name)})")
        verdicts.append(FloorVerdict(name, what, measured, floor, unit, at_least, passed, reason))
    return verdicts


def check_floors(floors: Floors, hardware: Hardware, link: LinkMeasurement) -> Optional[Refusal]:
    """The first floor this worker is below, or None (``hardware`` is what the node reported)."""
    for verdict in floor_verdicts(floors, hardware, link):
        if not verdict.passed:
            return Refusal(verdict.name, verdict.reason)
    return None


# ---- preflight arithmetic

def median_rtt_ms(samples_s: Sequence[float]) -> float:
    if not samples_s:
        raise ValueError("no latency samples")
    return statistics.median(samples_s) * 1e3


def _mbit(n_bytes: int, seconds: float) -> float:
    return n_bytes * 8 / 1e6 / max(seconds, 1e-9)


def download_mbit(n_bytes: int, elapsed_s: float, min_rtt_s: float) -> float:
    """Rate of a download timed from first byte sent to acknowledgement received."""
    return _mbit(n_bytes, max(elapsed_s - min_rtt_s, elapsed_s / 2))


def upload_mbit(n_bytes: int, elapsed_s: float) -> float:
    """Rate of an upload timed from its opening message to its last byte."""
    return _mbit(n_bytes, elapsed_s)


# ---- addresses and stages

_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?")


def check_announce(host: str, port: int) -> Optional[Refusal]:
    """Whether ``host:port`` is an address other peers could dial; None when it is."""
    if not host:
        return Refusal("announce_host", "announce: a worker must announce the host:port its gRPC server is "
                                        "reached on (--announce-host)")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
        if not _HOSTNAME.fullmatch(host):
            return Refusal("announce_host", f"announce: {host[:80]!r} is neither an IP address nor a host name")
    if address is not None and (address.is_unspecified or address.is_multicast):
        return Refusal("announce_host", f"announce: {host} means 'every interface' on the node, which is no address "
                                        "others can dial: pass --announce-host with the node's public address")
    if not 1 <= port <= 65535:
        return Refusal("announce_port", f"announce: port {port} is not a TCP port (1-65535)")
    return None


def dialback_allowed(address: str, local_network: bool) -> bool:
    """Whether the dial-back may connect to ``address`` (an IP literal, as resolved): a globally
    routable unicast address, or with ``local_network`` (a run on one host or a private network)
    any unicast one, loopback, private and link-local included."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone ("fe80::1%eth0") names a link
    except ValueError:
        return False
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified or ip.is_multicast:
        return False
    return local_network or ip.is_global


def jobs_per_microbatch(stage: int, n_stages: int) -> int:
    """A Forward and a Backward, except on the last stage (its loss and backward in one job)."""
    return 1 if stage == n_stages - 1 else 2


def assign_stage(n_stages: int, throughput: Mapping[int, float], requested: Optional[int]) -> int | Refusal:
    """The stage a worker hosts: the requested one, else the least covered in microbatches per second.

    ``throughput`` is what the stage's members announce: the mean rate of their jobs, in samples/s.
    A microbatch costs the last stage one job and the others two, so the announced sum is divided by
    that before stages are compared; summed raw, the last stage's figure reads at about half a body's
    on equal machines and every newcomer was sent there."""
    if requested is not None:
        if not 0 <= requested < n_stages:
            return Refusal("stage", f"stage: {requested} is out of range for this {n_stages}-stage run "
                                    f"(0-{n_stages - 1})")
        return requested
    return min(range(n_stages), key=lambda s: (throughput.get(s, 0.0) / jobs_per_microbatch(s, n_stages), s))


# ---- the cap and its queue

class ContributorSlots:
    """At most ``capacity`` admitted workers (None: no cap); the rest wait in FIFO order."""

    def __init__(self, capacity: Optional[int], *, stale_s: float):
        if capacity is not None and capacity < 1:
            raise ValueError(f"--max-workers: expected at least 1, got {capacity}")
        self.capacity = capacity
        self.stale_s = stale_s
        self.admitted: dict[str, float] = {}  # peer id -> credential expiry
        self._queue: OrderedDict[str, float] = OrderedDict()  # peer id -> last poll

    def expire(self, now: float) -> list[str]:
        """Free the slots whose credential expired unrenewed; drop queued nodes that stopped polling."""
        freed = [peer for peer, expiry in self.admitted.items() if expiry <= now]
        for peer in freed:
            del self.admitted[peer]
        for peer in [p for p, seen in self._queue.items() if now - seen > self.stale_s]:
            del self._queue[peer]
        return freed

    def free(self) -> float:
        return math.inf if self.capacity is None else max(0, self.capacity - len(self.admitted))

    def queue(self) -> list[str]:
        return list(self._queue)

    def request(self, peer_id: str, now: float) -> int:
        """0: admit now (then ``hold``); else the node's queue position, 1 being next."""
        self.expire(now)
        if peer_id in self.admitted:
            return 0
        self._queue[peer_id] = now  # keeps its place when already queued (dict order is insertion order)
        position = list(self._queue).index(peer_id) + 1
        return 0 if position <= self.free() else position

    def hold(self, peer_id: str, expires_at: float) -> None:
        """Admit (or extend) ``peer_id`` until ``expires_at``."""
        self._queue.pop(peer_id, None)
        self.admitted[peer_id] = expires_at

    def release(self, peer_id: str) -> bool:
        self._queue.pop(peer_id, None)
        return self.admitted.pop(peer_id, None) is not None


# ---- reachability

DIALBACK_PREFIX = b"AGORA-DIALBACK/1 "


def dialback_answer(token: bytes) -> bytes:
    """The line a worker's reachability listener writes to whoever connects (then it hangs up)."""
    return DIALBACK_PREFIX + token.hex().encode() + b"\n"


# ---- proof of possession and the signed run description

_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)


def sign_proof(key: rsa.RSAPrivateKey, payload: bytes) -> bytes:
    return key.sign(payload, _PSS, hashes.SHA256())


def proof_is_valid(public_key: rsa.RSAPublicKey, payload: bytes, signature: bytes) -> bool:
    try:
        public_key.verify(signature, payload, _PSS, hashes.SHA256())
    except (InvalidSignature, ValueError):
        return False
    return True


def run_payload(run_id: str, config_json: str, initial_peers: Sequence[str], credential_pem: bytes) -> bytes:
    """What the issuing CA signs for an admitted node: the run it is told about, tied to its credential."""
    body = {"run_id": run_id, "config": hashlib.sha256(config_json.encode()).hexdigest(),
            "initial_peers": list(initial_peers), "credential": hashlib.sha256(credential_pem).hexdigest()}
    return b"agora-run-v1\0" + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# ---- renewal timing

def credential_lifetime_s(not_before: float, not_after: float) -> float:
    """The lifetime a credential was issued with (its not_before is back-dated for clock skew)."""
    return max(1e-3, not_after - not_before - CLOCK_SKEW_S)


def renewal_delay_s(not_before: float, not_after: float, now: float, rng: random.Random,
                    jitter_fraction: float = 0.1) -> float:
    """Seconds from ``now`` until renewal: at half life, earlier by up to ``jitter_fraction`` of the lifetime."""
    lifetime = credential_lifetime_s(not_before, not_after)
    renew_at = not_after - lifetime / 2 - rng.uniform(0.0, jitter_fraction * lifetime)
    return max(0.0, renew_at - now)


def retry_delay_s(attempt: int, rng: random.Random, *, initial_s: float, maximum_s: float) -> float:
    """Exponential backoff with full jitter in [half, whole] of the step (attempt 0 is the first retry)."""
    step = min(maximum_s, initial_s * 2.0 ** min(attempt, 30))
    return rng.uniform(step / 2, step)
