"""Metrics of a worker's averaging rounds with the other replicas of its stage.

What `AveragingStats` (node/averaging/stats.py) records after each round lands here, and its
`snapshot()` (the stats file the demo sums per stage) is read back from these same series, so
the summary and a Prometheus scrape can never disagree.

- Rounds by outcome (committed, alone, failed, rejected, cancelled), rounds whose result was
  applied, and rounds skipped because they came due while another ran; what the robust
  aggregation rejected, by reason (dht/robust.py), and the coordinates it clipped (a count of
  values, not of contributions: an honest group has a few).
- Per round: the group size and, for committed rounds, the share of the vector whose average
  arrived (`_ratio`, 0..1), the duration, and the bytes each way (estimated, see dht/averaging.py).
- Local steps from a round's snapshot to its apply (the lag that costs convergence) and the
  compute thread's time spent on snapshots and applies.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from agora.monitor.worker_metrics import DURATION_BUCKETS

__all__ = ["AveragingMetrics", "GROUP_SIZE_BUCKETS", "LAG_BUCKETS"]

# Whole numbers up to 8 so that small groups are counted exactly (the stats' group_sizes).
GROUP_SIZE_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128)
LAG_BUCKETS = (0, 1, 2, 3, 4, 5, 8, 13, 21, 50, 100)
RECEIVED_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


class AveragingMetrics:
    def __init__(self, registry: CollectorRegistry, method: str):
        self.method = method
        self.rounds = Counter("agora_averaging_rounds", "Averaging rounds by outcome", ["method", "outcome"],
                              registry=registry)
        self.applied = Counter("agora_averaging_rounds_applied", "Rounds whose result changed the parameters",
                               ["method"], registry=registry)
        self.skipped = Counter("agora_averaging_rounds_skipped",
                               "Rounds not run because they came due while another round ran", ["method"],
                               registry=registry)
        self.rejections = Counter("agora_averaging_rejections", "Contributions the robust aggregation rejected, by "
                                  "reason", ["method", "reason"], registry=registry)
        self.clipped_coordinates = Counter("agora_averaging_clipped_coordinates",
                                           "Coordinates the robust aggregation moved to the edge of their band "
                                           "(a contribution's per-coordinate bound, or an average's move bound)",
                                           ["method"], registry=registry)
        self.refused = Counter("agora_averaging_refused_announcements",
                               "Other replicas' round announcements refused, by reason (a round past the stage's "
                               "schedule)", ["method", "reason"], registry=registry)
        self.group_size = Histogram("agora_averaging_group_size", "Replicas in a round's group, this one included",
                                    ["method"], buckets=GROUP_SIZE_BUCKETS, registry=registry)
        self.received = Histogram("agora_averaging_received_ratio",
                                  "Share of the vector whose average arrived, per committed round", ["method"],
                                  buckets=RECEIVED_BUCKETS, registry=registry)
        self.duration = Histogram("agora_averaging_round_duration_seconds", "Matchmaking plus all-reduce, per round",
                                  ["method"], buckets=DURATION_BUCKETS + (120.0, 300.0), registry=registry)
        self.max_duration = Gauge("agora_averaging_round_duration_max_seconds", "The longest round so far",
                                  ["method"], registry=registry)
        self.sent = Counter("agora_averaging_sent_bytes", "Bytes sent in all-reduces (estimated)", ["method"],
                            registry=registry)
        self.received_bytes = Counter("agora_averaging_received_bytes", "Bytes received in all-reduces (estimated)",
                                      ["method"], registry=registry)
        self.lag = Histogram("agora_averaging_apply_lag_steps", "Local steps from a round's snapshot to its apply",
                             ["method"], buckets=LAG_BUCKETS, registry=registry)
        self.max_lag = Gauge("agora_averaging_apply_lag_max_steps", "The largest apply lag so far", ["method"],
                             registry=registry)
        self.compute_blocked = Counter("agora_averaging_compute_blocked_seconds",
                                       "Compute-thread time spent on averaging snapshots and applies", ["method"],
                                       registry=registry)
        self.last_round = Gauge("agora_averaging_last_round", "Number of the last round this replica ran",
                                ["method"], registry=registry)
