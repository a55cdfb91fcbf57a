"""Where a bench's figures go: its table, the raw figures beside it, and a plot where matplotlib is
installed (the `bench` extra; a machine without it still gets the table and the JSON)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["pyplot", "write_results"]


def pyplot() -> Optional[Any]:
    """matplotlib's pyplot drawing to files, or None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_results(out: Path, table: str, raw: Any, plot: Callable[[Path], bool]) -> None:
    """`table` as `out`, `raw` as JSON beside it, `plot` into a PNG beside it; prints the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    if plot(out.with_suffix(".png")):
        print(f"plot: {out.with_suffix('.png')}")
    print(table)
