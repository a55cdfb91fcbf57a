"""What the verifier (node/trainer/verification.py) does when a stage's only worker trips a CUSUM.

With one worker on a stage the reference is that worker's own history, and there is no peer to tell
an honest stage-wide shift from a lie. A loss spike is one: a sole tail's input gradients grew
about 9-fold within a few steps as the loss rose (2.2 in log-RMS, 9 of its spreads), every reply an
outlier kept out of its own reference, so the CUSUM tripped, the honest tail was flagged, and its
stage, and the run, were left with no worker (demo, two stages, joiners, a loaded machine). So a
lone worker is never flagged on its first trip. Design choices:

- **Excused, and checked at once.** Its CUSUMs restart and the trainer checks it at once against
  its own held-out answers (node/trainer/gradient_checks.py, `check_now`), which tell a wrong
  scale, sign, noise or stale answer from an honest one with any number of replicas; a failed
  check puts it on probation and a second failure flags it there. The worker is now on notice
  (`LoneNotice`): the replies it was held to stay its reference, at the weights it named at the
  trip however far its weights move on (`held_to`), so a liar keeps standing off it. Held to its
  newest weights instead, its lie would stand on weights `STALE_VERSIONS` past any reply kept, go
  unjudged and become its history (node/trainer/reply_reference.py).
- **Vouched for, then a new history.** Once a self check of it passed since the trip and it is off
  probation (no check undecided, none failed and not cleared), the statistics cannot overrule that:
  its history restarts (its replies leave the window) and nothing of it is judged until `warmup` new
  replies, so an honest worker at a new level does not trip again 4 replies later against its frozen
  past. Its notice ends; a later trip is a new one (excused, checked again).
- **The bound.** A trip while on notice flags the worker, unless its self checks are still at it (on
  probation: its check at once undecided, its probes queued behind its work or answered on newer
  weights, or a failure not cleared, which a second failure turns into a flag there): then the trip
  is held (its CUSUMs restart, no flag), for `window` of its replies after the first trip at most,
  so a worker refusing its probes, whose checks never decide, is flagged at its next trip after
  that. With self checks off, or none of it passed, nothing vouches: a x10 lie trips it again some
  five replies on and is flagged. So a lone worker gets one excuse per passed self check, never two
  on the statistics' word alone.

What this cannot catch: a lone worker whose lie its own self checks pass (a consistent transform of
a head's outputs, told in its replays too: replays match; or a worker that recognises its probes):
one trip, a passed check, and its lie becomes its history. And it costs time: a liar whose checks it
keeps undecided (refusing its probes) lies for up to `window` of its replies past its first trip,
and every lone liar for one trip more than before. Without self checks (--gradient-check-share 0)
nothing vouches, and an honest lone worker's lasting jump is flagged at its second trip.

Pure: no torch, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoneNotice", "held_to", "lone_trip", "vouched"]


@dataclass(frozen=True)
class LoneNotice:
    """A lone worker's excused trip not yet vouched for by a self check."""

    since: int  # the worker's replies of the trip's kind at the trip
    passes: int  # its self checks passed by then
    version: int | None  # the weights the tripping reply named (None: not known)


def held_to(notice: LoneNotice | None, version: int | None) -> int | None:
    """The weights version whose replies a lone worker's reply on `version` is held to: its own, or, on
    notice, no later than the trip's (module docstring)."""
    if notice is None or notice.version is None or version is None:
        return version
    return min(version, notice.version)


def lone_trip(notice: LoneNotice | None, replies: int, window: int, checking: bool) -> str:
    """What a lone worker's trip that nothing else explains comes to (module docstring): "excuse" (not on
    notice), "hold" (on notice, its check still undecided, within `window` of its replies since the
    first trip) or "flag". `replies`: its replies of that kind so far; `checking`: whether a self check
    of it is undecided or failed and not cleared."""
    if notice is None:
        return "excuse"
    if checking and replies - notice.since < window:
        return "hold"
    return "flag"


def vouched(notice: LoneNotice | None, passes: int, checking: bool) -> bool:
    """Whether a self check passed since the worker's excused trip and none is undecided, or failed and
    not cleared: its history may restart at its new level."""
    return notice is not None and passes > notice.passes and not checking
