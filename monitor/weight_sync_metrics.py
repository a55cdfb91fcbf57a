"""Metrics of a joining replica's weight sync: the donors it refused and what checking a state cost.

Design choices:

- Refusals by reason, not by donor: a peer id is no label (monitor/naming.py); the donor is named
  in the `state_donor_refused` log line (node/membership/state_download.py), once per donor and
  reason. Reasons (node/membership/state_check.py): `step` (it announced a step far from the one
  its stage's members agree on, so it was never asked), `state` (what it sent is not this stage's),
  `nonfinite`, `moments` (Adam moments beyond any Adam run's), `scale` (a tensor's size far from a
  second member's), `sketch` (a tensor's random projection far from a second member's).
- The cost of checking beside the download's: seconds from a complete download to the verdict,
  and the sketch bytes the second members sent.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from agora.monitor.worker_metrics import DURATION_BUCKETS

__all__ = ["WeightSyncMetrics"]


class WeightSyncMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.refusals = Counter("agora_worker_state_refusals", "Donors whose state (or announced step) this replica "
                                "refused in weight sync, once per donor and reason", ["reason"], registry=registry)
        self.check = Histogram("agora_worker_state_check_seconds", "Time from a complete state download to its "
                               "verdict (local checks, second members' sketches, comparison)", buckets=DURATION_BUCKETS,
                               registry=registry)
        self.sketch_bytes = Counter("agora_worker_state_sketch_bytes", "Sketch bytes second members sent to check "
                                    "downloaded states with", registry=registry)

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason=reason).inc()

    def checked(self, seconds: float, sketch_bytes: int) -> None:
        self.check.observe(seconds)
        self.sketch_bytes.inc(sketch_bytes)
