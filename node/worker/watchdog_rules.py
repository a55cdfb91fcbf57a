"""The watchdog's rules: when a worker is sick enough that leaving beats lingering.

A sick worker that stays costs the run more than one that goes: trainers keep routing to it, its
averaging partners wait for it, its slot at the authorizer keeps a healthy newcomer out. So on the
first rule tripped the worker leaves as a signal makes it leave (node/worker/join.py: record
withdrawn, checkpoint written, slot freed at the authorizer), and exits with the rule's code so a
supervisor can tell a sick node from a stopped one.

Design choices:

- `WatchdogOptions` is a section of the settings schema (pipeline/schema.py), nested in
  `WorkerOptions` as `worker.watchdog`; each rule is a `join --watchdog-*` flag. The defaults leave a healthy worker alone with a wide
  margin; an operator tightens them. 0 turns a counting rule off; `enabled` (--no-watchdog) all of
  them, and the sampling too, so what the watchdog costs can be measured against none
  (bench/watchdog_cost.py).
- The decision is pure: `first_tripped(options, samples)` reads what the node sampled at each
  check (cumulative counters and gauges, `WatchdogSample`) and names the first rule tripped with
  its figures (`Trip`). Counters are judged over the window: the newest sample minus the oldest one
  within `window_s`, so a process that ran for days is judged on its recent minutes only.
- Averaging trips only on failures with no commit in the window: a round fails now and then when a
  partner leaves mid-round; a replica none of whose rounds commit is the sick one.
- The order of the rules is the order of how sure each is: a ban is the swarm's verdict; a
  non-finite gradient is this replica's weights gone bad; memory and a stalled compute thread come
  before the rules that may be the network's fault (averaging, renewal).
- A ban leaves with the exit code of a revoked credential: it is one, told by the swarm before
  the authorizer refuses the next renewal.

Light (no torch): the CLI builds its flags from the section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from pydantic import StrictBool, StrictFloat, StrictInt
from pydantic.dataclasses import dataclass as section

from agora.pipeline.schema import SECTION, setting

__all__ = ["EXIT_CODES", "RULES", "exit_codes_help", "Trip", "WatchdogOptions", "WatchdogSample", "first_tripped"]

# Each rule's process exit code (README "Exit codes"); 3 is also a credential the authorizer revoked.
EXIT_CODES = {"banned": 3, "non_finite_gradients": 10, "host_memory": 11, "device_memory": 12,
              "compute_stalled": 13, "averaging_failed": 14, "renewal_failing": 15}
RULES = tuple(EXIT_CODES)


def exit_codes_help() -> str:
    """`agora-node join`'s exit codes, one line for its --help."""
    rules = ", ".join(f"{code} {rule}" for rule, code in EXIT_CODES.items() if rule != "banned")
    return (f"exit codes: 0 left on a signal (or moved stage), 2 a bad setting or a refused admission, 3 banned or "
            f"credential revoked, the watchdog's rules (--watchdog-*): {rules}; 130 a second signal while leaving")


@section(frozen=True, config=SECTION)
class WatchdogOptions:
    enabled: StrictBool = setting(
        True, "check the worker's own health and leave on the first rule tripped (with --no-watchdog: no checks, "
        "whatever the rules say; a ban still ends it at its next renewal)", flag="--no-watchdog")
    check_s: StrictFloat = setting(5.0, "seconds between two checks of the worker's own health", flag="--watchdog-check", gt=0)
    window_s: StrictFloat = setting(
        300.0, "seconds over which the counting rules (non-finite gradients, failed averaging rounds) count", flag="--watchdog-window", gt=0)
    max_non_finite: StrictInt = setting(
        3, "calls failed on a non-finite loss or gradient of this replica's own (its weights are not finite) within "
        "the window before it leaves; 0: never", flag="--watchdog-max-non-finite", ge=0)
    host_memory_share: StrictFloat = setting(
        0.95, "leave when the process's resident memory reaches this share of the machine's RAM", flag="--watchdog-host-memory-share", gt=0,
        le=1)
    device_memory_share: StrictFloat = setting(
        0.98, "leave when the accelerator memory torch holds reaches this share of the device's", flag="--watchdog-device-memory-share",
        gt=0, le=1)
    stall_s: StrictFloat = setting(
        600.0, "leave when a no-op job given to the stage's compute thread has waited this long (a compute job or a "
        "handler stuck); 0: never", flag="--watchdog-stall", ge=0)
    max_failed_rounds: StrictInt = setting(
        20, "averaging rounds failed within the window, with none committed, before it leaves; 0: never",
        flag="--watchdog-max-failed-rounds", ge=0)
    max_renewal_failures: StrictInt = setting(
        8, "credential renewals in a row that got no answer from the authorizer before it leaves (a refusal leaves at "
        "once); 0: never", flag="--watchdog-max-renewal-failures", ge=0)
    leave_when_banned: StrictBool = setting(
        True, "leave as soon as this node's own peer id is in the ban list its DHT holds (with --no-watchdog-ban-leave: "
        "once its renewal is refused)", flag="--no-watchdog-ban-leave")


@dataclass(frozen=True)
class WatchdogSample:
    """The node's own state at one check: counters since it started, gauges now (None: not measured here)."""

    at: float  # monotonic seconds
    non_finite: int = 0
    failed_rounds: int = 0
    committed_rounds: int = 0
    host_bytes: Optional[int] = None
    host_total_bytes: Optional[int] = None
    device_bytes: Optional[int] = None
    device_total_bytes: Optional[int] = None
    compute_wait_s: float = 0.0  # how long the compute thread's current no-op probe has waited
    renewal_failures: int = 0  # in a row
    banned: bool = False


@dataclass(frozen=True)
class Trip:
    """A rule tripped, with the figures it was judged on."""

    rule: str
    figures: dict = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.rule]

    def describe(self) -> str:
        return f"{self.rule} ({', '.join(f'{key}={value:g}' for key, value in self.figures.items())})"


def first_tripped(options: WatchdogOptions, samples: Sequence[WatchdogSample]) -> Optional[Trip]:
    """The first rule `samples` (oldest first, the newest last) trip, or None (always, when not `enabled`)."""
    if not samples or not options.enabled:
        return None
    now = samples[-1]
    oldest = next(s for s in samples if now.at - s.at <= options.window_s)
    for rule in (_banned, _non_finite, _host_memory, _device_memory, _stalled, _averaging, _renewal):
        trip = rule(options, oldest, now)
        if trip is not None:
            return trip
    return None


def _banned(options: WatchdogOptions, oldest: WatchdogSample, now: WatchdogSample) -> Optional[Trip]:
    return Trip("banned", {}) if options.leave_when_banned and now.banned else None


def _non_finite(options: WatchdogOptions, oldest: WatchdogSample, now: WatchdogSample) -> Optional[Trip]:
    count = now.non_finite - oldest.non_finite
    if options.max_non_finite and count >= options.max_non_finite:
        return Trip("non_finite_gradients", {"count": count, "max": options.max_non_finite,
                                             "window_s": options.window_s})
    return None


def _share(rule: str, used: Optional[int], total: Optional[int], bound: float) -> Optional[Trip]:
    if used is None or not total:
        return None
    share = used / total
    return Trip(rule, {"share": round(share, 4), "bound": bound, "bytes": used, "total_bytes": total}) \
        if share >= bound else None


def _host_memory(options: WatchdogOptions, oldest: WatchdogSample, now: WatchdogSample) -> Optional[Trip]:
    return _share("host_memory", now.host_bytes, now.host_total_bytes, options.host_memory_share)


def _device_memory(options: WatchdogOptions, oldest: WatchdogSample, now: WatchdogSample) -> Optional[Trip]:
    return _share("device_memory", now.device_bytes, now.device_total_bytes, options.device_memory_share)


def _stalled(options: WatchdogOptions, oldest: WatchdogSample, now: WatchdogSample) -> Optional[Trip]:
    if options.stall_s and now.compute_wait_s >= options.stall_s:
        return Trip("compute_stalled", {"waited_s": round(now.compute_wait_s, 1), "bound_s": options.stall_s})
    return None


def _averaging(options: WatchdogOptions, oldest: WatchdogSample, now: WatchdogSample) -> Optional[Trip]:
    failed = now.failed_rounds - oldest.failed_rounds
    committed = now.committed_rounds - oldest.committed_rounds
    if options.max_failed_rounds and failed >= options.max_failed_rounds and committed == 0:
        return Trip("averaging_failed", {"failed": failed, "committed": committed, "max": options.max_failed_rounds,
                                         "window_s": options.window_s})
    return None


def _renewal(options: WatchdogOptions, oldest: WatchdogSample, now: WatchdogSample) -> Optional[Trip]:
    if options.max_renewal_failures and now.renewal_failures >= options.max_renewal_failures:
        return Trip("renewal_failing", {"failures": now.renewal_failures, "max": options.max_renewal_failures})
    return None
