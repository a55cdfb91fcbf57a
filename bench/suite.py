"""`agora-bench`: the benchmark suite, one run, one results table (bench/RESULTS.md).

    agora-bench                                   # every row, every profile: about an hour+ here
    agora-bench --quick --out /tmp/quick.md       # every row, a few steps each: minutes (CI runs it)
    agora-bench --profile agora-floor --profile residential --json raw.json
    agora-bench --row 7 --update bench/results/suite.json   # one row again, the rest kept
    agora-bench --row 3 --update bench/results/suite.json --run 'lan/tiny report shape x1 adaptive'

Rows (bench/suite_items.py): 1 wire bytes per token, dense vs SSN; 2 swarm tokens/s over
train-local's on loopback (sync, async at the adaptive depth, with kept forward graphs, at half a
batch in flight; async in the wide shape, 32 microbatches of one sequence per global batch, and in
the report's, 256 on tiny); 3 tokens/s under each WAN profile over lan (bench/wan/, root; the wide
shape with 1, 2 and 4 trainers, the report's shape on lan and agora-floor); 4 held-out loss
after equal training time over agora-floor for the report's sparse cadence, full averaging every
step and none, and again at other link rates; 5 held-out loss after equal tokens against the same
recipe averaged exactly in one process, against train-local, SSN against dense; 6 averaging bytes
and blocked compute; 7 a newcomer's seconds to state and to member under chaos (bench/wan/); 8 is
bench/gpu.py's last run on a GPU machine, shown as it wrote it. A row that fails is reported as
failed with its error, and the others still run.

`--quick` keeps every row but runs few steps, one repeat, one swarm variant per row (the comparisons
within a row need the full run), row 3 on lan alone (rows 4 and 7 run over agora-floor), without
admission on loopback rows and without the wide batch shape (the same demo with other batch flags;
its goals' arithmetic has unit tests): it proves the suite still runs end to end, in CI; its figures
are not results. `--row N` runs only those rows; with `--update F` (the raw figures of an earlier
`--json F`) it measures them again with F's plan, keeps F's other rows, and writes F and the table
back, each rerun row marked with its own commit and date: after a fix, one row, not another hour.
`--run PROFILE/RUN` (with `--row 3 --update F`) narrows that to some of row 3's runs, each in its
profile's session as the whole row would run it, spliced into F's row 3 with its own stamp. A
full run alternates variants (A, B, A, B) and records the load average around every run, because
this machine is shared. Rows 3 and 4 need root (network namespaces); without it they are reported as
not measured, naming why.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from agora.bench import SUITE_ROWS
from agora.bench.suite_items import (
    SuitePlan,
    convergence_row,
    equal_time_row,
    join_row,
    local_row,
    profiles_row,
    relay_row,
    row3_run_names,
    wire_row,
)
from agora.bench.suite_report import render
from agora.bench.wan.profiles import PROFILES, profile_named
from agora.bench.wan.topology import harness_available
from agora.pipeline.config import load_config

__all__ = ["plan_for", "plan_from_record", "run_suite", "splice_runs", "machine", "RESULTS_PATH"]

RESULTS_PATH = Path(__file__).resolve().parent / "RESULTS.md"
# The raw figures behind RESULTS_PATH: `--update` of any other record writes its table beside it.
RECORD_PATH = Path(__file__).resolve().parent / "results" / "suite.json"


def _table_path(quick: bool, update: str | None) -> Path:
    """Where the table goes without ``--out``: a quick run's to a temporary folder, an update of a record
    other than the repository's beside that record (F.md), so that measuring a copy never rewrites
    bench/RESULTS.md; otherwise bench/RESULTS.md."""
    if quick:
        return Path(tempfile.mkdtemp(prefix="agora-bench-")) / "RESULTS.md"
    if update is not None and Path(update).resolve() != RECORD_PATH:
        return Path(update).with_suffix(".md")
    return RESULTS_PATH


def plan_for(quick: bool, profiles: list[str] | None = None, configs: list[str] | None = None,
             seed: int = 0) -> SuitePlan:
    for name in profiles or ():
        profile_named(name)  # a one-line error naming the unknown profile
    for name in configs or ():
        load_config(name)  # ConfigError, in one line
    if quick:
        return SuitePlan(quick=True, configs=tuple(configs or ("tiny",)),
                         profiles=tuple(profiles or ("lan",)), stages={"tiny": 3, "small": 4},
                         steps={"tiny": 6, "small": 3}, repeats=1, equal_time_s=3.0, crossover_mbit=(),
                         local_steps={"tiny": 6, "small": 3}, equal_time_repeats=1,
                         convergence_steps=6, keep_graphs=8, local_variants=("async",),
                         depth_variants=("adaptive",), equal_time_variants=("sparta, the report's cadence",),
                         convergence_swarms=("demo --replicas 2 (sparta)",),
                         insecure=True, relay_geometries=("tiny",), relay_microbatches=20,
                         join_profiles=("agora-floor",), join_budget_s=6.0, join_chaos_s=3.0, seed=seed,
                         rate_seconds=1.5, wide={}, wide_steps={}, report_shape=None,
                         wide_trainers=(1,), wide_profiles=(), report_profiles=())
    return SuitePlan(quick=False, configs=tuple(configs or ("tiny", "small")), profiles=tuple(profiles or PROFILES),
                     stages={"tiny": 3, "small": 4}, steps={"tiny": 40, "small": 8}, repeats=2, equal_time_s=120.0,
                     crossover_mbit=(1000.0, 20.0), convergence_steps=200, keep_graphs=8,
                     tuned_profiles=("agora-floor",), relay_geometries=("tiny", "small", "pluralis-8b"), seed=seed,
                     local_steps={"tiny": 120, "small": 16}, equal_time_repeats=1)


def plan_from_record(record: dict) -> SuitePlan:
    """The plan an earlier run recorded (its raw figures' "plan"), so a row measured again is
    measured the same way; ValueError, in one line, when the record does not hold one."""
    fields = {f.name for f in dataclasses.fields(SuitePlan)}
    recorded = record.get("plan") if isinstance(record, dict) else None
    if not isinstance(recorded, dict) or "quick" not in recorded:
        raise ValueError("holds no suite plan (expected the raw figures of `agora-bench --json F`)")
    # JSON has lists where the plan has tuples; fields added since the record take their defaults.
    values = {name: tuple(value) if isinstance(value, list) else value
              for name, value in recorded.items() if name in fields}
    try:
        return SuitePlan(**values)
    except TypeError as error:
        raise ValueError(f"its plan does not fit this version's: {error}") from None


def machine(load_start) -> dict:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(ram, 1), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "load_start": list(load_start)}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_suite(plan: SuitePlan, *, out: Path, json_path: Path | None = None, workdir: Path | None = None,
              command: str = "agora-bench", log=sys.stderr, only: tuple[str, ...] = (),
              previous: dict | None = None, runs: frozenset[str] | None = None) -> tuple[dict, list[str]]:
    """Run every row of `plan` (or those in `only`), write the report to `out` (and the raw figures
    to `json_path`); the results and the rows that failed (not those not measured for want of root).
    `previous`: an earlier run's raw figures; its rows not run now are kept, and the header stays
    its own, while each row run now records its own commit, date, command and load ("rerun"). A
    row that fails to run again keeps its recorded figures, with the attempt ("rerun_failed").
    `runs` (with `previous`, row 3 only): those of row 3's runs alone, spliced into its recorded
    figures (`splice_runs`), the row's other runs kept."""
    work = Path(workdir or tempfile.mkdtemp(prefix="agora-bench-suite-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    now = {"command": command, "commit": _commit(), "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}
    if previous is not None:
        results = copy.deepcopy(previous)
    else:
        results = {**now, "quick": plan.quick, "plan": asdict(plan), "machine": machine(os.getloadavg()),
                   "items": {}}
    no_harness = harness_available()
    rows = [("1", "wire bytes", lambda: wire_row()),
            ("2", "swarm vs train-local", lambda: local_row(plan, work)),
            ("3", "WAN profiles", lambda: profiles_row(plan, work, only=runs)),
            ("4", "equal wall-clock", lambda: equal_time_row(plan, work)),
            ("5", "equal tokens", lambda: convergence_row(plan, work)),
            ("7", "join time", lambda: join_row(plan, work)),
            ("relay", "the trainer's relay, before and after", lambda: relay_row(plan))]
    assert [number for number, _, _ in rows] == list(SUITE_ROWS)  # bench/cli.py's --row choices
    failed: list[str] = []
    handler = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for number, name, row in rows:
            if only and number not in only:
                continue
            # A row run again says when and where; one run with the suite shares the header's.
            stamp = {**now, "load": [_load_now()]}
            started = None
            if number in ("3", "4", "7") and no_harness:
                item = {"error": f"not measured: {no_harness}"}
            else:
                print(f"bench: row {number} ({name}), load {os.getloadavg()[0]:.2f}", file=log, flush=True)
                started = time.monotonic()
                try:
                    item = {"data": row()}
                except KeyboardInterrupt:
                    raise
                except Exception as error:  # noqa: BLE001 - a failed row is reported, the others still run
                    traceback.print_exc(file=log)
                    item = {"error": f"{type(error).__name__}: {error}"[:400]}
            stamp["load"].append(_load_now())
            if started is not None:
                stamp["wall_s"] = round(time.monotonic() - started, 1)
                print(f"bench: row {number} took {stamp['wall_s']:g} s", file=log, flush=True)
            if "error" in item and not item["error"].startswith("not measured"):
                failed.append(number)
            recorded = results["items"].get(number, {})
            if previous is None:
                results["items"][number] = item
            elif runs is not None and number == "3" and "data" in item and "data" in recorded:
                splice_runs(recorded, item["data"], stamp)
            elif "error" in item and "data" in recorded:
                # A rerun that failed loses nothing: the recorded figures stay, marked with the attempt.
                print(f"bench: row {number} not measured again ({item['error']}); its recorded figures are kept",
                      file=log, flush=True)
                recorded["rerun_failed"] = {**stamp, "error": item["error"]}
            else:
                results["items"][number] = {**item, "rerun": stamp}
    finally:
        signal.signal(signal.SIGTERM, handler)
    if previous is None:
        results["machine"]["load_end"] = list(os.getloadavg())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results))
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"bench: wrote {out}" + (f" and {json_path}" if json_path else ""), file=log, flush=True)
    return results, failed


def splice_runs(recorded: dict, measured: dict, stamp: dict) -> None:
    """Row 3's runs measured again (`measured`: profiles_row's data for some of them) into its
    recorded item: each run's repeats replaced and marked with the stamp, the splice listed in the
    item's "reruns" with the sessions' link checks and relay figures (the recorded ones stay)."""
    profiles = recorded["data"].setdefault("profiles", {})
    names, sessions = [], {}
    for label, entry in measured["profiles"].items():
        target = profiles.setdefault(label, {}).setdefault("runs", {})
        for key, repeats in entry["runs"].items():
            target[key] = [{**run, "rerun": stamp} for run in repeats]
            names.append(f"{label}/{key}")
        sessions[label] = {"links": entry.get("links"), "relay": entry.get("relay")}
    recorded.setdefault("reruns", []).append({**stamp, "runs": names, "sessions": sessions})


def _load_now() -> float:
    return round(os.getloadavg()[0], 2)


def _previous_run(path: str) -> tuple[dict, SuitePlan]:
    """`--update F`: the earlier run's raw figures and its plan; ValueError names what is wrong."""
    try:
        record = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"--update {path}: cannot read it: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--update {path}: not JSON ({error})") from None
    try:
        plan = plan_from_record(record)
        if not isinstance(record.get("items"), dict) or not isinstance(record.get("machine"), dict):
            raise ValueError("holds no rows (expected the raw figures of `agora-bench --json F`)")
    except ValueError as error:
        raise ValueError(f"--update {path}: {error}") from None
    return record, plan


def main(args, command: str = "agora-bench") -> int:
    """`agora-bench` (bench/cli.py parses the flags); `command`: the command line, recorded with the figures."""
    only = tuple(dict.fromkeys(args.row or ()))
    previous = None
    runs = None
    if args.run:
        if not args.update or only != ("3",):
            raise ValueError("--run: measures runs of row 3 again into a recorded run: give --row 3 --update F")
    if args.update:
        if not only:
            raise ValueError("--update: name the rows to measure again with --row N")
        if args.quick or args.profile or args.config or args.seed:
            raise ValueError("--update: the rows are measured with the plan recorded in the file; "
                             "--quick, --profile, --config and --seed do not apply")
        previous, plan = _previous_run(args.update)
        if args.run:
            known = row3_run_names(plan)
            unknown = [name for name in args.run if name not in known]
            if unknown:
                raise ValueError(f"--run {unknown[0]!r}: not a run of row 3 in {args.update}'s plan; its runs: "
                                 + "; ".join(known))
            runs = frozenset(args.run)
    else:
        plan = plan_for(args.quick, args.profile, args.config, args.seed)
    out = Path(args.out) if args.out else _table_path(plan.quick, args.update)
    json_path = Path(args.json) if args.json else (Path(args.update) if args.update else None)
    _, failed = run_suite(plan, out=out, json_path=json_path, workdir=Path(args.workdir) if args.workdir else None,
                        command=command, only=only, previous=previous, runs=runs)
    return 1 if failed else 0
