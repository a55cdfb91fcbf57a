"""A worker's own count of what it served one trainer, read from the metrics endpoint it announced.

The ledger (monitor/ledger.py) holds a trainer's receipts to this figure: a worker counts the
tokens of every training Forward it served, by the caller's peer id (`agora_worker_served_tokens`,
monitor/worker_metrics.py), since its process started (`agora_worker_served_since_seconds`).
Only endpoints the scrape policy lists are read (monitor/scrape_policy.py: a worker's metrics on
its own gRPC host), so a record cannot point the monitor at another host. Anything that goes
wrong (the endpoint down, slow, the series missing) is "unknown", never a verdict: the receipt is
then stored unchecked rather than refused for the worker's silence.
"""

from __future__ import annotations

import urllib.request
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families

from agora.monitor.ledger import ServedCount

__all__ = ["served_count", "served_from_metrics"]

_TIMEOUT_S = 2.0
_MAX_BYTES = 4 << 20


def served_from_metrics(text: str, trainer: str) -> Optional[ServedCount]:
    """The worker's count for `trainer` from its metrics' text (None: the series are not there).
    A trainer the worker never served counts 0 since the worker started."""
    tokens, since = 0.0, None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "agora_worker_served_tokens_total" and sample.labels.get("trainer") == trainer:
                tokens = sample.value
            elif sample.name == "agora_worker_served_since_seconds":
                since = sample.value
    return None if since is None else ServedCount(tokens=int(tokens), since=since)


def served_count(endpoint: str, trainer: str) -> Optional[ServedCount]:
    """Read `endpoint` (HOST:PORT, its /metrics) now; None when it cannot be read."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=_TIMEOUT_S) as reply:
            text = reply.read(_MAX_BYTES).decode("utf-8", errors="replace")
        return served_from_metrics(text, trainer)
    except (OSError, ValueError):
        return None
