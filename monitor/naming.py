"""The naming rules every agora metric follows, checked over a live registry or a scraped page.

Prometheus' own conventions (prometheus.io/docs/practices/naming), made checkable:

- every metric is `agora_*`;
- a metric with a unit carries one base unit, as its last word (before `_total` on a counter):
  seconds, bytes, ratio (0..1); words for other units (milliseconds, minutes, kilobytes,
  percent, ...) never appear; anything that names a duration ends in `_seconds`;
- `_total` ends exactly the counters' samples;
- labels only from `ALLOWED_LABELS` (low cardinality: a stage index, a method, a status code;
  never a microbatch or a worker's peer id), plus the ones Prometheus itself defines for
  histograms. The one peer id allowed is a `trainer`'s, on a worker's count of what it served each
  trainer: trainers are operator-issued, a handful per run, and the worker caps the series
  (monitor/worker_metrics.py);
- every metric has help text.

`lint(families)` takes what `CollectorRegistry.collect()` yields or what
`prometheus_client.parser.text_string_to_metric_families` parses from a `/metrics` page, and
returns one readable line per violation (empty: clean). Pure: no sockets.
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client.metrics_core import Metric

__all__ = ["ALLOWED_LABELS", "BASE_UNITS", "lint"]

# `version` and `run` appear on agora_node_info only (one series per process).
ALLOWED_LABELS = frozenset({"stage", "role", "outcome", "method", "code", "phase", "reason", "kind", "version",
                            "run", "trainer"})
BASE_UNITS = ("seconds", "bytes", "ratio")
_PROMETHEUS_LABELS = frozenset({"le", "quantile"})
_NOT_BASE_UNITS = frozenset({"milliseconds", "ms", "microseconds", "us", "nanoseconds", "ns", "minutes", "hours",
                             "days", "kilobytes", "kb", "megabytes", "mb", "mib", "gib", "kib", "bits", "percent",
                             "pct"})
_DURATION_WORDS = frozenset({"duration", "latency", "seconds", "time"})
_SAMPLE_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                    "summary": ("_sum", "_count", "_created", ""), "info": ("_info",), "gauge": ("",),
                    "untyped": ("",)}


def lint(families: Iterable[Metric]) -> list[str]:
    problems: list[str] = []
    for family in families:
        problems += _family_problems(family)
    return problems


def _family_problems(family: Metric) -> list[str]:
    name, kind = family.name, family.type
    if kind == "gauge" and name.endswith("_created"):
        return []  # prometheus_client's creation timestamp of a counter or histogram, as the text format shows it
    problems = []
    if not name.startswith("agora_"):
        problems.append(f"{name}: not under the agora_ prefix")
    words = name.split("_")
    if bad := sorted(set(words) & _NOT_BASE_UNITS):
        problems.append(f"{name}: {', '.join(bad)} is not a base unit (use {', '.join(BASE_UNITS)})")
    if set(words) & _DURATION_WORDS and words[-1] != "seconds" and kind != "info":
        problems.append(f"{name}: names a duration, so it must end in _seconds")
    if kind != "counter" and name.endswith("_total"):
        problems.append(f"{name}: a {kind} must not end in _total (only counters do)")
    if family.unit and not name.endswith("_" + family.unit):
        problems.append(f"{name}: its unit {family.unit!r} is not its suffix")
    if family.unit and family.unit not in BASE_UNITS:
        problems.append(f"{name}: unit {family.unit!r} is not a base unit")
    if not (family.documentation or "").strip():
        problems.append(f"{name}: no help text")
    suffixes = _SAMPLE_SUFFIXES.get(kind, ("",))
    for sample in family.samples:
        if not any(sample.name == name + suffix for suffix in suffixes):
            problems.append(f"{sample.name}: sample of {kind} {name} has an unexpected suffix")
        if kind != "counter" and sample.name.endswith("_total"):
            problems.append(f"{sample.name}: _total on a {kind}")
        extra = set(sample.labels) - ALLOWED_LABELS - _PROMETHEUS_LABELS
        if extra:
            problems.append(f"{sample.name}: label(s) {', '.join(sorted(extra))} outside {sorted(ALLOWED_LABELS)}")
    return sorted(set(problems))
