"""Row 3 of bench/RESULTS.md, the emulated internet links (bench/wan/): the profiles' links as measured,
each run's tokens/s against the same run on lan, the per-stage split of a training call, the goals (one
replica per stage at agora-floor; the many-microbatch shapes per profile; busy answers), what the runs'
own figures say limits a goal missed, and the fixes row 3 measured before and after."""

from __future__ import annotations

import math

from agora.bench.report_format import (fmt, load_span, many_microbatches, mean_heldout, mean_present, mean_rate, met,
                                       ratio_of)

__all__ = ["report", "section", "wide_goals", "fixes", "WIDE_GOALS"]


def report(row: dict, local: dict | None) -> tuple[list[str], list[str], list[str]]:
    """Row 3 for bench/RESULTS.md: its section, its summary rows (the goals among them) and its closing
    notes. `local` is row 2's figures, whose many-microbatch runs count in the busy answers' goal."""
    text, ratios = section(row)
    summary: list[str] = []
    notes: list[str] = []
    floor = {key: ratio for (profile, key), ratio in ratios.items() if profile == "agora-floor"}
    shown = "; ".join(f"{key}: {_shown(*ratio)}" for key, ratio in floor.items())
    goals = _floor_goal(row)
    goal_text = "; ".join(f"{config}: {_shown(ratio, apart)} ({floor_key} / lan's {lan_key})"
                          for config, (ratio, floor_key, lan_key, apart) in goals.items())
    worst = min((ratio for ratio, _, _, apart in goals.values() if ratio is not None and not apart), default=None)
    summary.append(f"| 3 | best tokens/s at agora-floor / best on lan, one replica per stage | {goal_text or '-'} | "
                   f">= 0.9 | {met(worst, 0.9)} |")
    summary.append(f"| 3 | tokens/s at agora-floor / the same run on lan | {shown or '-'} | - | - |")
    others = "; ".join(f"{p} {key}: {_shown(*r)}" for (p, key), r in ratios.items() if p not in ("lan", "agora-floor"))
    if others:
        summary.append(f"| 3 | tokens/s at the other profiles / lan | {others} | - | - |")
    notes += _depth_note(row, goals, worst)
    wide_rows, wide_notes = wide_goals(row, local)
    if any(apart for _, apart in ratios.values()):
        notes.append("A row 3 ratio marked \"sessions apart\" divides runs measured in different sessions (see "
                     "\"Measured again since\"): this host's speed changes by the hour (lan tiny x1's compute per "
                     "call was 25 ms one morning and 39 ms at noon), so it measures the hours as much as the "
                     "links, and no goal counts it; measure both runs again together to read it.")
    summary += wide_rows
    notes += wide_notes
    return text, summary, notes


def _session(runs: list[dict]) -> tuple | None:
    """Which session measured a run: the stamp of the rerun that replaced it (its date and commit), or
    None for the row's own session."""
    stamp = runs[-1].get("rerun") if runs else None
    return None if stamp is None else (stamp.get("date"), stamp.get("commit"))


def _against(runs: list[dict], reference: list[dict]) -> tuple[float | None, bool]:
    """`runs`' tokens/s over `reference`'s, and whether the two came from different sessions: this
    host's speed changes by the hour (lan tiny x1's compute per call 25 ms one morning, 39 ms at
    noon), so such a ratio measures the hours, not the profile, and no goal counts it."""
    return ratio_of(mean_rate(runs), mean_rate(reference)), bool(runs and reference) and _session(runs) != _session(reference)


APART = " (sessions apart)"


def _shown(ratio: float | None, apart: bool) -> str:
    return fmt(ratio) + (APART if apart and ratio is not None else "")


def _split_rows(label: str, runs: list[dict]) -> list[str]:
    lines = []
    split = runs[-1].get("time_split_by_stage") or {}
    trainer = runs[-1].get("trainer_split") or {}
    for stage, t in split.items():
        lines.append(f"| {label} | {stage} | {t['round_trip_ms']:.1f} | {t['compute_ms']:.1f} | {t['queued_ms']:.1f} | "
                     f"{t['wire_ms']:.1f} | {fmt(t.get('credit_wait_ms'), 1)} | {fmt(trainer.get('cpu_ms'), 2)} | "
                     f"{fmt(trainer.get('outside_calls_ms'), 1)} |")
    return lines


def _flight(flights: list[dict]) -> str:
    """In flight per trainer: last/max, the configured cap, and the workers' credits for it at the end
    (in-flight credits of the tightest stage; calls per stage)."""
    shown = []
    for f in flights:
        text = f"{f['last']}/{f['max']}, {f['cap']}"
        if f.get("stage_credits"):
            text += f" (credits {f.get('credit_cap') or '-'}; {'/'.join(str(c) for c in f['stage_credits'])})"
        shown.append(text)
    return " ".join(shown) or "-"


def _busy(runs: list[dict]) -> str:
    """Busy answers over calls made, over a variant's runs."""
    busy = sum(r.get("busy_retries") or 0 for r in runs)
    calls = sum(r.get("calls") or 0 for r in runs)
    return "-" if not calls and not busy else f"{100 * busy / (busy + calls):.2f}%"


def section(row: dict) -> tuple[list[str], dict]:
    lines = ["## 3. Emulated internet links (bench/wan/)", "",
             "Every process in its own network namespace; rates by `tc tbf` on each access link, delay by the "
             "relay; admitted (the authorizer's preflight and dial-back cross the links too). What the harness "
             "measured before the runs (TCP round trip median, receiver goodput each way):", "",
             "| profile | link | measured RTT ms | up Mbit/s | down Mbit/s | checks needed |", "|---|---|---:|---:|---:|---:|"]
    for name, entry in row["profiles"].items():
        for link in entry["links"]:
            lines.append(f"| {name} | {link['setting']} | {link['rtt_ms']} | {fmt(link['upload_mbit'], 1)} | "
                         f"{fmt(link['download_mbit'], 1)} | {entry['link_check_attempts']} |")
    lines += ["", "| profile | run | tokens/s | / lan | held-out / lan | in flight (last/max, cap; credits) | "
                  "unqueued latency ms | busy | load |", "|---|---|---:|---:|---:|---|---:|---:|---|"]
    lan = row["profiles"].get("lan", {}).get("runs", {})
    headline = {}
    splits = ["", "Per training call, by stage, the last run of each (ms; wire = round trip - compute - queued; credit wait: "
                  "before the call, at the trainer, for a worker's credit; trainer: CPU and wall time outside calls per "
                  "microbatch):", "",
              "| profile, run | stage | round trip | compute | queued | wire | credit wait | trainer CPU | "
              "trainer outside calls |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, entry in row["profiles"].items():
        for key, runs in entry["runs"].items():
            rate, loss = mean_rate(runs), mean_heldout(runs)
            reference = lan.get(key, [])
            flights = [f for r in runs for f in (r.get("in_flight") or []) if f]
            latency = mean_present(f.get("latency_ms") for f in flights)
            ratio, apart = _against(runs, reference)
            lines.append(f"| {name} | {key} | {fmt(rate, 0)} | {_shown(ratio, apart)} | "
                         f"{fmt(ratio_of(loss, mean_heldout(reference)), 4)}{APART if apart and ratio is not None else ''} | "
                         f"{_flight(flights)} | {fmt(latency, 0)} | {_busy(runs)} | {load_span(runs)} |")
            headline[(name, key)] = (ratio, apart)
            splits += _split_rows(f"{name}, {key}", runs)
    return lines + splits, headline


# The goals of the many-microbatch shapes: tokens/s over the same run on lan, per profile.
WIDE_GOALS = {"agora-floor": 0.9, "residential": 0.8}


def wide_goals(row: dict, local: dict | None) -> tuple[list[str], list[str]]:
    """Summary rows for the wide shape (tokens/s per profile over the same run on lan, with 1, 2 and 4
    trainers; busy answers over calls) and, for a goal missed, what its runs' own figures say limits it."""
    profiles = row["profiles"]
    lan = profiles.get("lan", {}).get("runs", {})
    rows, notes = [], []
    for profile, goal in WIDE_GOALS.items():
        runs = {key: value for key, value in profiles.get(profile, {}).get("runs", {}).items() if many_microbatches(key)}
        paired = {key: _against(value, lan.get(key, [])) for key, value in runs.items()}
        ratios = {key: ratio for key, (ratio, apart) in paired.items() if not apart}
        if not paired:
            continue
        worst = min((r for key, r in ratios.items() if r is not None and "report shape" not in key), default=None)
        shown = "; ".join(f"{key}: {_shown(ratio, apart)}" for key, (ratio, apart) in paired.items())
        rows.append(f"| 3 | many microbatches per batch: tokens/s at {profile} / the same run on lan | {shown} | "
                    f">= {goal} (wide) | {met(worst, goal)} |")
        for key, ratio in ratios.items():
            if ratio is not None and ratio < goal and "report shape" not in key:
                notes.append(_limit_note(profile, key, runs[key][-1], lan.get(key, [{}])[-1], ratio, goal))
    every = [r for entry in profiles.values() for key, value in entry.get("runs", {}).items() if many_microbatches(key)
             for r in value] + [r for config, entry in (local or {}).items() if many_microbatches(config)
                                for name, value in entry["runs"].items() if name != "train-local" for r in value]
    busy = sum(r.get("busy_retries") or 0 for r in every)
    calls = sum(r.get("calls") or 0 for r in every)
    if calls:
        share = busy / (busy + calls)
        rows.append(f"| 3 | busy answers / calls made, every many-microbatch run of rows 2 and 3 | "
                    f"{100 * share:.3f}% ({busy:,} of {busy + calls:,}) | <= 1% | {met(share, 0.01, lower_is_better=True)} |")
    return rows, notes


def _limit_note(profile: str, key: str, run: dict, lan: dict, ratio: float, goal: float) -> str:
    """What a missed goal's run measured: per stage the call split there and on lan, and the depth and
    credits it ran with."""
    def split(r: dict) -> str:
        return "; ".join(f"stage {stage} {t['compute_ms']:.0f} compute + {t['queued_ms']:.0f} queued + "
                         f"{t['wire_ms']:.0f} wire, {fmt(t.get('credit_wait_ms'), 0)} waiting for credit"
                         for stage, t in (r.get("time_split_by_stage") or {}).items())
    flights = [f for f in (run.get("in_flight") or []) if f]
    return (f"{key} at {profile}: {fmt(ratio)} of lan, below {goal}. Per call (ms) there: {split(run) or '-'}; on lan: "
            f"{split(lan) or '-'}. In flight per trainer: {_flight(flights)}; unqueued latency "
            f"{fmt(mean_present(f.get('latency_ms') for f in flights), 0)} ms against "
            f"{fmt(mean_present(max(f.get('stage_compute_ms') or [0]) for f in flights), 0)} ms on the busiest stage.")


def _floor_goal(row: dict) -> dict[str, tuple[float | None, str, str]]:
    """Row 3's goal per config: the fastest agora-floor run (one replica per stage) over the fastest
    lan run. Each variant's ratio to the same variant on lan would flatter a variant that is slow on
    lan too (16 in flight on 2 cores queues behind itself), and lan's best is what a user compares."""
    floor_runs = row["profiles"].get("agora-floor", {}).get("runs", {})
    goals = {}
    for config in dict.fromkeys(key.split(" x")[0] for key in floor_runs if not many_microbatches(key)):
        (floor_rate, floor_key), (lan_rate, lan_key) = (_fastest(row, "agora-floor", config),
                                                        _fastest(row, "lan", config))
        apart = _against(floor_runs.get(floor_key, []), row["profiles"].get("lan", {}).get("runs", {}).get(lan_key, []))[1]
        goals[config] = (ratio_of(floor_rate, lan_rate), floor_key, lan_key, apart)
    return goals


def _fastest(row: dict, profile: str, config: str) -> tuple[float | None, str]:
    """The fastest one-replica run of `config` on `profile`: (tokens/s, its key), or (None, "-")."""
    rates = [(mean_rate(runs), key) for key, runs in row["profiles"].get(profile, {}).get("runs", {}).items()
             if key.startswith(f"{config} x1 ")]
    return max(((rate, key) for rate, key in rates if rate is not None), default=(None, "-"))


def _depth_note(row: dict, goals: dict, worst: float | None) -> list[str]:
    """What limits tokens/s at agora-floor, from its adaptive run's own figures."""
    runs = row["profiles"].get("agora-floor", {}).get("runs", {})
    key = next((k for k in runs if k.endswith("adaptive") and not many_microbatches(k)), None)
    if key is None:
        return []
    last = runs[key][-1]
    flight = (last.get("in_flight") or [{}])[0] or {}
    split = last.get("time_split_by_stage") or {}
    compute = flight.get("stage_compute_ms") or []
    wanted = math.ceil(flight["latency_ms"] / max(compute)) if compute and max(compute) > 0 else None
    round_trips = sum(t["round_trip_ms"] * (1 if stage == str(len(split) - 1) else 2) for stage, t in split.items())
    verdict = "met" if worst is not None and worst >= 0.9 else "not met"
    shown = "; ".join(f"{config} {_shown(ratio, apart)}" for config, (ratio, _, _, apart) in goals.items())
    text = (f"Row 3's goal (>= 0.9 of lan's best tokens/s at agora-floor) is {verdict} ({shown}). In {key}, "
            f"a microbatch's unqueued latency there was {fmt(flight.get('latency_ms'), 0)} ms (its calls' round trips "
            f"add up to ~{round_trips:.0f} ms) against {fmt(max(compute) if compute else None, 0)} ms of compute on the "
            f"busiest stage, so filling the pipe takes ~{wanted} microbatches in flight; the trainer held "
            f"{flight.get('last')} (cap {flight.get('cap')} = `--max-staleness` global batches).")
    if wanted is not None and flight.get("cap") is not None and wanted > flight["cap"]:
        text += (" The cap, not the links, is what limits it: more in flight would hide the round trips and cost "
                 "convergence (staleness is depth / microbatches per batch steps; see row 2's and row 3's held-out "
                 "columns).")
    return [text]


def fixes(profiles: dict) -> tuple[list[str], list[str]]:
    """The fixes row 3 measured, before and after in the same row: the adaptive depth against the fixed
    half batch (F2), a staleness cap of 4 against 1 (F2), tuned hosts against Linux's default (F3)."""
    lines: list[str] = []
    summary: list[str] = []
    depth = []
    for profile, entry in profiles.items():
        runs = entry.get("runs", {})
        for key in runs:
            if key.endswith("adaptive") and key.replace("adaptive", "half a batch") in runs:
                ratio = _against(runs[key], runs[key.replace("adaptive", "half a batch")])
                depth.append(f"{profile} {key.replace(' adaptive', '')}: {_shown(*ratio)}")
    if depth:
        lines += ["Adaptive depth against the former fixed half batch (tokens/s, row 3): " + "; ".join(depth) + ".", ""]
        summary.append(f"| F2 | tokens/s, adaptive depth / half a batch in flight | {'; '.join(depth)} | - | - |")
    staleness = []
    for profile, entry in profiles.items():
        runs = entry.get("runs", {})
        for key in runs:
            if key.endswith("adaptive, staleness 4") and key.replace(", staleness 4", "") in runs:
                base = runs[key.replace(", staleness 4", "")]
                ratio, apart = _against(runs[key], base)
                staleness.append(f"{profile} {key.split(' adaptive')[0]}: {fmt(ratio)} tokens/s, "
                                 f"{fmt(ratio_of(mean_heldout(runs[key]), mean_heldout(base)), 4)} held-out"
                                 + (APART if apart and ratio is not None else ""))
    if staleness:
        lines += ["A staleness cap of 4 global batches against the default 1 (row 3): " + "; ".join(staleness) + ".", ""]
        summary.append(f"| F2 | `--max-staleness 4` / default 1 (tokens/s; held-out loss) | {'; '.join(staleness)} "
                       "| - | - |")
    tuned = [(name, entry) for name, entry in profiles.items() if name.endswith("(tuned hosts)")]
    for name, entry in tuned:
        plain = profiles.get(name.replace(" (tuned hosts)", ""), {}).get("runs", {})
        shown = "; ".join(f"{key}: {_shown(*_against(runs, plain.get(key, [])))}" for key, runs in entry["runs"].items())
        lines += [f"Hosts with `net.ipv4.tcp_slow_start_after_idle=0` against Linux's default, {name}: {shown} "
                  "(tokens/s).", ""]
        summary.append(f"| F3 | tokens/s, tuned hosts / default hosts ({name.split(' (')[0]}) | {shown} | - | - |")
    return lines, summary
