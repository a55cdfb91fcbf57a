"""bench/RESULTS.md from the suite's measurements (bench/suite_items.py): one summary table with the
goals, a section per row, and a closing note derived from the figures (which goals were met, and
for those that were not, what the measured split says limits them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from agora.bench import wan_report
from agora.bench.attack_report import detection_row
from agora.bench.averaging_scale import section as averaging_scale_section
from agora.bench.averaging_scale import summary_row as averaging_scale_row
from agora.bench.dht_scale_report import section as dht_scale_section
from agora.bench.dht_scale_report import summary_row as dht_scale_row
from agora.bench.report_format import (fmt, load_span, many_microbatches, mean_heldout, mean_present, mean_rate, met,
                                       ratio_of)

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
        local_rate, local_loss = mean_rate(local), mean_heldout(local)
        for name, runs in row["runs"].items():
            rate, loss = mean_rate(runs), mean_heldout(runs)
            cpu = mean_present((r.get("trainer_split") or {}).get("cpu_ms") for r in runs)
            flight = [f"{f['last']}/{f['max']}" for r in runs for f in (r.get("in_flight") or []) if f]
            batch = row.get("batch")
            shape = f", {batch['sequences']} sequences in {batch['microbatches']} microbatches" if batch else ""
            lines.append(f"| {config} ({row['stages']} stages, {row['steps']} steps{shape}) | {name} | {fmt(rate, 0)} | "
                         f"{fmt(ratio_of(rate, local_rate))} | {fmt(ratio_of(loss, local_loss), 4)} | {fmt(cpu, 2)} | "
                         f"{' '.join(flight) or '-'} | {load_span(runs)} |")
            headline[(config, name)] = (ratio_of(rate, local_rate), ratio_of(loss, local_loss))
    return lines, headline


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
            loss = mean_heldout(runs)
            losses[(mbit, name)] = loss
            outcomes: dict = {}
            for r in runs:
                for k, n in (r.get("outcomes") or {}).items():
                    outcomes[k] = outcomes.get(k, 0) + n
            other = sum(n for k, n in outcomes.items() if k != "committed")
            blocked = mean_present(r.get('blocked_fraction') for r in runs)
            lines.append(f"| {mbit} Mbit/s | {name} | {fmt(mean_present(r.get('steps') for r in runs), 0)} | "
                         f"{fmt(mean_rate(runs), 0)} | {fmt(loss, 4)} | {outcomes.get('committed', 0)}/{other} | "
                         f"{fmt(mean_present(r.get('bytes_per_param_per_local_step') for r in runs), 3)} | "
                         f"{fmt(blocked and 100 * blocked, 3, '%')} | "
                         f"{load_span(runs)} |")
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
        lines.append(f"| {name} | {fmt(value, 4)} | {fmt(ratio_of(value, exact), 4)} | {fmt(ratio_of(value, local), 4)} | - |")
    figures = {"ssn_over_dense": ratio_of(local, row["dense"])}
    for name, run in row["swarm"].items():
        loss = run.get("heldout_loss")
        lines.append(f"| {name} | {fmt(loss, 4)} | {fmt(ratio_of(loss, exact), 4)} | {fmt(ratio_of(loss, local), 4)} | "
                     f"{load_span([run])} |")
        if "sparta" in name:
            figures.update(swarm_over_exact=ratio_of(loss, exact), swarm_over_local=ratio_of(loss, local),
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
        lines.append(f"| {name} | {'-' if kills is None else kills} | {listed_states} | {fmt(mean_present(states or []), 1)} | "
                     f"{listed} | {fmt(mean_present(joins), 1)} | "
                     f"{units.get('committed', '-')} / {units.get('lost', '-')} / {units.get('duplicated', '-')} | "
                     f"{entry.get('outcome') or '-'} | {load_span([entry])} |")
        never = sum(1 for j in joins if j is None)
        state = "" if states is None else f"state {fmt(mean_present(states), 1, ' s')}, "
        shown.append(f"{name}: {state}member {fmt(mean_present(joins), 1, ' s')}"
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
    wan_lines, wan_summary = wan_report.fixes((items.get("3", {}).get("data") or {}).get("profiles", {}))
    lines += wan_lines
    summary += wan_summary
    local = (items.get("2", {}).get("data") or {})
    kept = []
    for config, row in local.items():
        runs = row["runs"]
        if "async, kept graphs" in runs and "async" in runs:
            kept.append(f"{config}: {fmt(ratio_of(mean_rate(runs['async, kept graphs']), mean_rate(runs['async'])))} tokens/s, "
                        f"{fmt(ratio_of(mean_heldout(runs['async, kept graphs']), mean_heldout(runs['async'])), 4)} held-out")
    if kept:
        lines += ["Kept forward graphs (`--keep-graphs`) against the recompute (row 2): " + "; ".join(kept) + ".", ""]
        summary.append(f"| F4 | kept forward graphs / recompute at Backward | {'; '.join(kept)} | - | - |")
    summary.append("| F5 | gRPC compression off for activations, keepalive both sides accept | checked on the wire: "
                   "tests/integration/test_connection_options.py | - | yes |")
    return lines, summary


# ----------------------------------------------------------------------------- the whole file


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
        shown = "; ".join(f"{config} {name}: {fmt(rate)}" for (config, name), (rate, _) in ratios.items()
                          if name in ("async", "async, kept graphs") and not many_microbatches(config))
        summary.append(f"| 2 | swarm tokens/s / train-local tokens/s (loopback) | {shown} | - | - |")
        many = {config: ratio for (config, name), ratio in ratios.items() if many_microbatches(config) and name == "async"}
        if many:
            shown = "; ".join(f"{config}: {fmt(rate)} tokens/s, {fmt(loss, 4)} held-out"
                              for config, (rate, loss) in many.items())
            worst = max((loss for _, loss in many.values() if loss is not None), default=None)
            summary.append(f"| 2 | many microbatches per batch (wide; the report's shape): swarm / train-local of the "
                           f"same config, tokens/s and held-out loss | {shown} | held-out <= 1.01 | "
                           f"{met(worst, 1.01, lower_is_better=True)} |")
    if "3" in items and not failed(3, "tokens/s per profile / lan"):
        text, rows, row_notes = wan_report.report(items["3"]["data"], items.get("2", {}).get("data"))
        sections += text + [""]
        summary += rows
        notes += row_notes
    if "4" in items and not failed(4, "loss at equal wall-clock"):
        text, figures = _equal_time(items["4"]["data"])
        sections += text + [""]
        floor = [(name, loss) for (mbit, name), loss in figures["losses"].items() if mbit == "200"]
        shown = "; ".join(f"{name}: {fmt(loss, 4)}" for name, loss in floor)
        wins = dict(figures["verdicts"]).get(200.0)
        summary.append(f"| 4 | held-out loss after equal training time over agora-floor | {shown} | sparse below "
                       f"full | {'-' if wins is None else ('yes' if wins else 'no')} |")
    if "5" in items and not failed(5, "loss after equal tokens"):
        text, figures = _convergence(items["5"]["data"])
        sections += text + [""]
        summary.append(f"| 5 | held-out loss after equal tokens: swarm / exact in-process; swarm / train-local; "
                       f"SSN / dense | {fmt(figures.get('swarm_over_exact'), 4)}; {fmt(figures.get('swarm_over_local'), 4)}; "
                       f"{fmt(figures.get('ssn_over_dense'), 4)} | <= 1.01 | "
                       f"{met(figures.get('swarm_over_exact'), 1.01, lower_is_better=True)} |")
        blocked = figures.get("blocked")
        summary.append(f"| 6 | averaging: bytes / parameter / local step; share of compute time blocked | "
                       f"{fmt(figures.get('bytes_per_param'), 3)}; {fmt(blocked and 100 * blocked, 3, '%')} | - | - |")
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
    within = bool(counts) and all(a == b for a, b in counts)
    return f"{label} {shown or 'no headline found'} | {goal} | {'yes' if within else 'no'} |"


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
    return f"{label} {measured} | >= 40% MFU | {met(best, 0.40)} |"


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




