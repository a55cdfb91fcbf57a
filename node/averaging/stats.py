"""`AveragingStats`: one worker's averaging rounds, kept in the process's metrics registry.

The loop (node/averaging/loop.py) records each round here, and counts skipped rounds and the
compute thread's time; every number lives in the Prometheus series of
monitor/averaging_metrics.py (one bookkeeping), and `snapshot()` reads them back as the plain
dict the join daemon writes on exit and the demo sums per stage. Without a registry (tests, a
tool) the stats keep a private one.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from prometheus_client import CollectorRegistry

from agora.dht.averaging import OUTCOMES, RoundResult
from agora.monitor.averaging_metrics import GROUP_SIZE_BUCKETS, AveragingMetrics
from agora.monitor.metrics import sample_value

__all__ = ["AveragingStats"]


class AveragingStats:
    """Counters of one worker's rounds; `snapshot()` is what the demo reads."""

    def __init__(self, method: str, clock: Callable[[], float] = time.monotonic,
                 registry: Optional[CollectorRegistry] = None):
        self.method = method
        self._clock = clock
        self.started = clock()
        self._registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.metrics = AveragingMetrics(self._registry, method)
        for outcome in OUTCOMES:  # every outcome present from the start, at 0
            self.metrics.rounds.labels(method=method, outcome=outcome)
        self._lock = threading.Lock()  # the maxima are read-modify-write
        self._rejection_reasons: set[str] = set()  # the label values seen, to read the counts back
        self._refusal_reasons: set[str] = set()
        self.last_round: Optional[int] = None
        self.local_steps = 0  # the worker's optimizer steps, as last seen by the loop
        self.vector_elements = 0
        self.parameters = 0

    def _value(self, name: str, **labels: str) -> float:
        return sample_value(self._registry, name, {"method": self.method, **labels})

    @property
    def rounds(self) -> dict[str, int]:
        return {outcome: int(self._value("agora_averaging_rounds_total", outcome=outcome)) for outcome in OUTCOMES}

    @property
    def applied(self) -> int:
        return int(self._value("agora_averaging_rounds_applied_total"))

    @property
    def skipped(self) -> int:
        return int(self._value("agora_averaging_rounds_skipped_total"))

    @property
    def compute_blocked_s(self) -> float:
        return self._value("agora_averaging_compute_blocked_seconds_total")

    def count_skipped(self, rounds: int) -> None:
        if rounds:
            self.metrics.skipped.labels(method=self.method).inc(rounds)

    def add_compute_blocked(self, seconds: float) -> None:
        """From the compute thread (prometheus_client's values are thread-safe)."""
        self.metrics.compute_blocked.labels(method=self.method).inc(seconds)

    def record(self, result: RoundResult, applied: bool, lag_steps: int = 0) -> None:
        metrics, method = self.metrics, self.method
        metrics.rounds.labels(method=method, outcome=result.outcome).inc()
        if applied:
            metrics.applied.labels(method=method).inc()
            metrics.lag.labels(method=method).observe(lag_steps)
        metrics.group_size.labels(method=method).observe(max(1, result.group_size))
        for reason, count in result.rejections.items():  # by reason (dht/robust.py), over every round
            metrics.rejections.labels(method=method, reason=reason).inc(count)
            self._rejection_reasons.add(reason)
        if result.clipped_coordinates:
            metrics.clipped_coordinates.labels(method=method).inc(result.clipped_coordinates)
        if result.outcome == "committed":
            metrics.received.labels(method=method).observe(result.received_fraction)
        metrics.duration.labels(method=method).observe(result.duration_s)
        metrics.sent.labels(method=method).inc(result.bytes_sent)
        metrics.received_bytes.labels(method=method).inc(result.bytes_received)
        with self._lock:
            if applied:  # the first apply gives the maximum its sample: a lag of 0 is shown as 0, not as no data
                max_lag = metrics.max_lag.labels(method=method)
                if lag_steps > self._value("agora_averaging_apply_lag_max_steps"):
                    max_lag.set(lag_steps)
            if result.duration_s > self._value("agora_averaging_round_duration_max_seconds"):
                metrics.max_duration.labels(method=method).set(result.duration_s)
        metrics.last_round.labels(method=method).set(result.round)
        self.last_round = result.round

    def count_refused(self, reason: str, count: int = 1) -> None:
        """Announcements of other replicas this one refused (dht/round_board.py's RoundBoard says why)."""
        self.metrics.refused.labels(method=self.method, reason=reason).inc(count)
        self._refusal_reasons.add(reason)

    @property
    def refused(self) -> dict[str, int]:
        return {reason: int(self._value("agora_averaging_refused_announcements_total", reason=reason))
                for reason in sorted(self._refusal_reasons)}

    @property
    def rejections(self) -> dict[str, int]:
        return {reason: int(self._value("agora_averaging_rejections_total", reason=reason))
                for reason in sorted(self._rejection_reasons)}

    def _group_sizes(self) -> dict[str, int]:
        """Rounds per group size, from the histogram's whole-number buckets (exact up to 8)."""
        sizes, below = {}, 0.0
        for bound in GROUP_SIZE_BUCKETS:
            cumulative = self._value("agora_averaging_group_size_bucket", le=str(float(bound)))
            if cumulative > below:
                sizes[str(bound)] = int(cumulative - below)
            below = cumulative
        return sizes

    def snapshot(self) -> dict:
        rounds = self.rounds
        total = sum(rounds.values())
        wall = max(1e-9, self._clock() - self.started)
        applied = self.applied
        received = self._value("agora_averaging_received_ratio_sum")
        duration = self._value("agora_averaging_round_duration_seconds_sum")
        lag = self._value("agora_averaging_apply_lag_steps_sum")
        blocked = self.compute_blocked_s
        return {
            "method": self.method,
            "rounds": total,
            "rounds_by_outcome": rounds,
            "applied": applied,
            "skipped": self.skipped,
            "group_sizes": self._group_sizes(),
            "rejections": self.rejections,
            "clipped_coordinates": int(self._value("agora_averaging_clipped_coordinates_total")),
            "refused_announcements": self.refused,
            "mean_received_fraction": received / rounds["committed"] if rounds["committed"] else None,
            "mean_duration_s": duration / total if total else None,
            "max_duration_s": self._value("agora_averaging_round_duration_max_seconds"),
            "mean_lag_steps": lag / applied if applied else None,
            "max_lag_steps": int(self._value("agora_averaging_apply_lag_max_steps")),
            "bytes_sent": int(self._value("agora_averaging_sent_bytes_total")),
            "bytes_received": int(self._value("agora_averaging_received_bytes_total")),
            "local_steps": self.local_steps,
            "vector_elements": self.vector_elements,
            "parameters": self.parameters,
            "compute_blocked_s": round(blocked, 6),
            "wall_s": round(wall, 3),
            "compute_blocked_fraction": blocked / wall,
            "last_round": self.last_round,
        }
