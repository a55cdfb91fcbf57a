"""How a stage's averaging behaves as its replicas grow: R replicas of one stage averaging for real.

For each R, R processes (bench/averaging_replica.py), each what a deployed worker runs for its
averaging: its own `SwarmDHT` (hivemind's DHT process and p2pd), `SliceAverager` (hivemind's
averager process), worker-record heartbeat, the DHT round board and the `AveragingLoop` over the
stage's compute thread. The stage is tiny's middle stage of three (a quarter of the model: its
compute is negligible); the replicas step together every `--step-s` seconds, as a stage does on
its trainers' completed-batch reports, so a round falls due every `--every-steps` steps. Over a
window of `--rounds` rounds, from every replica's results:

- rounds attempted per replica (a round that fell due while another ran is skipped, not
  attempted) and their outcomes (committed / alone / failed / rejected, the loop's stats);
- the success ratio (committed over attempted) and committed over due;
- the group size of each committed round (how many of R took part) and the share with all R;
- group formation time (round start to matchmaking's formed group, `RoundResult.formation_s`)
  p50/p95 and the share formed within the matchmaking window (`sync.matchmaking_s`);
- round duration p50/p95; memory (proportional set size of each replica's whole process tree);
- the 1-minute load at each R's start and end: the machine's cores are shared by all R replicas'
  processes, so at large R the times include waiting for a core. Read them beside the load. Each
  R starts once the load the previous one left has decayed to `--settle-load`.

The DHT is insecure (`--insecure`'s): admission would need an authorizer and a credential per
replica, and it is the averaging protocol that is measured here. Each figure's growth against R
is fitted as constant / log R / R (bench/many_nodes.py's `growth`). Writes
bench/results/averaging_scale.md and .json.

    python bench/averaging_scale.py --replicas 2 4 8 16 --rounds 20       # the full run, alone
    python bench/averaging_scale.py --replicas 2 3 --rounds 4              # shows it works
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agora.bench.many_nodes import growth, settle_load
from agora.node.host_cpu import TREE_PARTS, tree_cpu_by_part, tree_usage
from agora.node.demo.processes import ChildFailed, ProcessGroup

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUTCOME_NAMES = ("committed", "alone", "failed", "rejected", "cancelled")


@dataclass(frozen=True)
class Pace:
    """How the replicas step and average: one step every `step_s`, a round every `every_steps`."""

    rounds: int
    step_s: float
    every_steps: int
    matchmaking_s: float

    @property
    def round_every_s(self) -> float:
        return self.step_s * self.every_steps

    def argv(self) -> list[str]:
        return ["--rounds", str(self.rounds), "--step-s", str(self.step_s), "--every-steps", str(self.every_steps),
                "--matchmaking-s", str(self.matchmaking_s)]


@dataclass
class Row:
    replicas: int
    reported: int  # replicas whose results came back
    rounds_due: int
    attempted_per_replica: float
    attempted_min: int
    outcomes: dict
    skipped: int
    success_ratio: float  # committed / attempted
    committed_of_due: float  # committed / (rounds due x replicas)
    group_mean: float
    full_group_ratio: float  # committed rounds whose group held all R
    formation_p50_s: float
    formation_p95_s: float
    formed_in_window_ratio: float  # formed groups whose formation took at most matchmaking_s
    duration_p50_s: float
    duration_p95_s: float
    matchmaking_s: float
    round_every_s: float
    load_start: float = math.nan
    load_end: float = math.nan
    pss_mib_per_replica: float = math.nan
    startup_s: float = math.nan
    window_s: float = math.nan
    # Each replica's round start behind the first of the same round's (s): the replicas step together,
    # so this is what the shared cores and the loop put between them (the simulator's input).
    start_offsets_s: tuple = ()
    # The CPU seconds of every replica's process tree over the window, per round due: what the
    # simulator's inputs (one round's matchmaking and all-reduce, the probes and beats between rounds)
    # add up to, measured whole.
    cpu_s_per_round: float = math.nan
    # The same split by process (bench/many_nodes.py's `tree_cpu_by_part`): the replicas' own
    # processes, their p2pd daemons, and their forked DHT and averager processes.
    cpu_s_per_round_by_part: dict = field(default_factory=dict)
    # Each replica's own DHT requests per round due (its loop's probes, closes and announcements, its
    # heartbeat), by operation and record family, the mean over replicas: what the simulator's
    # background and matchmaking make of them is set beside it.
    dht_requests_per_round: dict = field(default_factory=dict)

    @property
    def start_offset_p50_s(self) -> float:
        return percentile(list(self.start_offsets_s), 0.5)

    @property
    def start_offset_p95_s(self) -> float:
        return percentile(list(self.start_offsets_s), 0.95)

    def _part(self, part: str) -> float:
        return self.cpu_s_per_round_by_part.get(part, math.nan)

    @property
    def cpu_p2pd_s(self) -> float:
        return self._part("p2pd")

    @property
    def cpu_children_s(self) -> float:
        return self._part("children")

    @property
    def cpu_main_s(self) -> float:
        return self._part("main")

    def _requests(self, operation: str) -> float:
        counts = self.dht_requests_per_round
        return sum(n for name, n in counts.items() if name.startswith(operation + " ")) if counts else math.nan

    @property
    def dht_gets_per_round(self) -> float:
        return self._requests("get")

    @property
    def dht_stores_per_round(self) -> float:
        return self._requests("store")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else math.nan


def aggregate(replicas: int, reports: list[dict], pace: Pace) -> Row:
    """The table's row for R from each replica's report (`rounds`: its round rows, `stats`: the
    loop's `AveragingStats.snapshot()`)."""
    outcomes = {name: 0 for name in OUTCOME_NAMES}
    attempted, skipped = [], 0
    for report in reports:
        by_outcome = report["stats"]["rounds_by_outcome"]
        for name in OUTCOME_NAMES:
            outcomes[name] += int(by_outcome.get(name, 0))
        attempted.append(sum(int(n) for n in by_outcome.values()))
        skipped += int(report["stats"].get("skipped", 0))
    rows = [row for report in reports for row in report["rounds"]]
    committed = [row for row in rows if row["outcome"] == "committed"]
    formations = [row["formation_s"] for row in rows if row.get("formation_s") is not None]
    total = sum(attempted)
    return Row(
        replicas=replicas, reported=len(reports), rounds_due=pace.rounds,
        attempted_per_replica=_ratio(total, len(reports)), attempted_min=min(attempted, default=0),
        outcomes=outcomes, skipped=skipped, success_ratio=_ratio(outcomes["committed"], total),
        committed_of_due=_ratio(outcomes["committed"], pace.rounds * replicas),
        group_mean=_ratio(sum(row["group_size"] for row in committed), len(committed)),
        full_group_ratio=_ratio(sum(row["group_size"] >= replicas for row in committed), len(committed)),
        formation_p50_s=percentile(formations, 0.5), formation_p95_s=percentile(formations, 0.95),
        formed_in_window_ratio=_ratio(sum(f <= pace.matchmaking_s for f in formations), len(formations)),
        duration_p50_s=percentile([row["duration_s"] for row in rows], 0.5),
        duration_p95_s=percentile([row["duration_s"] for row in rows], 0.95),
        matchmaking_s=pace.matchmaking_s, round_every_s=pace.round_every_s, start_offsets_s=tuple(start_offsets(rows)),
        dht_requests_per_round=requests_per_round(reports, pace.rounds))


def requests_per_round(reports: list[dict], rounds: int) -> dict[str, float]:
    """The replicas' own DHT requests per replica and round due, by "operation family" (reports
    written before replicas counted them have none)."""
    counted = [report["dht_requests"] for report in reports if "dht_requests" in report]
    names = sorted({name for counts in counted for name in counts})
    return {name: round(sum(counts.get(name, 0) for counts in counted) / (len(counted) * rounds), 3)
            for name in names}


def start_offsets(rows: list[dict]) -> list[float]:
    """Every start of a round behind the first start of the same round, in seconds (rounds with one
    start say nothing of the spread and are left out; rows recorded before starts were are too)."""
    by_round: dict[int, list[float]] = {}
    for row in rows:
        if row.get("started_s") is not None:
            by_round.setdefault(row["round"], []).append(row["started_s"])
    return [round(start - min(starts), 4) for starts in by_round.values() if len(starts) > 1 for start in starts]


# ---- one R -----------------------------------------------------------------------------------------

def replica_command(index: int, replicas: int, workdir: Path, pace: Pace, peers: list[str]) -> list[str]:
    return [sys.executable, "-m", "agora.bench.averaging_replica", "--workdir", str(workdir), "--index", str(index),
            "--replicas", str(replicas), *pace.argv(), *(["--initial-peers", *peers] if peers else [])]


def _wait_for_reports(group: ProcessGroup, workdir: Path, replicas: int, timeout_s: float) -> list[dict]:
    """Each replica's results once all are in (or the deadline passed: those that came)."""
    paths = [workdir / f"replica-{i}.json" for i in range(replicas)]
    deadline = time.monotonic() + timeout_s
    while not all(path.exists() for path in paths) and time.monotonic() < deadline:
        for child in group.children:
            if not child.alive():
                raise ChildFailed(f"{child.name} exited with code {child.process.returncode} during the window:\n"
                                  f"{child.log_tail()}")
        time.sleep(0.25)
    return [json.loads(path.read_text()) for path in paths if path.exists()]


def measure(replicas: int, pace: Pace, workdir: Path) -> Row:
    """Start R replicas, let `pace.rounds` rounds fall due, read their results; every child reaped."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    load_start, started = os.getloadavg()[0], time.monotonic()
    group = ProcessGroup(workdir)
    try:
        first = group.spawn("replica-0", replica_command(0, replicas, workdir, pace, []), workdir / "replica-0.dht")
        peers = group.wait_ready([first], 120)["replica-0"]
        for index in range(1, replicas):
            group.spawn(f"replica-{index}", replica_command(index, replicas, workdir, pace, peers))
        for index, child in enumerate(group.children):
            child.ready_path = workdir / f"replica-{index}.ready"
        group.wait_ready(group.children, 120 + 15 * replicas)  # R processes importing torch on shared cores
        startup_s = time.monotonic() - started
        go = time.monotonic() + 1.0
        (workdir / "go.partial").write_text(repr(go))
        os.replace(workdir / "go.partial", workdir / "go")
        parts_start = _parts(group)
        window = pace.rounds * pace.round_every_s
        reports = _wait_for_reports(group, workdir, replicas, window + 60.0)
        window_s = time.monotonic() - go
        parts = _parts(group)
        pss = sum(tree_usage(child.pid)[1] for child in group.children)
    finally:
        group.shutdown(grace_s=15.0)
    row = aggregate(replicas, reports, pace)
    row.load_start, row.load_end = load_start, os.getloadavg()[0]
    row.pss_mib_per_replica, row.startup_s, row.window_s = pss / replicas, startup_s, window_s
    row.cpu_s_per_round_by_part = {part: round((parts[part] - parts_start[part]) / pace.rounds, 4) for part in TREE_PARTS}
    row.cpu_s_per_round = sum(parts[part] - parts_start[part] for part in TREE_PARTS) / pace.rounds
    return row


def _parts(group: ProcessGroup) -> dict[str, float]:
    """Every replica's CPU so far, summed by part of its process tree."""
    trees = [tree_cpu_by_part(child.pid) for child in group.children]
    return {part: sum(tree[part] for tree in trees) for part in TREE_PARTS}


# ---- the report ------------------------------------------------------------------------------------

COLUMNS = [("attempted_per_replica", "attempted / replica"), ("success_ratio", "committed / attempted"),
           ("committed_of_due", "committed / due"), ("group_mean", "group mean"),
           ("full_group_ratio", "groups of all R"), ("formation_p50_s", "formation p50 s"),
           ("formation_p95_s", "formation p95 s"), ("formed_in_window_ratio", "formed within window"),
           ("duration_p50_s", "round p50 s"), ("duration_p95_s", "round p95 s"),
           ("start_offset_p50_s", "start behind the round's first p50 s"), ("start_offset_p95_s", "p95 s"),
           ("cpu_s_per_round", "host CPU s / round"), ("cpu_p2pd_s", "of it p2pd"),
           ("cpu_children_s", "DHT and averager processes"), ("cpu_main_s", "replica processes"),
           ("dht_gets_per_round", "own DHT gets / replica / round"), ("dht_stores_per_round", "stores"),
           ("pss_mib_per_replica", "PSS MiB / replica")]


def _cell(value) -> str:
    if isinstance(value, float):
        return "-" if not math.isfinite(value) else f"{value:.3g}"
    return str(value)


def report(rows: list[Row], pace: Pace, command: str) -> str:
    lines = ["# Averaging against a stage's replica count (bench/averaging_scale.py)", "",
             f"`{command}` on {time.strftime('%Y-%m-%d %H:%M')}; {platform.node()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}. R replicas of tiny's middle stage (of 3), each its own process "
             f"with its own DHT peer, averager and p2pd, insecure DHT (no admission); a step every {pace.step_s:g} s, "
             f"a round every {pace.every_steps} steps ({pace.round_every_s:g} s), {pace.rounds} rounds due per R, "
             f"matchmaking window {pace.matchmaking_s:g} s. Every replica's processes share this machine's cores: "
             "read the times beside the load.", "", *tables(rows)]
    return "\n".join(lines) + "\n"


def tables(rows: list[Row]) -> list[str]:
    """The figures per R with their fitted growth."""
    replicas = [row.replicas for row in rows]
    lines = ["| R | load start/end | startup s | outcomes (c/a/f/r) | skipped | "
             + " | ".join(title for _, title in COLUMNS) + " |",
             "|---:|---|---:|---|---:|" + "---:|" * len(COLUMNS)]
    for row in rows:
        o = row.outcomes
        lines.append(f"| {row.replicas} | {row.load_start:.1f}/{row.load_end:.1f} | {row.startup_s:.0f} | "
                     f"{o['committed']}/{o['alone']}/{o['failed']}/{o['rejected']} | {row.skipped} | "
                     + " | ".join(_cell(getattr(row, name)) for name, _ in COLUMNS) + " |")
    fitted = [growth(replicas, [getattr(r, name) for r in rows]).replace("N", "R") for name, _ in COLUMNS]
    lines.append("| growth | | | | | " + " | ".join(fitted) + " |")
    lines += ["", "Outcomes are summed over the replicas (each replica's view of each round it attempted). "
              "Growth is the best of constant / log R / R fitted to the R values (needs three)."]
    return lines


def section(path: Path) -> list[str]:
    """RESULTS.md's section 11 from bench/averaging_scale.py's JSON (nothing when it was never run)."""
    if not path.exists():
        return []
    rows = [Row(**row) for row in json.loads(path.read_text())]
    return ["## 11. A stage's averaging against its replica count (bench/averaging_scale.py)", "",
            "R replicas of tiny's middle stage, each its own process with its own DHT peer, averager and p2pd, "
            "on this machine's two cores (insecure DHT); bench/results/averaging_scale.md has the pace.", "",
            *tables(rows)]


SUMMARY_LABEL = ("| 11 | a stage's averaging against its replica count (bench/averaging_scale.py): rounds committed, "
                 "group formation against the matchmaking window, at the largest R |")


def summary_row(path: Path) -> str:
    """RESULTS.md's row from bench/averaging_scale.py's JSON (or a line saying it was never run)."""
    if not path.exists():
        return f"{SUMMARY_LABEL} not measured: `python bench/averaging_scale.py --replicas 2 4 8 16` | - | - |"
    rows = [Row(**row) for row in json.loads(path.read_text())]
    last = rows[-1]
    measured = (f"R={last.replicas}: {last.success_ratio:.0%} of attempted rounds committed, groups of all R "
                f"{last.full_group_ratio:.0%}, formation p95 {last.formation_p95_s:.2f} s of a "
                f"{last.matchmaking_s:g} s window (R={'/'.join(str(r.replicas) for r in rows)}: "
                f"{', '.join(f'{r.formation_p95_s:.2f}' for r in rows)} s; load {last.load_start:.0f}->"
                f"{last.load_end:.0f}; insecure DHT) (bench/results/averaging_scale.md)")
    met = last.replicas >= 16 and last.success_ratio >= 0.95 and last.formed_in_window_ratio >= 1.0
    return f"{SUMMARY_LABEL} {measured} | >= 95% at R = 16, formed within the window | {'yes' if met else 'no'} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=20, help="rounds due per R (the window)")
    parser.add_argument("--step-s", type=float, default=2.0, help="seconds between the stage's steps")
    parser.add_argument("--every-steps", type=int, default=4, help="sync.every_steps: steps between rounds")
    parser.add_argument("--matchmaking-s", type=float, default=3.0, help="sync.matchmaking_s (tiny's default)")
    parser.add_argument("--settle-load", type=float, default=1.0,
                        help="before each R, wait until the 1-minute load is at most this (the previous R's "
                             "replicas gone; at most --settle-s); 0: do not wait")
    parser.add_argument("--settle-s", type=float, default=300.0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/agora-averaging-scale"))
    parser.add_argument("--out", type=Path, default=RESULTS / "averaging_scale.md")
    args = parser.parse_args(argv)
    if any(r < 2 for r in args.replicas):
        parser.error("--replicas: each R needs at least 2 replicas to average")
    if args.rounds < 1 or args.step_s <= 0 or args.every_steps < 1 or args.matchmaking_s <= 0:
        parser.error("--rounds and --every-steps must be >= 1, --step-s and --matchmaking-s > 0")
    pace = Pace(args.rounds, args.step_s, args.every_steps, args.matchmaking_s)
    rows = []
    for replicas in args.replicas:
        if args.settle_load > 0:
            settle_load(args.settle_load, args.settle_s)
        print(f"averaging-scale: R={replicas}, 1-minute load {os.getloadavg()[0]:.2f}", flush=True)
        rows.append(measure(replicas, pace, args.workdir / f"r{replicas}"))
        print(json.dumps(asdict(rows[-1])), flush=True)
    command = "python bench/averaging_scale.py " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(rows, pace, command))
    args.out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
