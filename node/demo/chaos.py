"""`demo --chaos SECONDS`: a random worker or trainer killed every SECONDS, and a newcomer in its place.

The victim is SIGKILLed with everything it started (a machine that vanished: no goodbye, no
checkpoint, its leases and DHT records left to expire). Its replacement joins as a new
contributor: a new identity and an empty state directory, so a worker goes through admission
and the sync phases and a trainer takes units from the lease queue like any other.

Design choices:
- The choice is a pure function of a seeded RNG and who is alive (`pick_victim`), so a chaos run
  is repeatable in what it kills (not in when, which follows the run's pace).
- A worker is a candidate only while its stage has another live replica: chaos tests how the
  swarm rides out churn, not what happens when a stage's only copy of its weights is lost (a
  worker's checkpoints are on the machine that vanished). Trainers are always candidates: the
  units they held come back when their leases run out.
- How long a worker newcomer took from its start to the stage's state and to `member` is read
  from its log afterwards (`join_seconds`). Member: the line that moves it there, or the one that
  starts it there (a replica alone in its stage). State: the line saying its download finished,
  else its first as a member. A newcomer killed, or still syncing when the run ends, has no
  member time: its "joined run" line (serving, in whatever phase) is not membership.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Mapping, Optional

__all__ = ["ChaosEvent", "Chaos", "pick_victim", "join_seconds"]

_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
# node/worker/worker.py's phase change, or node/membership/phases.py's first phase when it is member.
_MEMBER = re.compile(r"phase \w+ -> member\b|: phase member \(")
_STATE = re.compile(r": state downloaded from ")


def pick_victim(rng: random.Random, workers: Mapping[str, int], trainers: list[str]) -> Optional[str]:
    """A live process to kill: a worker (name -> stage) whose stage keeps another replica, or a trainer."""
    per_stage: dict[int, int] = {}
    for stage in workers.values():
        per_stage[stage] = per_stage.get(stage, 0) + 1
    candidates = sorted(name for name, stage in workers.items() if per_stage[stage] >= 2) + sorted(trainers)
    return rng.choice(candidates) if candidates else None


@dataclass
class ChaosEvent:
    at_s: float  # seconds into the run
    killed: str
    replacement: str
    role: str  # "worker" or "trainer"
    stage: Optional[int] = None


@dataclass
class Chaos:
    every_s: float
    seed: int = 0
    events: list[ChaosEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.every_s > 0:
            raise ValueError(f"--chaos: seconds between kills must be positive, got {self.every_s}")
        self._rng = random.Random(self.seed)
        self._next_s = self.every_s

    def due(self, elapsed_s: float) -> bool:
        return elapsed_s >= self._next_s

    def choose(self, elapsed_s: float, workers: Mapping[str, int], trainers: list[str]) -> Optional[str]:
        """The victim now (None: nobody may die); the next kill falls `every_s` later either way."""
        self._next_s = elapsed_s + self.every_s
        return pick_victim(self._rng, workers, trainers)


def join_seconds(log_path: Path, started_at: datetime) -> tuple[Optional[float], Optional[float]]:
    """Seconds from `started_at` (wall clock) to a worker newcomer's state and to member, from its
    log (see the module docstring); None for one it never reached (or no log)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None, None
    state = None
    for line in text.splitlines():
        stamp = _LOG_TIME.match(line)
        if stamp is None:
            continue
        seconds = (datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f") - started_at).total_seconds()
        if _MEMBER.search(line):
            return (seconds if state is None else state), seconds
        if state is None and _STATE.search(line):
            state = seconds
    return state, None
