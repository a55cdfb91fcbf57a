"""Metrics of a joining replica's weight sync: the donors it refused.

Design choices:

- Refusals by reason, not by donor: a peer id is no label (monitor/naming.py); the donor is named
  in the `state_donor_refused` log line (node/membership/state_download.py), once per donor and
  reason. `step`: it announced a step far from the one its stage's members agree on, so it was
  never asked.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

__all__ = ["WeightSyncMetrics"]


class WeightSyncMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.refusals = Counter("agora_worker_state_refusals", "Donors whose state (or announced step) this replica "
                                "refused in weight sync, once per donor and reason", ["reason"], registry=registry)

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason=reason).inc()
