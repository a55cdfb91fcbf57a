"""Link profiles of the WAN harness, and the pure rules around them.

A profile gives every node an access link: upload and download rates (None: unshaped) and an
access round trip. Two nodes of round trip R see R between them (the relay delays a frame from a
to b by (rtt_a + rtt_b) / 4, bench/wan/relay.py). The straggler profile puts one replica of one
stage on a link ten times slower than the others'.

What is pure here, and tested without namespaces: the named profiles, the `tc tbf` arguments
for a rate (`tbf_arguments`), and the verdict on what the harness measured against what it was
asked to make (`judge_measurement`: more than 10% off fails the run, loudly).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "LinkSpec",
    "Profile",
    "PROFILES",
    "TOLERANCE",
    "RTT_FLOOR_MS",
    "LinkMeasurement",
    "tbf_arguments",
    "judge_measurement",
    "profile_named",
]

# How far a measured RTT or rate may be from its setting before the harness refuses to run.
TOLERANCE = 0.10
# Below this an RTT is "no added delay": a 0 ms setting is met by anything up to 1 ms (the relay
# and the veths themselves take ~0.1-0.3 ms).
RTT_FLOOR_MS = 1.0


@dataclass(frozen=True)
class LinkSpec:
    upload_mbit: float | None  # None: not shaped
    download_mbit: float | None
    rtt_ms: float  # access round trip (see the module docstring)

    def describe(self) -> str:
        def rate(value: float | None) -> str:
            return "unshaped" if value is None else f"{value:g} Mbit/s"
        return f"up {rate(self.upload_mbit)}, down {rate(self.download_mbit)}, RTT {self.rtt_ms:g} ms"


@dataclass(frozen=True)
class Profile:
    name: str
    link: LinkSpec  # every node's
    description: str
    straggler: LinkSpec | None = None  # one replica of one stage is on this link instead

    def links(self) -> list[LinkSpec]:
        """The distinct links of this profile (what the harness measures)."""
        return [self.link] + ([self.straggler] if self.straggler is not None else [])


PROFILES: dict[str, Profile] = {
    profile.name: profile for profile in (
        Profile("lan", LinkSpec(None, None, 0.0), "no shaping, no added delay (the relay alone)"),
        Profile("agora-floor", LinkSpec(200, 200, 80.0),
                "the Agora report's admission floor: 200 Mbit/s, 80 ms RTT"),
        Profile("residential", LinkSpec(20, 100, 40.0), "20 Mbit/s up, 100 down, 40 ms RTT"),
        Profile("intercontinental", LinkSpec(1000, 1000, 150.0), "1 Gbit/s, 150 ms RTT"),
        Profile("straggler", LinkSpec(200, 200, 80.0),
                "agora-floor, but one replica of one stage on a 10x slower link (20 Mbit/s)",
                straggler=LinkSpec(20, 20, 80.0)),
    )
}


def profile_named(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"--profile: unknown profile {name!r} (known: {', '.join(PROFILES)})") from None


def tbf_arguments(rate_mbit: float, rtt_ms: float) -> list[str]:
    """`tc qdisc add ... tbf` arguments shaping to `rate_mbit` on a link of round trip `rtt_ms`.

    The bucket holds at least 128 KiB, so a 64 KiB GSO frame passes whole (tbf would cut it into
    MTU-sized packets otherwise, which costs the relay a frame per packet), and 4 ms of the rate,
    so the kernel's timer granularity does not cap the rate below the setting. The queue beyond the
    bucket holds two bandwidth-delay products (at least 50 ms of the rate): with one, BBR's startup
    overshoot (this machine's default congestion control) was dropped at a 1 Gbit/s, 150 ms
    download and the measured goodput stayed 11-20% below the setting; with two, none was."""
    if not rate_mbit > 0:
        raise ValueError(f"rate must be positive, got {rate_mbit}")
    bytes_per_s = rate_mbit * 1e6 / 8
    burst = max(128 * 1024, int(bytes_per_s * 0.004))
    limit = burst + int(bytes_per_s * max(0.05, 2 * rtt_ms / 1e3))
    return ["rate", f"{rate_mbit:g}mbit", "burst", str(burst), "limit", str(limit)]


@dataclass(frozen=True)
class LinkMeasurement:
    """What the harness measured on one link it made (bench/wan/probe.py)."""

    link: LinkSpec
    rtt_ms: float  # median TCP round trip to a node of the same RTT
    upload_mbit: float | None  # TCP goodput out of the node (None: not measured)
    download_mbit: float | None

    def as_dict(self) -> dict:
        return {"setting": self.link.describe(), "rtt_ms": round(self.rtt_ms, 2),
                "upload_mbit": None if self.upload_mbit is None else round(self.upload_mbit, 1),
                "download_mbit": None if self.download_mbit is None else round(self.download_mbit, 1)}


def judge_measurement(measured: LinkMeasurement, tolerance: float = TOLERANCE) -> list[str]:
    """Every way the measured link is more than `tolerance` off its setting (empty: faithful).

    TCP goodput is compared with the shaped rate itself, so the headers' ~4% counts against the
    tolerance; an unshaped direction is not judged."""
    problems = []
    target = measured.link.rtt_ms
    if abs(measured.rtt_ms - target) > max(tolerance * target, RTT_FLOOR_MS):
        problems.append(f"RTT measured {measured.rtt_ms:.1f} ms, set {target:g} ms "
                        f"(more than {tolerance:.0%} off)")
    for direction, setting, value in (("upload", measured.link.upload_mbit, measured.upload_mbit),
                                      ("download", measured.link.download_mbit, measured.download_mbit)):
        if setting is None:
            continue
        if value is None:
            problems.append(f"{direction} not measured (set {setting:g} Mbit/s)")
        elif abs(value - setting) > tolerance * setting:
            problems.append(f"{direction} measured {value:.1f} Mbit/s, set {setting:g} Mbit/s "
                            f"(more than {tolerance:.0%} off)")
    return problems
