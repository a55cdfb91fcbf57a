"""The demo's closing words: a few lines a person reads, from the full summary dict.

The dict (what `--summary-json` writes: every count, the per-stage time split, the averaging
stats per stage, exit codes) is for tools and tests; this is for the terminal: what happened,
how well it trained, how each stage did, and anything that went wrong.
"""

from __future__ import annotations

__all__ = ["format_summary"]


def _number(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_summary(summary: dict) -> str:
    lines = [f"demo {summary['outcome']}: {summary['steps']} global batches in {summary['wall_s']:.1f} s "
             f"({summary['mode']}, {summary['security']})",
             f"  loss {_number(summary['final_loss'])} (mean of the last 5 batches), held-out "
             f"{_number(summary['heldout_loss'])}, {summary['tokens_per_s']:,.0f} tokens/s"]
    averaging = summary.get("averaging_by_stage", {})
    splits = summary.get("time_split_by_stage", {})
    for stage, workers in summary.get("workers_per_stage", {}).items():
        text = f"  stage {stage}: {workers} worker{'s' if workers != 1 else ''}"
        split = splits.get(stage)
        if split and split.get("calls"):
            text += (f", {split['round_trip_ms']:.1f} ms per call ({split['compute_ms']:.1f} compute, "
                     f"{split['queued_ms']:.1f} queued, {split['wire_ms']:.1f} wire)")
        stats = averaging.get(stage)
        if stats:
            rounds = stats["rounds_by_outcome"]
            outcomes = ", ".join(f"{n} {outcome}" for outcome, n in rounds.items() if n) or "none yet"
            text += f"; averaging {stats['method']}: {sum(rounds.values())} rounds ({outcomes})"
            if stats.get("mean_lag_steps") is not None:
                text += f", applied {stats['mean_lag_steps']:.2f} steps after the snapshot"
        lines.append(text)
    trouble = []
    if summary.get("reroutes") or summary.get("busy_retries"):
        trouble.append(f"reroutes {summary.get('reroutes', 0)}, busy retries {summary.get('busy_retries', 0)}")
    if summary.get("killed"):
        trouble.append(f"killed (fault drill): {', '.join(summary['killed'])}")
    if summary.get("revoked"):
        trouble.append(f"left with a revoked credential: {', '.join(summary['revoked'])}")
    failed = {name: code for name, code in summary.get("exit_codes", {}).items()
              if code != 0 and name not in summary.get("killed", [])}
    trouble.append("every process exited cleanly" if not failed else
                   "exit codes: " + ", ".join(f"{name} {code}" for name, code in sorted(failed.items())))
    lines.append("  " + "; ".join(trouble))
    return "\n".join(lines)
