"""How bench/RESULTS.md writes a figure, and the few figures every row reads from its runs the same way
(their mean tokens/s, held-out loss and load), shared by the results table and row 3's report."""

from __future__ import annotations

import math
import statistics

__all__ = ["mean_present", "fmt", "ratio_of", "mean_rate", "mean_heldout", "load_span", "met", "many_microbatches"]


def mean_present(values) -> float | None:
    """The mean of the values that are there (None: none is)."""
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def fmt(value, digits: int = 3, suffix: str = "") -> str:
    """A figure as the table shows it; "-" for one not measured."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def ratio_of(a, b) -> float | None:
    return a / b if a is not None and b else None


def mean_rate(runs: list[dict]) -> float | None:
    return mean_present(r.get("tokens_per_s") for r in runs)


def mean_heldout(runs: list[dict]) -> float | None:
    return mean_present(r.get("heldout_loss") for r in runs)


def load_span(runs: list[dict]) -> str:
    """Each run's 1-minute load average before and after it."""
    return ", ".join(f"{r['load'][0][0]:.1f}->{r['load'][1][0]:.1f}" for r in runs if r.get("load"))


def met(value, goal, lower_is_better=False) -> str:
    if value is None:
        return "-"
    return "yes" if (value <= goal if lower_is_better else value >= goal) else "no"


def many_microbatches(label: str) -> bool:
    """A shape of many microbatches per global batch (rows 2 and 3 label them so)."""
    return " wide" in label or label.endswith("report shape") or " report shape " in label
