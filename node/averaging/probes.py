"""When the averaging loop reads the stage's round board, and what it reads. Pure: the clock and the
step count are passed in.

A probe reads the round announcements (a round another replica waits in) and the live replica
count, each a DHT get that visits the stage's nearest peers. A training replica probes every
`base_s` (a quarter of the matchmaking window), so a slower replica joins the fastest one's round
well inside the window. A replica whose optimizer step count has not moved since its previous
probe is quiet: with no trainer it would otherwise spend most of its DHT traffic, and the peers'
CPU that answers it, on these reads. Design choices:

- A quiet probe comes every `quiet_s` (half the matchmaking window): an announcement stays open
  while its writer waits out the window for the replicas it expects, so a quiet replica still sees
  it in time to join (a replica that gets no completed-batch reports while its stage trains keeps
  averaging with it).
- A quiet probe reads only the announcements. The replica count matters only when a round
  starts, and a round re-reads it when it is older than `replicas_s` (node/averaging/loop.py), so
  skipping it costs a quiet replica one read when it does join a round, not one per probe.
- The replica count is read again when something says it moved, at most every `replicas_s` (twice
  the quiet interval: the matchmaking window), and otherwise every `settled_s` (ten windows). It is
  the stage's worker records, each rewritten every heartbeat, so a read of it carries nearly all R
  of them, and R grows with the swarm: read every window, it was the largest share of a worker's
  DHT bytes at 64 nodes, and the one that grew like N (bench/results/dht_scale.md). What says the
  count moved is what the replica sees anyway (`count_in_doubt`, called by the loop): a round whose
  group was not the size the count expected (a replica left, or one came and joined), a failed
  round, an announcement by a replica the count did not include (a newcomer announcing). A count
  that stays wrong costs rounds that wait out their window for a replica that has gone, or start
  without one that has just come; the first such round is itself the evidence, so a departure or a
  join costs about one round more than a count read every window would, and `settled_s` bounds
  what nothing reports. A count stands only once two reads a window apart agree: replicas that
  start together count each other as they come up, and one that read 12 of 16 would otherwise
  form its rounds at 12, leaving out the 4 it had not seen for up to `settled_s` (5% of the
  groups at R = 16 in bench/averaging_scale.py). A replica that counts itself alone keeps reading
  every `replicas_s`: it runs no round with anyone, so nothing else would tell it that a newcomer
  came.
- The first probe after the count moves is due `base_s` after the previous probe (at once when
  that has passed): a replica whose stage starts training probes at the training pace from its
  first step, not after its quiet interval.
- No jitter: replicas probe from their own start times, and nothing aligns them afterwards.
"""

from __future__ import annotations

import math
from typing import Optional

__all__ = ["SETTLED_WINDOWS", "ProbeSchedule", "probe_intervals"]

# A count nothing has put in doubt is read again after this many `replicas_s` (the module docstring).
SETTLED_WINDOWS = 10


def probe_intervals(matchmaking_s: float, probe_s: Optional[float] = None,
                    quiet_probe_s: Optional[float] = None) -> tuple[float, float]:
    """(base_s, quiet_s) for a matchmaking window, unless given: a quarter of the window (well inside
    it, so a slower replica joins the fastest one's round; 0.25 s to 10 s), and half of it quiet."""
    base = probe_s if probe_s is not None else min(10.0, max(0.25, matchmaking_s / 4))
    return base, max(base, quiet_probe_s if quiet_probe_s is not None else matchmaking_s / 2)


class ProbeSchedule:
    """The next probe's time and kind, from the probes done so far and the replica's step count."""

    def __init__(self, base_s: float, quiet_s: float, replicas_s: Optional[float] = None,
                 settled_s: Optional[float] = None):
        if not 0 < base_s <= quiet_s:
            raise ValueError(f"probe intervals: need 0 < base_s <= quiet_s, got {base_s:g} and {quiet_s:g}")
        self.base_s = base_s
        self.quiet_s = quiet_s
        self.replicas_s = 2 * quiet_s if replicas_s is None else replicas_s
        if not self.replicas_s >= base_s:
            raise ValueError(f"probe intervals: need replicas_s >= base_s, got {self.replicas_s:g} and {base_s:g}")
        self.settled_s = SETTLED_WINDOWS * self.replicas_s if settled_s is None else settled_s
        if not self.settled_s >= self.replicas_s:
            raise ValueError(f"probe intervals: need settled_s >= replicas_s, got {self.settled_s:g} and "
                             f"{self.replicas_s:g}")
        self._probed_at = -math.inf
        self._replicas_at = -math.inf
        self._in_doubt = True  # nothing read yet
        self.count: Optional[int] = None  # the last count read
        self._steps_at_probe: Optional[int] = None
        self._next = 0.0  # the first probe is due at once

    def quiet(self, steps: int) -> bool:
        """Whether the step count is where the previous probe saw it (never before a first probe)."""
        return self._steps_at_probe is not None and steps == self._steps_at_probe

    def due_in(self, now: float, steps: int) -> float:
        """Seconds until the next probe (0 or less: due now)."""
        if not self.quiet(steps):
            return min(self._next, self._probed_at + self.base_s) - now
        return self._next - now

    def reads_replicas(self, steps: int, now: float) -> bool:
        """Whether a probe now reads the live replica count besides the announcements."""
        return not self.quiet(steps) and self.replicas_due(now)

    def replicas_due(self, now: float) -> bool:
        """Whether the replica count is older than `replicas_s` and in doubt, or older than
        `settled_s` (or was never read)."""
        return now - self._replicas_at >= (self.replicas_s if self._in_doubt else self.settled_s)

    def replicas_read(self, now: float, count: int) -> None:
        """The replica count was read at `now` (by a probe or by a round about to start): `count`.
        It stands once two reads in a row agree (a stage still filling up, or emptying, moves
        between them), and never while it is one: no round of a lone replica would show a newcomer."""
        self._replicas_at = now
        self._in_doubt = count <= 1 or count != self.count
        self.count = count

    def count_in_doubt(self) -> None:
        """Something the replica saw says the count moved: read it again `replicas_s` after the last read."""
        self._in_doubt = True

    def probed(self, now: float, steps: int) -> None:
        """A probe was done at `now`, seeing step count `steps`."""
        quiet = self.quiet(steps)
        self._probed_at, self._steps_at_probe = now, steps
        self._next = now + (self.quiet_s if quiet else self.base_s)

    def look_now(self) -> None:
        """Probe at the next turn (the others may be waiting in another round)."""
        self._next = 0.0
