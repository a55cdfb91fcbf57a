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
- How long a newcomer took from its start to `member` is read from its log afterwards
  (`joined_seconds`): the phase-change line, else the line saying it joined as one.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Mapping, Optional

__all__ = ["ChaosEvent", "Chaos", "pick_victim", "joined_seconds"]

_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_MEMBER = re.compile(r"phase \w+ -> member")


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


def joined_seconds(log_path: Path, started_at: datetime) -> Optional[float]:
    """Seconds from `started_at` (wall clock) to the newcomer's first line as a member, from its log."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    fallback = None
    for line in text.splitlines():
        stamp = _LOG_TIME.match(line)
        if stamp is None:
            continue
        when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f")
        if _MEMBER.search(line):
            return (when - started_at).total_seconds()
        if fallback is None and "joined run" in line:
            fallback = (when - started_at).total_seconds()
    return fallback
