"""The demo's record of a run: the trainers' logs merged, the full summary dict, and its closing words.

The dict (`build_summary`, what `--summary-json` writes: every count, the per-stage time split,
the averaging stats per stage, exit codes) is for tools and tests; `format_summary` is for the
terminal: what happened, how well it trained, how each stage did, and anything that went wrong.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from agora.node.demo.chaos import join_seconds

__all__ = ["format_summary", "build_summary", "churn_summary", "merge_logs", "latest_per_trainer"]

# node/membership/rebalance.py's milestone line
_MOVED = re.compile(r"rebalancing: moving to stage (\d+)")


def _number(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_summary(summary: dict) -> str:
    twice = summary.get("run_twice")
    lines = [f"demo {summary['outcome']}: {summary['steps']} global batches"
             + (f" ({twice} of them a second time)" if twice else "")
             + f" in {summary['wall_s']:.1f} s ({summary['mode']}, {summary['security']})",
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
    if summary.get("host_cpu"):
        lines.append(_cpu_line(summary["host_cpu"], summary["cpu_by_process"]))
    for name, history in sorted(summary.get("phases_by_worker", {}).items()):
        if len(history) > 1:  # it synced before it counted
            lines.append(f"  {name} joined through " + " -> ".join(f"{phase} at {at:.1f} s" for phase, at in history))
    churn = summary.get("churn")
    if churn:
        units = churn["units"]
        workers = [j for j in churn["joins"] if j["name"].startswith("worker")]
        states = [j["seconds_to_state"] for j in workers if j.get("seconds_to_state") is not None]
        joined = [j["seconds_to_member"] for j in workers if j["seconds_to_member"] is not None]
        timing = ([f"the stage's state after {_span(states)}"] if states else []) + (
            [f"member after {_span(joined)}"] if joined else []) + (
            [f"{len(workers) - len(joined)} killed or still syncing before member"] if len(joined) < len(workers) else [])
        text = (f"  churn: {churn['kills']} killed, {len(churn['joins'])} joined"
                + (f" ({'; '.join(timing)})" if timing else "")
                + f"; units {units['committed']}/{units['total']} committed, {units['lost']} lost, "
                f"{units['duplicated']} run twice")
        if summary.get("repeats"):
            text += f" ({summary['repeats']} stage calls found their work applied already: not applied again)"
        if churn.get("resumed_from_step") is not None:
            text += f"; resumed from step {churn['resumed_from_step']}"
        lines.append(text)
    for move in summary.get("rebalanced", []):
        lines.append(f"  {move['name']} moved to stage {move['to']} (its stage was over-covered)")
    if summary.get("verification_peak") is not None and summary.get("verification_bar"):
        flagged = summary.get("flagged") or {}
        lines.append(f"  verifier: {len(flagged) or 'nobody'} flagged; the largest CUSUM "
                     f"{summary['verification_peak']:.1f} against its bar of {summary['verification_bar']:g}"
                     + (f" ({_where(summary['verification_peak_at'])})" if summary.get("verification_peak_at") else ""))
    trouble = []
    if summary.get("reroutes") or summary.get("busy_retries"):
        share = summary.get("busy_share")
        trouble.append(f"reroutes {summary.get('reroutes', 0)}, busy retries {summary.get('busy_retries', 0)}"
                       + (f" ({100 * share:.2f}% of {summary['calls'] + summary['busy_retries']:,} calls)"
                          if share is not None and summary.get("calls") is not None else ""))
    if summary.get("killed"):
        trouble.append(f"killed (fault drill or chaos): {', '.join(summary['killed'])}")
    if summary.get("revoked"):
        trouble.append(f"left with a revoked credential: {', '.join(summary['revoked'])}")
    failed = {name: code for name, code in summary.get("exit_codes", {}).items()
              if code != 0 and name not in summary.get("killed", [])}
    trouble.append("every process exited cleanly" if not failed else
                   "exit codes: " + ", ".join(f"{name} {code}" for name, code in sorted(failed.items())))
    lines.append("  " + "; ".join(trouble))
    return "\n".join(lines)


def _where(peak_at: str) -> str:
    """"1/input_grad/QmAbc...: variation high" as "stage 1 input_grad of QmAbcdef, variation high"."""
    key, _, feature = peak_at.partition(": ")
    stage, kind, peer = (key.split("/", 2) + ["", ""])[:3]
    return f"stage {stage} {kind} of {peer[:8]}" + (f", {feature}" if feature else "")


def _span(seconds: list[float]) -> str:
    low, high = min(seconds), max(seconds)
    return f"{low:.1f} s" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f} s"


def merge_logs(paths: list[Path]) -> list[dict]:
    """Every trainer's lines, one per global batch, ordered by the run-wide step. Only complete lines
    count: the trainers write while the demo reads, so the last line may still be half written (a
    demo at load 8 once read '{"step": 116, "loss": 2.62925380468' and stopped the run), and a trainer
    killed mid-write leaves its torn line unterminated. A trainer's evaluation lines (an `eval` key,
    node/trainer/evals.py) are not global batches: left out."""
    lines = []
    for path in paths:
        if path.exists():
            text = path.read_text()
            complete = text[:text.rfind("\n") + 1]
            lines += [row for row in map(json.loads, filter(str.strip, complete.splitlines())) if "eval" not in row]
    return sorted(lines, key=lambda line: line["step"])


def latest_per_trainer(lines: list[dict]) -> list[dict]:
    latest: dict[int, dict] = {}
    for line in lines:
        latest[line.get("trainer", 0)] = line
    return list(latest.values())


def build_summary(options, lines: list[dict], workdir: Path, workers, killed, exit_codes,
                  outcome: str, wall_s: float, trainers: list[str] | None = None, cpu: dict | None = None) -> dict:
    """The full summary; `trainers`: the names of every trainer started (replacements included); `cpu`:
    node/host_cpu.py's `CpuWindow` reading of the other roles and the host over the training."""
    trainer_summaries = []
    for name in trainers if trainers is not None else [f"trainer-{i}" for i in range(options.trainers)]:
        path = workdir / f"{name}.summary.json"
        if path.exists():
            trainer_summaries.append(json.loads(path.read_text()) | {"name": name})
    heldout = [s["heldout_loss"] for s in trainer_summaries if s.get("heldout_loss") is not None]
    tail = lines[-5:]
    per_stage: dict[int, int] = {}
    for stage, worker in workers:
        if worker.name not in killed:  # the stage's workers at the end (where a rebalanced one ended up)
            stage = _final_stage(workdir, worker, stage)
            per_stage[stage] = per_stage.get(stage, 0) + 1
    return {
        "outcome": outcome,
        "steps": len(lines),
        "run_twice": _run_twice(lines),
        "final_loss": sum(line["loss"] for line in tail) / len(tail) if tail else None,
        "heldout_loss": heldout[0] if heldout else None,
        "tokens": lines[-1]["tokens"] if lines else 0,
        "tokens_per_s": sum(line["tokens_per_s"] for line in latest_per_trainer(lines)),
        "wall_s": round(wall_s, 2),
        "workers_per_stage": {str(k): v for k, v in sorted(per_stage.items())},
        "reroutes": sum(s.get("reroutes", 0) for s in trainer_summaries),
        # Stage calls a worker computed without applying: it had applied that unit's microbatch before.
        "repeats": sum(s.get("repeats", 0) for s in trainer_summaries),
        "time_split_by_stage": _merge_time_splits([s.get("time_split_by_stage", {}) for s in trainer_summaries]),
        "trainer_split": _mean_trainer_split([s.get("trainer_split", {}) for s in trainer_summaries]),
        "in_flight": [s.get("in_flight") for s in trainer_summaries],
        # Each trainer's DHT requests by operation and record family (count, failures, mean and median ms).
        "dht_requests": [s.get("dht_requests") for s in trainer_summaries],
        # Each trainer's evaluations against the live swarm (the run config's evals), with their step.
        "evaluations": [e for s in trainer_summaries for e in s.get("evaluations", [])],
        "busy_retries": sum(s.get("busy", 0) for s in trainer_summaries),
        # Forward/Backward calls the workers answered, and the share of all calls refused as busy.
        "calls": sum(s.get("calls", 0) for s in trainer_summaries),
        "busy_share": _busy_share(trainer_summaries),
        "bans": sum(s.get("bans", 0) for s in trainer_summaries),
        # Workers the trainers' verifiers flagged (the evidence), and the largest CUSUM any worker
        # reached at any trainer against the bar (how close the run came to flagging someone).
        "flagged": {peer: evidence for s in trainer_summaries for peer, evidence in s.get("flagged_by_peer", {}).items()},
        "verification_peak": _largest_peak(trainer_summaries)[0],
        "verification_peak_at": _peak_at(trainer_summaries),
        "verification_bar": max((s["verification"]["threshold"] for s in trainer_summaries
                                 if s.get("verification", {}).get("enabled")), default=None),
        # Trips of a stage's only worker the verifiers excused for a self check at once (node/trainer/lone_worker.py).
        "verification_lone_trips": sum(s.get("verification", {}).get("lone_trips", 0) for s in trainer_summaries),
        "averaging_by_stage": _averaging_by_stage(workdir, workers),
        # Each stage's Forward and Backward jobs, summed over the replicas that wrote their stats: their
        # wall time and the compute thread's CPU time in them (a shared host's waits for a core are the difference).
        "compute_by_stage": _compute_by_stage(workdir, workers),
        # The CPU seconds of each role's processes over the training (the process, its p2pd, its other
        # descendants: hivemind's DHT and averager processes), and the host's: the rest of the host's
        # busy time is the supervisor, the kernel's networking, an emulated link's relay, anything else.
        **_cpu_over_training(cpu, trainer_summaries),
        # Each worker's phases and when it entered them (seconds after it started): a replica that
        # joined mid-run shows weight_sync, optimizer_sync, member (node/membership/phases.py).
        "phases_by_worker": _phases_by_worker(workdir, workers),
        "rebalanced": _moves(workers),  # workers that left an over-covered stage for another (their logs)
        "killed": killed,
        "exit_codes": exit_codes,
        "mode": "sync" if options.sync else "async",
        "security": "insecure" if options.insecure else "admitted",
        "credential_renewals": {"trainers": sum(s.get("credential_renewals", 0) for s in trainer_summaries),
                                "workers": _count_in_logs([w for _, w in workers], "renewed the credential")},
        "revoked": [w.name for _, w in workers if exit_codes.get(w.name) == 3],
    }


def _largest_peak(trainer_summaries: list[dict]) -> tuple[float | None, str, str]:
    """The run's largest verifier CUSUM at any trainer, its "stage/kind/peer" and its feature and side
    ((None, "", "") without a verifier)."""
    peaks = [(peak, key, s["verification"].get("peak_feature", {}).get(key, ""))
             for s in trainer_summaries if s.get("verification", {}).get("peak_cusum")
             for key, peak in s["verification"]["peak_cusum"].items()]
    return max(peaks, default=(None, "", ""))


def _peak_at(trainer_summaries: list[dict]) -> str | None:
    """Where the run's largest verifier CUSUM grew: "stage/kind/peer: feature side" (None: no verifier)."""
    peak, key, feature = _largest_peak(trainer_summaries)
    if peak is None:
        return None
    return f"{key}: {feature}" if feature else key


def _busy_share(trainer_summaries: list[dict]) -> float | None:
    """Busy refusals over every Forward/Backward call made (answered or refused); None before any call."""
    busy = sum(s.get("busy", 0) for s in trainer_summaries)
    made = busy + sum(s.get("calls", 0) for s in trainer_summaries)
    return round(busy / made, 6) if made else None


def _count_in_logs(children, text: str) -> int:
    total = 0
    for child in children:
        try:
            total += child.log_path.read_text(errors="replace").count(text)
        except OSError:
            pass
    return total


def _final_stage(workdir: Path, worker, started_on: int) -> int:
    """The stage a worker left the run from (its stats file says; a rebalanced one moved)."""
    try:
        return int(json.loads((workdir / f"{worker.name}.stats.json").read_text()).get("stage", started_on))
    except (OSError, ValueError, TypeError):
        return started_on


def _moves(workers) -> list[dict]:
    moves = []
    for _, worker in workers:
        try:
            text = worker.log_path.read_text(errors="replace")
        except OSError:
            continue
        moves += [{"name": worker.name, "to": int(stage)} for stage in _MOVED.findall(text)]
    return moves


def _phases_by_worker(workdir: Path, workers) -> dict:
    phases = {}
    for _, worker in workers:
        try:
            history = json.loads((workdir / f"{worker.name}.stats.json").read_text()).get("phases")
        except (OSError, ValueError):
            continue
        if history:
            phases[worker.name] = history
    return phases


def _averaging_by_stage(workdir: Path, workers) -> dict:
    """Each stage's averaging rounds by outcome, summed over its replicas (from their stats files).

    A worker writes its file when it leaves; a killed one leaves none and is not counted.
    """
    merged: dict[str, dict] = {}
    for stage, worker in workers:
        path = workdir / f"{worker.name}.stats.json"
        try:
            stats = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        into = merged.setdefault(str(stats.get("stage", stage)), {"method": stats.get("method"), "replicas_reporting": 0,
                                              "rounds_by_outcome": {}, "rejections": {}, "applied": 0, "skipped": 0,
                                              "clipped_coordinates": 0, "bytes_sent": 0,
                                              "local_steps": 0, "compute_blocked_s": 0.0, "wall_s": 0.0,
                                              "lag_steps_sum": 0.0, "max_lag_steps": 0})
        into["replicas_reporting"] += 1
        for outcome, n in stats.get("rounds_by_outcome", {}).items():
            into["rounds_by_outcome"][outcome] = into["rounds_by_outcome"].get(outcome, 0) + n
        for reason, n in stats.get("rejections", {}).items():  # what robust aggregation stopped (dht/robust.py)
            into["rejections"][reason] = into["rejections"].get(reason, 0) + n
        for key in ("applied", "skipped", "clipped_coordinates", "bytes_sent", "local_steps", "compute_blocked_s",
                    "wall_s"):
            into[key] += stats.get(key, 0)
        into["parameters"] = stats.get("parameters", 0)
        into["lag_steps_sum"] += (stats.get("mean_lag_steps") or 0.0) * stats.get("applied", 0)
        into["max_lag_steps"] = max(into["max_lag_steps"], stats.get("max_lag_steps", 0))
    for into in merged.values():
        into["compute_blocked_fraction"] = into["compute_blocked_s"] / into["wall_s"] if into["wall_s"] else None
        # Local steps from a round's snapshot to its apply, over every applied round of the stage.
        into["mean_lag_steps"] = into.pop("lag_steps_sum") / into["applied"] if into["applied"] else None
    return dict(sorted(merged.items()))


def _compute_by_stage(workdir: Path, workers) -> dict:
    """Per stage: Forward and Backward jobs, their wall seconds, the compute thread's CPU seconds in
    them, and the CPU's share of the wall (None without jobs); the same of its Step and Abort jobs
    (`control_`); from the replicas' stats files (a killed one wrote none)."""
    merged: dict[str, dict] = {}
    for stage, worker in workers:
        try:
            stats = json.loads((workdir / f"{worker.name}.stats.json").read_text())
        except (OSError, ValueError):
            continue
        jobs = stats.get("jobs")
        if not isinstance(jobs, dict):
            continue
        into = merged.setdefault(str(stats.get("stage", stage)), {"jobs": 0, "compute_s": 0.0, "compute_cpu_s": 0.0,
                                                                  "control_jobs": 0, "control_s": 0.0,
                                                                  "control_cpu_s": 0.0, "control_queued_s": 0.0})
        for key in into:
            into[key] += jobs.get(key, 0)
    for into in merged.values():
        into["cpu_share"] = round(into["compute_cpu_s"] / into["compute_s"], 4) if into["compute_s"] else None
    return dict(sorted(merged.items()))


def _cpu_line(host: dict, by_process: dict) -> str:
    """Cores busy over the training, and whose: the workers' and trainers' own processes, every role's
    p2pd and hivemind processes, and the rest of the host (other roles, the supervisor, the kernel)."""
    seconds = host["window_s"]

    def cores(names: tuple[str, ...], parts: tuple[str, ...]) -> float:
        return sum(cpu[part] for name, cpu in by_process.items() if name.startswith(names) for part in parts) / seconds

    own = {role: cores((role,), ("main",)) for role in ("worker", "trainer")}
    dht = cores(("",), ("p2pd", "children"))
    rest = max(0.0, host["busy_s"] / seconds - own["worker"] - own["trainer"] - dht)
    return (f"  host CPU over the training: {host['busy_s'] / seconds:.2f} of {host['cores']} cores busy (workers "
            f"{own['worker']:.2f}, trainers {own['trainer']:.2f}, every role's DHT processes and p2pd {dht:.2f}, "
            f"the rest {rest:.2f})")


def _cpu_over_training(cpu: dict | None, trainer_summaries: list[dict]) -> dict:
    """{"cpu_by_process": {name: parts}, "host_cpu": {...}}: the demo's reading of the roles it
    supervises over the training, with each trainer's reading of its own `run` (None: not read)."""
    if cpu is None:
        return {"cpu_by_process": None, "host_cpu": None}
    by_process = dict(cpu["by_process"])
    for summary in trainer_summaries:
        if summary.get("process_cpu"):
            by_process[summary["name"]] = summary["process_cpu"]
    return {"cpu_by_process": by_process,
            "host_cpu": {"window_s": cpu["window_s"], "busy_s": cpu["host_busy_s"], "cores": cpu["cores"],
                         "processes_s": round(sum(sum(parts.values()) for parts in by_process.values()), 3)}}


def _merge_time_splits(splits: list[dict]) -> dict:
    """Per-stage mean milliseconds per call over all trainers, weighted by their call counts."""
    merged: dict[str, dict[str, float]] = {}
    for split in splits:
        for stage, times in split.items():
            into = merged.setdefault(stage, {"calls": 0})
            calls = times["calls"]
            for key, value in times.items():
                if key != "calls":
                    into[key] = into.get(key, 0.0) + value * calls
            into["calls"] += calls
    for times in merged.values():
        calls = max(1, times["calls"])
        for key in times:
            if key != "calls":
                times[key] = round(times[key] / calls, 3)
    return merged


def _run_twice(lines: list[dict]) -> int:
    """Global batches the trainers' logs hold more than once (by another trainer, or by the same one):
    work done twice."""
    return len(lines) - len({line["step"] for line in lines})


def churn_summary(options, lines: list[dict], events, joins, workdir: Path, resume_step) -> dict:
    """What churn did to the run: kills, joins (seconds to member), and the units: every global batch
    of the run committed once (its line in a trainer's log is written once it is), none lost."""
    distinct = {line["step"] for line in lines}
    start = resume_step or 0
    # Under a time budget the trainers stop starting units: the run's units end at the last committed
    # (a unit before it that no log has is lost; those after it were never started).
    last = options.steps if options.time_budget_s is None else max(distinct, default=start)
    return {
        "resumed_from_step": resume_step,
        "kills": len(events),
        "events": [vars(event) for event in events],
        # A worker's seconds from its start to the stage's state and to member (a trainer has no
        # phases: it claims units at once).
        "joins": [_join(name, workdir, at) for name, at in joins],
        "units": {"total": last - start,
                  "committed": len([s for s in distinct if s > start]),
                  "duplicated": _run_twice(lines),
                  "lost": len([s for s in range(start + 1, last + 1) if s not in distinct])},
    }


def _join(name: str, workdir: Path, started_at) -> dict:
    state, member = join_seconds(workdir / f"{name}.log", started_at) if name.startswith("worker") else (None, None)
    return {"name": name, "seconds_to_state": state, "seconds_to_member": member}


def _mean_trainer_split(splits: list[dict]) -> dict:
    """Each trainer's own split (CPU and time outside calls per microbatch), averaged over trainers."""
    splits = [split for split in splits if split]
    keys = sorted({key for split in splits for key in split})
    return {key: round(sum(split.get(key, 0.0) for split in splits) / len(splits), 3) for key in keys} if splits else {}
