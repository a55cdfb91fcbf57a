"""`AveragingStats`: the counters of one worker's averaging rounds (node/averaging/loop.py).

Plain numbers, updated by the loop after each round (and, for `compute_blocked_s`, on the
compute thread); `snapshot()` is the dict the join daemon writes on exit and the demo merges.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Optional

from agora.dht.averaging import OUTCOMES, RoundResult

__all__ = ["AveragingStats"]


class AveragingStats:
    """Counters of one worker's rounds; `snapshot()` is what metrics and the demo read."""

    def __init__(self, method: str, clock: Callable[[], float] = time.monotonic):
        self.method = method
        self._clock = clock
        self.started = clock()
        self.rounds: Counter[str] = Counter({outcome: 0 for outcome in OUTCOMES})
        self.applied = 0  # rounds whose result changed the parameters
        self.skipped = 0  # rounds that came due while another one ran
        self.group_sizes: Counter[int] = Counter()
        self.rejections: Counter[str] = Counter()  # by reason (dht/robust.py), over every round
        self.received_sum = 0.0
        self.duration_sum = 0.0
        self.duration_max = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.compute_blocked_s = 0.0  # written on the compute thread only
        self.lag_steps_sum = 0  # applied rounds: local steps from snapshot to apply
        self.lag_steps_max = 0
        self.last_round: Optional[int] = None
        self.local_steps = 0  # the worker's optimizer steps, as last seen by the loop
        self.vector_elements = 0
        self.parameters = 0

    def record(self, result: RoundResult, applied: bool, lag_steps: int = 0) -> None:
        self.rounds[result.outcome] += 1
        self.applied += int(applied)
        if applied:
            self.lag_steps_sum += lag_steps
            self.lag_steps_max = max(self.lag_steps_max, lag_steps)
        self.group_sizes[max(1, result.group_size)] += 1
        self.rejections.update(result.rejections)
        if result.outcome == "committed":
            self.received_sum += result.received_fraction
        self.duration_sum += result.duration_s
        self.duration_max = max(self.duration_max, result.duration_s)
        self.bytes_sent += result.bytes_sent
        self.bytes_received += result.bytes_received
        self.last_round = result.round

    def snapshot(self) -> dict:
        total = sum(self.rounds.values())
        wall = max(1e-9, self._clock() - self.started)
        return {
            "method": self.method,
            "rounds": total,
            "rounds_by_outcome": dict(self.rounds),
            "applied": self.applied,
            "skipped": self.skipped,
            "group_sizes": {str(size): n for size, n in sorted(self.group_sizes.items())},
            "rejections": dict(sorted(self.rejections.items())),
            "mean_received_fraction": (self.received_sum / self.rounds["committed"]
                                       if self.rounds["committed"] else None),
            "mean_duration_s": self.duration_sum / total if total else None,
            "max_duration_s": self.duration_max,
            "mean_lag_steps": self.lag_steps_sum / self.applied if self.applied else None,
            "max_lag_steps": self.lag_steps_max,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "local_steps": self.local_steps,
            "vector_elements": self.vector_elements,
            "parameters": self.parameters,
            "compute_blocked_s": round(self.compute_blocked_s, 6),
            "wall_s": round(wall, 3),
            "compute_blocked_fraction": self.compute_blocked_s / wall,
            "last_round": self.last_round,
        }
