"""The verdicts of `agora-node doctor` (node/doctor_command.py gathers what they judge): whether
this machine would be admitted to a run, and useful in it, before it queues to join.

Each check is one ``Check``: its name, a verdict (ok / WARN / FAIL / unknown), the value found, the
run's floor where the run states one, and the fix in one line. Design choices:

- Pure functions of what was measured, so each verdict is tested without sockets or devices
  (tests/unit/test_doctor.py); the measuring is the admission's own (auth/join_check.py,
  node/plan.py), never a second version of it.
- The link and hardware floors are judged by the authorizer's comparison (auth/policy.py
  ``floor_verdicts``): a doctor that passes a floor a Join then refuses would be worse than none.
- ``unknown`` is for what could not be judged (the authorizer unreachable, a run that states no
  versions, a check that needs an earlier one). ``WARN`` is for what admission does not refuse but
  makes this machine less useful (a slow link to a member of its stage, a stage it would slow
  down; node/doctor_stage.py). Only FAIL makes the exit code 1: an unknown is said, not guessed,
  and a warning is advice.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Optional, Sequence, Union

from agora.auth.policy import FloorVerdict

__all__ = ["OK", "WARN", "FAIL", "UNKNOWN", "Check", "authorizer_check", "refused_check", "floor_checks",
           "reachability_check", "clock_check", "memory_check", "disk_check", "version_check", "unknown",
           "exit_code", "format_line", "as_json"]

OK, WARN, FAIL, UNKNOWN = "ok", "WARN", "FAIL", "unknown"
GiB = 1 << 30

Value = Union[float, int, str, None]


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str
    value: Value = None
    floor: Value = None
    unit: str = ""
    fix: str = ""  # empty when ok
    detail: str = ""  # what the value means, or why it is unknown
    against: str = "floor"  # what ``floor`` is to the value: the run's floor, or what is free, needed, tolerated


def unknown(name: str, why: str) -> Check:
    return Check(name, UNKNOWN, detail=why)


def authorizer_check(address: str, run_id: Optional[str], error: Optional[str], *,
                     untrusted: bool = False) -> Check:
    """The authorizer answered GetRun with a run description that checks out against the pinned root
    (``untrusted``: it answered, but under another root than the join file pins)."""
    if error is not None and untrusted:
        return Check("authorizer", FAIL, address, detail=error,
                     fix="get the run's join file from its operator again: this one pins another CA")
    if error is not None:
        return Check("authorizer", FAIL, address, detail=error,
                     fix="check the join file's address and that the authorizer runs; a firewall must let this "
                         "machine reach it over TCP")
    return Check("authorizer", OK, address, detail=f"run {run_id!r} described")


def refused_check(field: str, reason: str) -> Check:
    """A Join would be refused before its measurements (banned, fingerprint, stage, announced address)."""
    fixes = {"banned": "ask the run's operator why this node was banned",
             "stage": "pass a --stage the run has",
             "announce_host": "pass --announce-host with the address peers reach this machine on",
             "announce_port": "pass a --port between 1 and 65535"}
    fix = fixes.get(field) or ("drop the run flags that change it: the run's config, as the authorizer serves "
                               "it, is what a node must run" if field.startswith("fingerprint.") else reason)
    return Check("admission", FAIL, field, detail=reason, fix=fix)


_FLOOR_NAMES = {"max_rtt_ms": "rtt", "min_upload_mbit": "upload", "min_download_mbit": "download",
                "min_accelerator_gb": "accelerator", "min_ram_gb": "ram"}
_FLOOR_FIXES = {
    "max_rtt_ms": "join from a machine nearer the authorizer, on a wired link rather than Wi-Fi",
    "min_upload_mbit": "a faster uplink (or nothing else uploading now): the run needs this much each way",
    "min_download_mbit": "a faster downlink (or nothing else downloading now)",
    "min_accelerator_gb": "join from a machine with a larger accelerator (--device picks which one)",
    "min_ram_gb": "join from a machine with more RAM",
}


def floor_checks(verdicts: Sequence[FloorVerdict]) -> list[Check]:
    """The authorizer's comparison of each floor (auth/policy.py ``floor_verdicts``), one check each."""
    checks = []
    for verdict in verdicts:
        disabled = verdict.floor == 0 or math.isinf(verdict.floor)
        checks.append(Check(
            _FLOOR_NAMES.get(verdict.name, verdict.name), OK if verdict.passed else FAIL,
            round(verdict.measured, 1), None if disabled else verdict.floor, verdict.unit,
            fix="" if verdict.passed else _FLOOR_FIXES.get(verdict.name, verdict.reason),
            detail=verdict.reason or (f"{verdict.what}; this run sets no floor" if disabled else verdict.what)))
    return checks


def reachability_check(announce: str, unreachable: str) -> Check:
    """The authorizer's dial-back to the address this node would announce (``unreachable``: its
    refusal line, empty when the listener answered)."""
    if not unreachable:
        return Check("reachability", OK, announce, detail="the authorizer dialled this node back")
    return Check("reachability", FAIL, announce, detail=unreachable,
                 fix="open or forward that TCP port to this machine, or pass --announce-host/--port with an "
                     "address the internet reaches it on")


def clock_check(skew_s: float, tolerated_s: float) -> Check:
    """This machine's clock against the authorizer's: a credential is back-dated by ``tolerated_s``,
    so a clock behind by more sees it not yet valid (and ahead by more, expired early)."""
    passed = abs(skew_s) <= tolerated_s
    side = "behind" if skew_s > 0 else "ahead of"
    return Check("clock", OK if passed else FAIL, round(skew_s, 3), tolerated_s, "s", against="tolerated",
                 detail=f"this clock is {abs(skew_s):.3f} s {side} the authorizer's",
                 fix="" if passed else "synchronise this machine's clock (NTP: `timedatectl set-ntp true`)")


def memory_check(stage: int, kind: str, peak_bytes: int, free_bytes: int, where: str, *,
                 host_bytes: int = 0, host_free_bytes: Optional[int] = None, problem: Optional[str] = None) -> Check:
    """A stage's memory plan against what is free: its peak on the device (``problem``: the plan's
    own line when short, node/plan.py), and what a CUDA worker keeps page-locked on the host."""
    name = f"memory stage {stage}"
    detail = f"{kind}: peak {peak_bytes / GiB:.2f} GiB on {where}, {free_bytes / GiB:.2f} GiB free"
    if problem is not None or peak_bytes > free_bytes:
        return Check(name, FAIL, round(peak_bytes / GiB, 2), round(free_bytes / GiB, 2), "GiB", detail=detail,
                     against="free", fix=problem or "free memory on the device, or see `agora-node plan` for what "
                                                    "shrinks the stage")
    if host_bytes and host_free_bytes is not None and host_bytes > host_free_bytes:
        return Check(name, FAIL, round(host_bytes / GiB, 2), round(host_free_bytes / GiB, 2), "GiB", against="free",
                     detail=f"{kind}: {host_bytes / GiB:.2f} GiB page-locked on the host, "
                            f"{host_free_bytes / GiB:.2f} GiB of RAM free",
                     fix="free RAM, or pass --pinned-weights 0")
    return Check(name, OK, round(peak_bytes / GiB, 2), round(free_bytes / GiB, 2), "GiB", detail=detail,
                 against="free")


def disk_check(directory: str, free_bytes: int, needed_bytes: int, copies: int) -> Check:
    """Free disk where checkpoints go against ``copies`` checkpoints of ``needed_bytes`` / ``copies`` each."""
    detail = (f"{free_bytes / GiB:.2f} GiB free in {directory}; {copies} checkpoints of the stage need "
              f"{needed_bytes / GiB:.2f} GiB")
    if free_bytes < needed_bytes:
        return Check("disk", FAIL, round(free_bytes / GiB, 2), round(needed_bytes / GiB, 2), "GiB", detail=detail,
                     against="needed", fix="free disk space there, or pass --checkpoint-dir on a larger disk")
    return Check("disk", OK, round(free_bytes / GiB, 2), round(needed_bytes / GiB, 2), "GiB", detail=detail,
                 against="needed")


def version_check(running: Mapping[str, str], stated: Mapping[str, str]) -> Check:
    """The versions this machine runs against those the run states (unknown when it states none)."""
    value = ", ".join(f"{name} {version}" for name, version in running.items())
    if not stated:
        return Check("versions", UNKNOWN, value, detail="the run states no versions")
    differ = [f"{name} {running.get(name, 'missing')} (the run: {version})" for name, version in stated.items()
              if running.get(name) != version]
    floor = ", ".join(f"{name} {version}" for name, version in stated.items())
    if differ:
        return Check("versions", FAIL, value, floor, detail="; ".join(differ), against="the run's",
                     fix="install the versions the run states: " + floor)
    return Check("versions", OK, value, floor, against="the run's")


def exit_code(checks: Iterable[Check]) -> int:
    """0 when no check failed, else 1 (unknowns and warnings do not fail: they are said, not guessed)."""
    return 1 if any(check.verdict == FAIL for check in checks) else 0


def _shown(value: Value, unit: str) -> str:
    if value is None:
        return ""
    return (f"{value:g} {unit}" if isinstance(value, float) else f"{value} {unit}").strip()


def format_line(check: Check) -> str:
    """One line: verdict, name, value against the floor, what it means, and the fix when not ok."""
    value = _shown(check.value, check.unit)
    if check.floor is not None:
        value += f" ({check.against} {_shown(check.floor, check.unit)})"
    parts = [f"{check.verdict:<7}", f"{check.name:<16}", value]
    if check.detail:
        parts.append(f"- {check.detail}")
    if check.fix:
        parts.append(f"- fix: {check.fix}")
    return " ".join(part for part in parts if part).rstrip()


def as_json(checks: Sequence[Check]) -> str:
    """One JSON object: every check (name, verdict, value, floor, against, unit, fix, detail) and the exit code."""
    def plain(value: Value) -> Value:
        return None if isinstance(value, float) and not math.isfinite(value) else value
    rows = [{key: plain(item) for key, item in asdict(check).items()} for check in checks]
    return json.dumps({"checks": rows, "exit_code": exit_code(checks)}, sort_keys=True)
