"""bench/RESULTS.md from the suite's measurements (bench/suite_items.py): one summary table with the
goals, a section per row, and a closing note derived from the figures (which goals were met, and
for those that were not, what the measured split says limits them)."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

from agora.bench.attack_report import detection_row
from agora.bench.averaging_scale import section as averaging_scale_section
from agora.bench.averaging_scale import summary_row as averaging_scale_row
from agora.bench.dht_scale_report import section as dht_scale_section
from agora.bench.dht_scale_report import summary_row as dht_scale_row

__all__ = ["render"]

# Row 8 is measured by bench/gpu.py on a GPU machine, not by the suite: the table shows what its
# last run wrote (bench/results/gpu.json), or says it was never run.
GPU_RESULTS = Path(__file__).resolve().parent / "results" / "gpu.json"
# Row 9 likewise from bench/attacks.py's last run, which the suite does not run (about 15 minutes alone).
ATTACK_RESULTS = Path(__file__).resolve().parent / "results" / "attacks_tiny.json"
# Row 10 from bench/dht_scale.py's last run (the coordination plane alone, N up to 64; root, about 40 minutes).
DHT_SCALE_RESULTS = Path(__file__).resolve().parent / "results" / "dht_scale.json"
# Row 11 from bench/averaging_scale.py's last run (R replicas of a stage averaging, up to 16; about 15 minutes).
AVERAGING_SCALE_RESULTS = Path(__file__).resolve().parent / "results" / "averaging_scale.json"
# The simulator against the measured runs: what bench/simulate_validation.py last wrote (CPU only, a minute).
SIMULATOR_VALIDATION = Path(__file__).resolve().parent / "results" / "simulate_validation.md"
GPU_NOT_MEASURED = ("not measured: the suite's machine has no GPU; `python bench/gpu.py` measures one stage's "
                    "tokens/s and MFU on one (bench/results/gpu.md)")


def mean_present(values) -> float | None:
    """The mean of the values that are there (None: none is)."""
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _f(value, digits: int = 3, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _session(runs: list[dict]) -> tuple | None:
    """Which session measured a run: the stamp of the rerun that replaced it (its date and commit), or
    None for the row's own session."""
    stamp = runs[-1].get("rerun") if runs else None
    return None if stamp is None else (stamp.get("date"), stamp.get("commit"))


def _against(runs: list[dict], reference: list[dict]) -> tuple[float | None, bool]:
    """`runs`' tokens/s over `reference`'s, and whether the two came from different sessions: this
    host's speed changes by the hour (lan tiny x1's compute per call 25 ms one morning, 39 ms at
    noon), so such a ratio measures the hours, not the profile, and no goal counts it."""
    return _ratio(_rate(runs), _rate(reference)), bool(runs and reference) and _session(runs) != _session(reference)


APART = " (sessions apart)"


def _shown(ratio: float | None, apart: bool) -> str:
    return _f(ratio) + (APART if apart and ratio is not None else "")


def _rate(runs: list[dict]) -> float | None:
    return mean_present(r.get("tokens_per_s") for r in runs)


def _heldout(runs: list[dict]) -> float | None:
    return mean_present(r.get("heldout_loss") for r in runs)


def _loads(runs: list[dict]) -> str:
    return ", ".join(f"{r['load'][0][0]:.1f}->{r['load'][1][0]:.1f}" for r in runs if r.get("load"))


# ----------------------------------------------------------------------------- sections


def _wire(rows: dict) -> tuple[list[str], str]:
    lines = ["## 1. Wire bytes per token per stage boundary (bench/wire_bytes.py)", "",
             "Real tensors through the codec, framing included; forward SSN messages carry the coordinates "
             "and the token ids, dense ones h alone.", "",
             "| geometry | d/k | dense fp32 | dense bf16 | SSN fp32 | SSN bf16 | SSN int8 | dense-bf16 / SSN-bf16 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    headline = ""
    for name, row in rows.items():
        fwd = {k: v["forward_per_token"] for k, v in row.items() if isinstance(v, dict)}
        ratio = fwd["dense-bf16"] / fwd["SSN-bf16"]
        lines.append(f"| {name} | {row['d_over_k']:.1f} | {fwd['dense-fp32']:,.1f} | {fwd['dense-bf16']:,.1f} | "
                     f"{fwd['SSN-fp32']:,.1f} | {fwd['SSN-bf16']:,.1f} | {fwd['SSN-int8']:,.1f} | {ratio:.1f}x |")
        headline = f"{name}: {ratio:.1f}x fewer forward bytes (d/k = {row['d_over_k']:.0f})"
    return lines + ["", "Bytes per token, forward message; backward carries the gradient frame only."], headline


def _local(rows: dict) -> tuple[list[str], dict]:
    lines = ["## 2. Swarm vs train-local on loopback (bench/swarm_vs_local.py)", "",
             "Same model, tokens and cores: train-local in one process with 2 threads, the demo's workers "
             "with 1 thread each on the same 2 cores.", "",
             "| config | run | tokens/s | / train-local | held-out / train-local | trainer CPU ms / microbatch "
             "| in flight (last, max) | load (1-min avg, before->after) |", "|---|---|---:|---:|---:|---:|---|---|"]
    headline = {}
    for config, row in rows.items():
        local = row["runs"]["train-local"]
        local_rate, local_loss = _rate(local), _heldout(local)
        for name, runs in row["runs"].items():
            rate, loss = _rate(runs), _heldout(runs)
            cpu = mean_present((r.get("trainer_split") or {}).get("cpu_ms") for r in runs)
            flight = [f"{f['last']}/{f['max']}" for r in runs for f in (r.get("in_flight") or []) if f]
            batch = row.get("batch")
            shape = f", {batch['sequences']} sequences in {batch['microbatches']} microbatches" if batch else ""
            lines.append(f"| {config} ({row['stages']} stages, {row['steps']} steps{shape}) | {name} | {_f(rate, 0)} | "
                         f"{_f(_ratio(rate, local_rate))} | {_f(_ratio(loss, local_loss), 4)} | {_f(cpu, 2)} | "
                         f"{' '.join(flight) or '-'} | {_loads(runs)} |")
            headline[(config, name)] = (_ratio(rate, local_rate), _ratio(loss, local_loss))
    return lines, headline


def _split_rows(label: str, runs: list[dict]) -> list[str]:
    lines = []
    split = runs[-1].get("time_split_by_stage") or {}
    trainer = runs[-1].get("trainer_split") or {}
    for stage, t in split.items():
        lines.append(f"| {label} | {stage} | {t['round_trip_ms']:.1f} | {t['compute_ms']:.1f} | {t['queued_ms']:.1f} | "
                     f"{t['wire_ms']:.1f} | {_f(t.get('credit_wait_ms'), 1)} | {_f(trainer.get('cpu_ms'), 2)} | "
                     f"{_f(trainer.get('outside_calls_ms'), 1)} |")
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


def _profiles(row: dict) -> tuple[list[str], dict]:
    lines = ["## 3. Emulated internet links (bench/wan/)", "",
             "Every process in its own network namespace; rates by `tc tbf` on each access link, delay by the "
             "relay; admitted (the authorizer's preflight and dial-back cross the links too). What the harness "
             "measured before the runs (TCP round trip median, receiver goodput each way):", "",
             "| profile | link | measured RTT ms | up Mbit/s | down Mbit/s | checks needed |", "|---|---|---:|---:|---:|---:|"]
    for name, entry in row["profiles"].items():
        for link in entry["links"]:
            lines.append(f"| {name} | {link['setting']} | {link['rtt_ms']} | {_f(link['upload_mbit'], 1)} | "
                         f"{_f(link['download_mbit'], 1)} | {entry['link_check_attempts']} |")
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
            rate, loss = _rate(runs), _heldout(runs)
            reference = lan.get(key, [])
            flights = [f for r in runs for f in (r.get("in_flight") or []) if f]
            latency = mean_present(f.get("latency_ms") for f in flights)
            ratio, apart = _against(runs, reference)
            lines.append(f"| {name} | {key} | {_f(rate, 0)} | {_shown(ratio, apart)} | "
                         f"{_f(_ratio(loss, _heldout(reference)), 4)}{APART if apart and ratio is not None else ''} | "
                         f"{_flight(flights)} | {_f(latency, 0)} | {_busy(runs)} | {_loads(runs)} |")
            headline[(name, key)] = (ratio, apart)
            splits += _split_rows(f"{name}, {key}", runs)
    return lines + splits, headline


def _equal_time(row: dict) -> tuple[list[str], dict]:
    lines = [f"## 4. Held-out loss after {row['time_budget_s']:g} s of training, 2 replicas per stage", "",
             "tiny, 3 stages, 2 replicas per stage, one trainer (adaptive depth), the same schedule "
             f"({row['schedule_steps']} steps) for every run; each trainer starts no global batch after the "
             "budget and then evaluates. Link: 80 ms RTT at the rate shown.", "",
             "| link | averaging | global batches | tokens/s | held-out loss | rounds committed/other | "
             "bytes / param / local step | compute blocked | load |", "|---|---|---:|---:|---:|---|---:|---:|---|"]
    losses: dict = {}
    for mbit, point in row["points"].items():
        for name, runs in point["runs"].items():
            loss = _heldout(runs)
            losses[(mbit, name)] = loss
            outcomes: dict = {}
            for r in runs:
                for k, n in (r.get("outcomes") or {}).items():
                    outcomes[k] = outcomes.get(k, 0) + n
            other = sum(n for k, n in outcomes.items() if k != "committed")
            blocked = mean_present(r.get('blocked_fraction') for r in runs)
            lines.append(f"| {mbit} Mbit/s | {name} | {_f(mean_present(r.get('steps') for r in runs), 0)} | "
                         f"{_f(_rate(runs), 0)} | {_f(loss, 4)} | {outcomes.get('committed', 0)}/{other} | "
                         f"{_f(mean_present(r.get('bytes_per_param_per_local_step') for r in runs), 3)} | "
                         f"{_f(blocked and 100 * blocked, 3, '%')} | "
                         f"{_loads(runs)} |")
    sparse, full = "sparta, the report's cadence", "everything every step"
    verdicts = []
    for mbit in row["points"]:
        a, b = losses.get((mbit, sparse)), losses.get((mbit, full))
        if a is not None and b is not None:
            verdicts.append((float(mbit), a < b))
    lines += ["", "Where full averaging stops paying: " + (", ".join(
        f"at {mbit:g} Mbit/s {'sparse' if wins else 'full'} reaches the lower loss" for mbit, wins in sorted(verdicts))
        or "not measured") + "."]
    return lines, {"losses": losses, "verdicts": verdicts}


def _convergence(row: dict) -> tuple[list[str], dict]:
    local, exact = row["train_local"], row["exact_in_process"]
    lines = [f"## 5. Held-out loss after equal tokens ({row['steps']} global batches, loopback)", "",
             f"tiny, 3 stages, the schedule completed over the run; sparta at tiny's cadence "
             f"({row['sync']['fraction']:g} every {row['sync']['every_steps']} steps).", "",
             "| run | held-out loss | / exact in-process | / train-local | load |", "|---|---:|---:|---:|---|"]
    for name, value in (("train-local", local), ("train-local, dense control", row["dense"]),
                        ("2 replicas averaged exactly in one process (the report's reference)", exact)):
        lines.append(f"| {name} | {_f(value, 4)} | {_f(_ratio(value, exact), 4)} | {_f(_ratio(value, local), 4)} | - |")
    figures = {"ssn_over_dense": _ratio(local, row["dense"])}
    for name, run in row["swarm"].items():
        loss = run.get("heldout_loss")
        lines.append(f"| {name} | {_f(loss, 4)} | {_f(_ratio(loss, exact), 4)} | {_f(_ratio(loss, local), 4)} | "
                     f"{_loads([run])} |")
        if "sparta" in name:
            figures.update(swarm_over_exact=_ratio(loss, exact), swarm_over_local=_ratio(loss, local),
                           bytes_per_param=run.get("bytes_per_param_per_local_step"),
                           blocked=run.get("blocked_fraction"))
    return lines, figures


def _joins(row: dict) -> tuple[list[str], str]:
    """Row 7; a profile's run that ended early or a newcomer that never became a member is shown as such."""
    lines = ["## 7. Joining: seconds from a newcomer's start to member", "",
             f"`demo --chaos {row['chaos_s']:g}` on each profile (tiny, 3 stages x 2 replicas, one trainer, "
             f"{row['time_budget_s']:g} s of training): a worker or the trainer is killed -9 and a newcomer with a "
             "new identity and empty state starts on a spare node of the profile's link. A worker newcomer counts "
             "from its process's start to the line of its log that says its state download finished (state), and "
             "to the one that makes it a member (node/demo/chaos.py); what it does in between (admission, the DHT "
             "join, the download, the sync phases' averaging rounds) crosses the emulated links. \"never\": killed, "
             "or still syncing, before it was a member. Units: the run's global batches up to the last one "
             "committed.", "",
             "| profile | kills | worker newcomers' s to state | mean | s to member | mean | "
             "units committed / lost / twice | outcome | load |",
             "|---|---:|---|---:|---|---:|---|---|---|"]
    shown = []
    for name, entry in row["profiles"].items():
        joins = entry.get("worker_joins_s") or []
        states = entry.get("worker_states_s")  # None: recorded before states were
        units = entry.get("units") or {}
        listed = ", ".join("never" if j is None else f"{j:.1f}" for j in joins) or "-"
        listed_states = "-" if states is None else (", ".join("-" if j is None else f"{j:.1f}" for j in states) or "-")
        kills = entry.get("kills")
        lines.append(f"| {name} | {'-' if kills is None else kills} | {listed_states} | {_f(mean_present(states or []), 1)} | "
                     f"{listed} | {_f(mean_present(joins), 1)} | "
                     f"{units.get('committed', '-')} / {units.get('lost', '-')} / {units.get('duplicated', '-')} | "
                     f"{entry.get('outcome') or '-'} | {_loads([entry])} |")
        never = sum(1 for j in joins if j is None)
        state = "" if states is None else f"state {_f(mean_present(states), 1, ' s')}, "
        shown.append(f"{name}: {state}member {_f(mean_present(joins), 1, ' s')}"
                     + (f" ({never} of {len(joins)} never a member)" if never else ""))
    return lines, "; ".join(shown)


def _fixes(items: dict) -> tuple[list[str], list[str]]:
    """Each fix the measurements pointed to, before and after, from the rows that measured it."""
    lines = ["## Fixes, before and after", ""]
    summary = []
    relay = items.get("relay", {}).get("data")
    if relay:
        from agora.bench.trainer_relay import table

        lines += ["The trainer as a relay (bench/trainer_relay.py: canned workers in another process, this "
                  "process's CPU time per microbatch, one at a time through every stage and back):", "",
                  *table(relay), ""]
        shown = "; ".join(f"{name} {r['relay frames'] / r['generated classes, decoded replies']:.3f}"
                          for name, r in relay.items())
        summary.append(f"| F1 | trainer CPU per microbatch relaying frames, after / before | {shown} | - | - |")
    profiles = (items.get("3", {}).get("data") or {}).get("profiles", {})
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
                staleness.append(f"{profile} {key.split(' adaptive')[0]}: {_f(ratio)} tokens/s, "
                                 f"{_f(_ratio(_heldout(runs[key]), _heldout(base)), 4)} held-out"
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
    local = (items.get("2", {}).get("data") or {})
    kept = []
    for config, row in local.items():
        runs = row["runs"]
        if "async, kept graphs" in runs and "async" in runs:
            kept.append(f"{config}: {_f(_ratio(_rate(runs['async, kept graphs']), _rate(runs['async'])))} tokens/s, "
                        f"{_f(_ratio(_heldout(runs['async, kept graphs']), _heldout(runs['async'])), 4)} held-out")
    if kept:
        lines += ["Kept forward graphs (`--keep-graphs`) against the recompute (row 2): " + "; ".join(kept) + ".", ""]
        summary.append(f"| F4 | kept forward graphs / recompute at Backward | {'; '.join(kept)} | - | - |")
    summary.append("| F5 | gRPC compression off for activations, keepalive both sides accept | checked on the wire: "
                   "tests/integration/test_connection_options.py | - | yes |")
    return lines, summary


# ----------------------------------------------------------------------------- the whole file


def _met(value, goal, lower_is_better=False) -> str:
    if value is None:
        return "-"
    return "yes" if (value <= goal if lower_is_better else value >= goal) else "no"


def render(results: dict) -> str:
    machine = results["machine"]
    lines = ["# Agora node: benchmark results", "",
             f"Written by `{results['command']}` ({'quick: a smoke run, not figures' if results['quick'] else 'full run'}) "
             f"on {results['date']}, commit {results['commit']}. Machine: {machine['cpu']} ({machine['cores']} cores), "
             f"{machine['ram_gib']} GiB RAM, Linux {machine['kernel']}, Python {machine['python']}, torch "
             f"{machine['torch']}; shared with other work: 1-minute load average {machine['load_start'][0]:.1f} at the "
             f"start and {machine['load_end'][0]:.1f} at the end (each run's load is in its row). Raw figures: "
             "`agora-bench --json F`.", ""]
    reruns = measured_again(results["items"])
    if reruns:
        lines += ["Measured again since, with the same plan and the other rows kept: " + "; ".join(reruns) + ".", ""]
    attempts = [f"row {number} on {item['rerun_failed']['date']}, commit {item['rerun_failed']['commit']}: "
                f"{item['rerun_failed']['error']}" for number, item in results["items"].items()
                if item.get("rerun_failed")]
    if attempts:
        lines += ["Tried again and not measured, so the figures shown are the earlier ones: " + "; ".join(attempts)
                  + ".", ""]
    sections: list[str] = []
    summary = ["## Summary", "", "| # | what | measured | goal | met |", "|---|---|---|---|---|"]
    notes: list[str] = []
    items = results["items"]

    def failed(number: int, what: str) -> bool:
        error = items.get(str(number), {}).get("error")
        if error:
            summary.append(f"| {number} | {what} | failed: {error} | | |")
        return bool(error)

    if "1" in items and not failed(1, "wire bytes"):
        text, headline = _wire(items["1"]["data"])
        sections += text + [""]
        summary.append(f"| 1 | wire bytes per token per boundary, dense-bf16 / SSN-bf16 | {headline} | - | - |")
    if "2" in items and not failed(2, "swarm / train-local"):
        text, ratios = _local(items["2"]["data"])
        sections += text + [""]
        shown = "; ".join(f"{config} {name}: {_f(rate)}" for (config, name), (rate, _) in ratios.items()
                          if name in ("async", "async, kept graphs") and not _many(config))
        summary.append(f"| 2 | swarm tokens/s / train-local tokens/s (loopback) | {shown} | - | - |")
        many = {config: ratio for (config, name), ratio in ratios.items() if _many(config) and name == "async"}
        if many:
            shown = "; ".join(f"{config}: {_f(rate)} tokens/s, {_f(loss, 4)} held-out" for config, (rate, loss) in many.items())
            worst = max((loss for _, loss in many.values() if loss is not None), default=None)
            summary.append(f"| 2 | many microbatches per batch (wide; the report's shape): swarm / train-local of the "
                           f"same config, tokens/s and held-out loss | {shown} | held-out <= 1.01 | "
                           f"{_met(worst, 1.01, lower_is_better=True)} |")
    if "3" in items and not failed(3, "tokens/s per profile / lan"):
        text, ratios = _profiles(items["3"]["data"])
        sections += text + [""]
        floor = {key: ratio for (profile, key), ratio in ratios.items() if profile == "agora-floor"}
        shown = "; ".join(f"{key}: {_shown(*ratio)}" for key, ratio in floor.items())
        goals = _floor_goal(items["3"]["data"])
        goal_text = "; ".join(f"{config}: {_shown(ratio, apart)} ({floor_key} / lan's {lan_key})"
                              for config, (ratio, floor_key, lan_key, apart) in goals.items())
        worst = min((ratio for ratio, _, _, apart in goals.values() if ratio is not None and not apart), default=None)
        summary.append(f"| 3 | best tokens/s at agora-floor / best on lan, one replica per stage | {goal_text or '-'} | "
                       f">= 0.9 | {_met(worst, 0.9)} |")
        summary.append(f"| 3 | tokens/s at agora-floor / the same run on lan | {shown or '-'} | - | - |")
        others = "; ".join(f"{p} {key}: {_shown(*r)}" for (p, key), r in ratios.items() if p not in ("lan", "agora-floor"))
        if others:
            summary.append(f"| 3 | tokens/s at the other profiles / lan | {others} | - | - |")
        notes += _depth_note(items["3"]["data"], goals, worst)
        wide_rows, wide_notes = _wide_goals(items["3"]["data"], items.get("2", {}).get("data"))
        if any(apart for _, apart in ratios.values()):
            notes.append("A row 3 ratio marked \"sessions apart\" divides runs measured in different sessions (see "
                         "\"Measured again since\"): this host's speed changes by the hour (lan tiny x1's compute per "
                         "call was 25 ms one morning and 39 ms at noon), so it measures the hours as much as the "
                         "links, and no goal counts it; measure both runs again together to read it.")
        summary += wide_rows
        notes += wide_notes
    if "4" in items and not failed(4, "loss at equal wall-clock"):
        text, figures = _equal_time(items["4"]["data"])
        sections += text + [""]
        floor = [(name, loss) for (mbit, name), loss in figures["losses"].items() if mbit == "200"]
        shown = "; ".join(f"{name}: {_f(loss, 4)}" for name, loss in floor)
        wins = dict(figures["verdicts"]).get(200.0)
        summary.append(f"| 4 | held-out loss after equal training time over agora-floor | {shown} | sparse below "
                       f"full | {'-' if wins is None else ('yes' if wins else 'no')} |")
    if "5" in items and not failed(5, "loss after equal tokens"):
        text, figures = _convergence(items["5"]["data"])
        sections += text + [""]
        summary.append(f"| 5 | held-out loss after equal tokens: swarm / exact in-process; swarm / train-local; "
                       f"SSN / dense | {_f(figures.get('swarm_over_exact'), 4)}; {_f(figures.get('swarm_over_local'), 4)}; "
                       f"{_f(figures.get('ssn_over_dense'), 4)} | <= 1.01 | "
                       f"{_met(figures.get('swarm_over_exact'), 1.01, lower_is_better=True)} |")
        blocked = figures.get("blocked")
        summary.append(f"| 6 | averaging: bytes / parameter / local step; share of compute time blocked | "
                       f"{_f(figures.get('bytes_per_param'), 3)}; {_f(blocked and 100 * blocked, 3, '%')} | - | - |")
    if "7" in items and not failed(7, "join: seconds from start to member"):
        text, shown = _joins(items["7"]["data"])
        sections += text + [""]
        summary.append(f"| 7 | join: seconds from a newcomer's start to the stage's state and to member (mean of "
                       f"worker newcomers) | "
                       f"{shown} | - | - |")
    summary.append(_gpu_row(GPU_RESULTS))
    summary.append(detection_row(ATTACK_RESULTS))
    summary.append(dht_scale_row(DHT_SCALE_RESULTS))
    summary.append(averaging_scale_row(AVERAGING_SCALE_RESULTS))
    summary.append(_simulator_row(SIMULATOR_VALIDATION))
    sections += _scale_sections()
    fix_lines, fix_summary = _fixes(items)
    sections += fix_lines
    summary += fix_summary
    closing = ["## Closing note", ""] + (notes or ["Nothing to add beyond the table."])
    return "\n".join(lines + summary + [""] + sections + closing) + "\n"


def _scale_sections() -> list[str]:
    """Rows 10 and 11's tables and the simulator's validation, each as its own benchmark last wrote it:
    none of them is a run of the suite (root and 40 minutes; 15 minutes; the simulator)."""
    parts = [dht_scale_section(DHT_SCALE_RESULTS), averaging_scale_section(AVERAGING_SCALE_RESULTS),
             _simulator_section(SIMULATOR_VALIDATION)]
    return [line for part in parts if part for line in (*part, "")]


def _simulator_section(path: Path) -> list[str]:
    """The validation's own file under a RESULTS.md heading, its headings one level down."""
    if not path.exists():
        return []
    text = path.read_text().splitlines()[1:]  # its own title goes
    return ["## The simulator against the measured runs (bench/simulate_validation.py)",
            *[f"#{line}" if line.startswith("## ") else line for line in text]]


def _simulator_row(path: Path) -> str:
    """The summary's row from the validation's own headline lines (its tables are a section below)."""
    label = "| 12 | the simulator against the measured runs (bench/simulate_validation.py) |"
    goal = "tokens/s within 10%; rounds and a newcomer's times within 20%"
    if not path.exists():
        return f"{label} not run: `python -m agora.bench.simulate_validation --seconds 60` | {goal} | - |"
    headlines = [line for line in path.read_text().splitlines()
                 if line.startswith(("Row 3:", "Averaging against R", "A newcomer against N"))]
    shown = " ".join(headlines).replace("|", "/")
    counts = [(int(a), int(b)) for a, b in re.findall(r"(\d+) of (\d+)(?: runs)? within", shown)]
    met = bool(counts) and all(a == b for a, b in counts)
    return f"{label} {shown or 'no headline found'} | {goal} | {'yes' if met else 'no'} |"


def _gpu_row(path: Path) -> str:
    """Row 8 from bench/gpu.py's results: the body stage's tokens/s and MFU at its largest
    microbatch, per variant, against the goal of 40% MFU."""
    label = "| 8 | one stage on a GPU (pluralis-8b body stage): tokens/s, MFU |"
    if not path.exists():
        return f"{label} {GPU_NOT_MEASURED} | >= 40% MFU | - |"
    results = json.loads(path.read_text())
    env, part = results["environment"], results["parts"].get("body-stage", {})
    figures = {f["measure"]: f for f in part.get("figures", [])}
    rows = max((s for s in results["settings"]["body_microbatches"]), default=None)
    shown, best = [], None
    for variant in results["settings"].get("body_variants") or [""]:
        prefix = f"{variant}: " if len(results["settings"].get("body_variants") or []) > 1 else ""
        rate = figures.get(f"{prefix}microbatch {rows} x 4096: tokens/s")
        mfu = figures.get(f"{prefix}microbatch {rows} x 4096: MFU")
        if rate and mfu and "utilization" in mfu:
            shown.append(f"{variant or 'eager'} {rate['tokens_per_s']:,.0f} tokens/s, {100 * mfu['utilization']:.1f}%")
            best = max(best or 0.0, mfu["utilization"])
    if not shown:
        return f"{label} bench/gpu.py's last run measured no body stage ({part.get('status', 'not run')}) | >= 40% MFU | - |"
    measured = f"{env['device']}, {rows} x 4096 tokens: " + "; ".join(shown) + " (bench/results/gpu.md)"
    return f"{label} {measured} | >= 40% MFU | {_met(best, 0.40)} |"


def measured_again(items: dict) -> list[str]:
    """Each row measured again since the run (`--row N --update F`), and each splice of some of a
    row's runs (`--run`), with its date, commit, command and load."""
    rows = [f"row {number} on {item['rerun']['date']}, commit {item['rerun']['commit']} "
            f"(`{item['rerun']['command']}`, load {_rerun_load(item['rerun'])}"
            + (f"; {item['rerun']['note']}" if item["rerun"].get("note") else "") + ")"
            for number, item in items.items() if item.get("rerun")]
    return rows + [f"row {number}'s {', '.join(rerun['runs'])} on {rerun['date']}, commit {rerun['commit']} "
                   f"(`{rerun['command']}`, load {_rerun_load(rerun)})"
                   for number, item in items.items() for rerun in item.get("reruns") or ()]


def _rerun_load(rerun: dict) -> str:
    return "->".join(f"{load:.1f}" for load in rerun.get("load") or ()) or "-"


def _many(label: str) -> bool:
    """A shape of many microbatches per global batch (rows 2 and 3 label them so)."""
    return " wide" in label or label.endswith("report shape") or " report shape " in label


# The goals of the many-microbatch shapes: tokens/s over the same run on lan, per profile.
WIDE_GOALS = {"agora-floor": 0.9, "residential": 0.8}


def _wide_goals(row: dict, local: dict | None) -> tuple[list[str], list[str]]:
    """Summary rows for the wide shape (tokens/s per profile over the same run on lan, with 1, 2 and 4
    trainers; busy answers over calls) and, for a goal missed, what its runs' own figures say limits it."""
    profiles = row["profiles"]
    lan = profiles.get("lan", {}).get("runs", {})
    rows, notes = [], []
    for profile, goal in WIDE_GOALS.items():
        runs = {key: value for key, value in profiles.get(profile, {}).get("runs", {}).items() if _many(key)}
        paired = {key: _against(value, lan.get(key, [])) for key, value in runs.items()}
        ratios = {key: ratio for key, (ratio, apart) in paired.items() if not apart}
        if not paired:
            continue
        worst = min((r for key, r in ratios.items() if r is not None and "report shape" not in key), default=None)
        shown = "; ".join(f"{key}: {_shown(ratio, apart)}" for key, (ratio, apart) in paired.items())
        rows.append(f"| 3 | many microbatches per batch: tokens/s at {profile} / the same run on lan | {shown} | "
                    f">= {goal} (wide) | {_met(worst, goal)} |")
        for key, ratio in ratios.items():
            if ratio is not None and ratio < goal and "report shape" not in key:
                notes.append(_limit_note(profile, key, runs[key][-1], lan.get(key, [{}])[-1], ratio, goal))
    every = [r for entry in profiles.values() for key, value in entry.get("runs", {}).items() if _many(key)
             for r in value] + [r for config, entry in (local or {}).items() if _many(config)
                                for name, value in entry["runs"].items() if name != "train-local" for r in value]
    busy = sum(r.get("busy_retries") or 0 for r in every)
    calls = sum(r.get("calls") or 0 for r in every)
    if calls:
        share = busy / (busy + calls)
        rows.append(f"| 3 | busy answers / calls made, every many-microbatch run of rows 2 and 3 | "
                    f"{100 * share:.3f}% ({busy:,} of {busy + calls:,}) | <= 1% | {_met(share, 0.01, lower_is_better=True)} |")
    return rows, notes


def _limit_note(profile: str, key: str, run: dict, lan: dict, ratio: float, goal: float) -> str:
    """What a missed goal's run measured: per stage the call split there and on lan, and the depth and
    credits it ran with."""
    def split(r: dict) -> str:
        return "; ".join(f"stage {stage} {t['compute_ms']:.0f} compute + {t['queued_ms']:.0f} queued + "
                         f"{t['wire_ms']:.0f} wire, {_f(t.get('credit_wait_ms'), 0)} waiting for credit"
                         for stage, t in (r.get("time_split_by_stage") or {}).items())
    flights = [f for f in (run.get("in_flight") or []) if f]
    return (f"{key} at {profile}: {_f(ratio)} of lan, below {goal}. Per call (ms) there: {split(run) or '-'}; on lan: "
            f"{split(lan) or '-'}. In flight per trainer: {_flight(flights)}; unqueued latency "
            f"{_f(mean_present(f.get('latency_ms') for f in flights), 0)} ms against "
            f"{_f(mean_present(max(f.get('stage_compute_ms') or [0]) for f in flights), 0)} ms on the busiest stage.")


def _floor_goal(row: dict) -> dict[str, tuple[float | None, str, str]]:
    """Row 3's goal per config: the fastest agora-floor run (one replica per stage) over the fastest
    lan run. Each variant's ratio to the same variant on lan would flatter a variant that is slow on
    lan too (16 in flight on 2 cores queues behind itself), and lan's best is what a user compares."""
    floor_runs = row["profiles"].get("agora-floor", {}).get("runs", {})
    goals = {}
    for config in dict.fromkeys(key.split(" x")[0] for key in floor_runs if not _many(key)):
        (floor_rate, floor_key), (lan_rate, lan_key) = (_fastest(row, "agora-floor", config),
                                                        _fastest(row, "lan", config))
        apart = _against(floor_runs.get(floor_key, []), row["profiles"].get("lan", {}).get("runs", {}).get(lan_key, []))[1]
        goals[config] = (_ratio(floor_rate, lan_rate), floor_key, lan_key, apart)
    return goals


def _fastest(row: dict, profile: str, config: str) -> tuple[float | None, str]:
    """The fastest one-replica run of `config` on `profile`: (tokens/s, its key), or (None, "-")."""
    rates = [(_rate(runs), key) for key, runs in row["profiles"].get(profile, {}).get("runs", {}).items()
             if key.startswith(f"{config} x1 ")]
    return max(((rate, key) for rate, key in rates if rate is not None), default=(None, "-"))


def _depth_note(row: dict, goals: dict, worst: float | None) -> list[str]:
    """What limits tokens/s at agora-floor, from its adaptive run's own figures."""
    runs = row["profiles"].get("agora-floor", {}).get("runs", {})
    key = next((k for k in runs if k.endswith("adaptive") and not _many(k)), None)
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
            f"a microbatch's unqueued latency there was {_f(flight.get('latency_ms'), 0)} ms (its calls' round trips "
            f"add up to ~{round_trips:.0f} ms) against {_f(max(compute) if compute else None, 0)} ms of compute on the "
            f"busiest stage, so filling the pipe takes ~{wanted} microbatches in flight; the trainer held "
            f"{flight.get('last')} (cap {flight.get('cap')} = `--max-staleness` global batches).")
    if wanted is not None and flight.get("cap") is not None and wanted > flight["cap"]:
        text += (" The cap, not the links, is what limits it: more in flight would hide the round trips and cost "
                 "convergence (staleness is depth / microbatches per batch steps; see row 2's and row 3's held-out "
                 "columns).")
    return [text]
