"""Where a node's CPU goes when it has little or nothing to do: per role, per process, from /proc.

Two swarms, each measured over one window after a warm-up:

- ``idle``: what a contributor's daemon costs with no trainer in the run: an admitted swarm of an
  authorizer, a bootstrap peer and S stages x R replicas of `agora-node join`, started as a user
  would start them (the demo's process group, forked from one server that imported agora-node);
- ``loaded``: `agora-node demo` under a light trainer load, the geometry of bench/many_nodes.py
  (tiny's blocks, one 32-token microbatch per global batch, heartbeat 5 s), with its monitor.

Every process of the swarm is named by its role (the launcher names each child; the processes a
role forks keep the name) and by its kind: ``main`` (the role's own process), ``dht`` (hivemind's
DHT process, the parent of a ``p2pd``), ``averager`` (hivemind's averager process), ``p2pd`` (the
libp2p daemon) and ``other`` (torch's shared-memory manager). The figure is CPU seconds
(utime + stime, /proc/PID/stat) per minute of window; the 1-minute load average is recorded at
both ends, since on a shared machine a process's CPU time includes the work of waiting for a core.
With ``--profile DIR`` every Python process also profiles its main thread over the window, in CPU
time (bench/idle_profile/sitecustomize.py), into ``DIR/<role>-<pid>.prof``.

    python bench/idle_cpu.py --mode idle loaded --window 60
    python bench/idle_cpu.py --mode idle --stages 1 --replicas 1 --window 10 --warmup 5   # shows it works
    python bench/idle_cpu.py --mode idle --profile /tmp/profiles   # then: python -m pstats /tmp/profiles/...
    python bench/idle_cpu.py --mode idle --stages 4 --replicas 1 4 8   # how an idle node's cost grows with N

With several ``--replicas``, every geometry is measured in turn and a last table puts a worker's
CPU beside the number of DHT peers N (workers, the bootstrap and the authorizer), with each
figure's growth from the smallest N against what log N and N would give.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from agora.node.authorizer import LOCAL_RUN_FLAGS, issue_credential
from agora.node.demo.launcher import warm_up
from agora.node.demo.processes import ProcessGroup, agora_node_command

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
RUN_ID = "idle"
KINDS = ("main", "dht", "p2pd", "averager", "other")
PYTHON_KINDS = ("main", "dht", "averager")  # the processes that run the profiling hook
PROFILE_HOOK = Path(__file__).resolve().parent / "idle_profile"


@dataclass(frozen=True)
class Process:
    pid: int
    parent: int
    name: str


def _stat(pid: int) -> tuple[str, int, float]:
    """(name, parent pid, CPU seconds) of one process."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()
    return text[text.index("(") + 1:text.rindex(")")], int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def descendants(root: int) -> dict[int, Process]:
    """Every live descendant of `root` (not `root` itself)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                name, parent, _ = _stat(int(entry.name))
            except (OSError, ValueError):
                continue
            table[int(entry.name)] = Process(int(entry.name), parent, name)
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child in (p for p in table.values() if p.parent == pid and p.pid not in found):
            found[child.pid] = child
            frontier.append(child.pid)
    return found


def classify(processes: dict[int, Process]) -> dict[int, tuple[str, str]]:
    """(role, kind) of each process: see the module docstring."""
    labels = {}
    for process in processes.values():
        parent = processes.get(process.parent)
        if process.name == "p2pd":
            role = processes[process.parent].name if parent else "?"
            labels[process.pid] = (role, "p2pd")
        elif process.name.startswith("torch_shm"):
            labels[process.pid] = (parent.name if parent else "?", "other")
        elif parent is None or parent.name != process.name:
            labels[process.pid] = (process.name, "main")
        elif any(p.parent == process.pid and p.name == "p2pd" for p in processes.values()):
            labels[process.pid] = (process.name, "dht")
        else:
            labels[process.pid] = (process.name, "averager")
    return labels


def cpu_seconds(pids) -> dict[int, float]:
    out = {}
    for pid in pids:
        try:
            out[pid] = _stat(pid)[2]
        except (OSError, ValueError):
            continue
    return out


@dataclass
class Window:
    mode: str
    geometry: str
    window_s: float
    load_start: float
    load_end: float
    # role -> kind -> CPU seconds per minute (roles of a kind, e.g. every worker, are kept apart)
    per_role: dict
    batches: int | None = None  # global batches the trainer logged in the window (loaded)


def _lines(path: Path | None) -> int:
    try:
        return path.read_text().count("\n") if path is not None else 0
    except OSError:
        return 0


def toggle_profiles(labels: dict[int, tuple[str, str]]) -> None:
    """Start, or stop and write, the profile of every Python process (SIGUSR2 to the hook)."""
    for pid, (_, kind) in labels.items():
        if kind in PYTHON_KINDS:
            try:
                os.kill(pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass


def measure_window(root: int, window_s: float, mode: str, geometry: str, trainer_log: Path | None = None,
                   profile: bool = False) -> Window:
    processes = descendants(root)
    labels = classify(processes)
    load_start = os.getloadavg()[0]
    if profile:
        toggle_profiles(labels)
    before, batches_before = cpu_seconds(processes), _lines(trainer_log)
    started = time.monotonic()
    time.sleep(window_s)
    after, batches = cpu_seconds(processes), _lines(trainer_log) - batches_before
    elapsed = time.monotonic() - started
    if profile:
        toggle_profiles(labels)
    per_role: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for pid, (role, kind) in labels.items():
        if pid in before and pid in after:
            per_role[role][kind] += (after[pid] - before[pid]) * 60 / elapsed
    return Window(mode, geometry, round(elapsed, 1), load_start, os.getloadavg()[0],
                  {role: dict(kinds) for role, kinds in sorted(per_role.items())},
                  batches if trainer_log is not None else None)


# ---- the swarms ------------------------------------------------------------------------------------

def _tiny_run(stages: int, matchmaking_s: float | None) -> list[str]:
    """The run's settings, as every process of it gets them."""
    sync = [] if matchmaking_s is None else ["--sync.matchmaking-s", str(matchmaking_s)]
    return ["--config", "tiny", "--stages", str(stages), "--run-id", RUN_ID, *sync]


def start_idle_swarm(workdir: Path, stages: int, replicas: int, heartbeat_s: float,
                     matchmaking_s: float | None) -> ProcessGroup:
    """Authorizer, bootstrap and S x R workers, admitted, no trainer: `agora-node` as a user runs it."""
    group = ProcessGroup(workdir)
    warm_up()
    common = ["--log-level", "WARNING", "--threads", "1"]
    authorizer_dir = workdir / "authorizer"
    issue_credential(str(authorizer_dir), str(workdir / "bootstrap.state"), role="operator", run_id=RUN_ID,
                     lifetime_s=24 * 3600)
    boot = group.spawn("bootstrap", agora_node_command(*common, "bootstrap", "--state-dir",
                                                       str(workdir / "bootstrap.state"), "--host", "127.0.0.1",
                                                       "--ready-file", str(workdir / "bootstrap.ready")),
                       workdir / "bootstrap.ready")
    maddrs = group.wait_ready([boot], 120)["bootstrap"]
    authorizer = group.spawn("authorizer", agora_node_command(
        *common, "authorizer", "serve", "--state-dir", str(authorizer_dir), "--host", "127.0.0.1",
        "--ready-file", str(workdir / "authorizer.ready"), "--min-upload-mbit", "0", "--min-download-mbit", "0",
        "--max-rtt-ms", "inf", "--min-accelerator-gb", "0", "--min-ram-gb", "0", "--preflight-bytes",
        str(256 << 10), *LOCAL_RUN_FLAGS, *_tiny_run(stages, matchmaking_s), "--initial-peers", *maddrs),
        workdir / "authorizer.ready")
    group.wait_ready([authorizer], 120)
    workers = []
    for stage in range(stages):
        for replica in range(replicas):
            name = f"worker-s{stage}-r{replica}"
            workers.append(group.spawn(name, agora_node_command(
                *common, "join", "--stage", str(stage), "--host", "127.0.0.1", "--dht-host", "127.0.0.1",
                *_tiny_run(stages, matchmaking_s), "--join-file", str(authorizer_dir / "join.json"), "--state-dir",
                str(workdir / f"{name}.state"), "--heartbeat", str(heartbeat_s), "--initial-peers", *maddrs,
                "--ready-file", str(workdir / f"{name}.ready")), workdir / f"{name}.ready"))
    group.wait_ready(workers, 300)
    return group


def demo_command(stages: int, replicas: int, workdir: Path, heartbeat_s: float,
                 matchmaking_s: float | None) -> list[str]:
    """bench/many_nodes.py's demo: compute negligible next to coordination."""
    sync = [] if matchmaking_s is None else ["--sync.matchmaking-s", str(matchmaking_s)]
    return [sys.executable, "-m", "agora.node", "demo", "--config", "tiny", "--stages", str(stages),
            "--replicas", str(replicas), "--trainers", "1", "--steps", "100000", "--time-budget", "3600",
            "--heartbeat", str(heartbeat_s), "--workdir", str(workdir), "--train.batch-size", "2",
            "--train.microbatches", "1", "--train.seq-len", "32", "--train.eval-every", "0", *sync]


def wait_for_training(workdir: Path, process: subprocess.Popen, timeout_s: float) -> None:
    """Until the trainer has logged a global batch (its log is written per batch)."""
    log = workdir / "trainer-0.jsonl"
    deadline = time.monotonic() + timeout_s
    while not (log.exists() and log.stat().st_size > 0):
        if process.poll() is not None:
            raise RuntimeError(f"the demo exited ({process.returncode}) before training; see {workdir}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no global batch within {timeout_s:.0f} s; see {workdir}")
        time.sleep(1.0)


def run_mode(mode: str, args: argparse.Namespace) -> Window:
    workdir = args.workdir / mode
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    geometry = (f"{args.stages}x{args.replicas}" + (" + 1t" if mode == "loaded" else "")
                + (f", sync.matchmaking_s {args.matchmaking:g}" if args.matchmaking is not None else ""))
    if mode == "idle":
        group = start_idle_swarm(workdir, args.stages, args.replicas, args.heartbeat, args.matchmaking)
        try:
            time.sleep(args.warmup)
            return measure_window(os.getpid(), args.window, mode, geometry, profile=args.profile is not None)
        finally:
            group.shutdown()
    with (workdir / "demo.out").open("w") as log:
        process = subprocess.Popen(demo_command(args.stages, args.replicas, workdir / "swarm", args.heartbeat,
                                                args.matchmaking),
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_training(workdir / "swarm", process, 600)
            time.sleep(args.warmup)
            return measure_window(process.pid, args.window, mode, geometry, workdir / "swarm" / "trainer-0.jsonl",
                                  profile=args.profile is not None)
        finally:
            os.killpg(process.pid, signal.SIGINT)  # the demo stops its swarm in order
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


# ---- the report ------------------------------------------------------------------------------------

def report(windows: list[Window], command: str) -> str:
    lines = ["# CPU of idle and lightly loaded nodes (bench/idle_cpu.py)", "",
             f"`{command}` on {time.strftime('%Y-%m-%d %H:%M')}; {platform.node()}, {os.cpu_count()} cores. "
             "CPU seconds per minute of window, by role and process (main, hivemind's DHT process, its p2pd, "
             "the averager process, other).", ""]
    for window in windows:
        work = "" if window.batches is None else f", {window.batches} global batches"
        lines += [f"## {window.mode} ({window.geometry}), {window.window_s:.0f} s{work}, 1-minute load "
                  f"{window.load_start:.2f} -> {window.load_end:.2f}", "",
                  "| role | " + " | ".join(KINDS) + " | total |", "|---|" + "---:|" * (len(KINDS) + 1)]
        totals = defaultdict(float)
        for role, kinds in window.per_role.items():
            for kind, value in kinds.items():
                totals[kind] += value
            lines.append(f"| {role} | " + " | ".join(f"{kinds.get(k, 0.0):.2f}" for k in KINDS)
                         + f" | {sum(kinds.values()):.2f} |")
        lines += ["| all | " + " | ".join(f"{totals[k]:.2f}" for k in KINDS) + f" | {sum(totals.values()):.2f} |"]
        if window.batches:
            per_batch = sum(totals.values()) * window.window_s / 60 / window.batches
            lines.append(f"\nCPU seconds per global batch, whole swarm: {per_batch:.3f}")
        lines.append("")
    return "\n".join(lines)


def _worker_means(window: Window) -> dict[str, float]:
    """A worker's mean CPU s/min by kind, over the window's workers, and its total."""
    workers = [kinds for role, kinds in window.per_role.items() if role.startswith("worker-")]
    means = {kind: sum(w.get(kind, 0.0) for w in workers) / max(1, len(workers)) for kind in KINDS}
    means["total"] = sum(means.values())
    return means


def scale_table(windows: list[Window], peers: list[int]) -> str:
    """A worker's CPU against the number of DHT peers, growth against log N and N (module docstring)."""
    rows = [(n, window, _worker_means(window)) for n, window in zip(peers, windows)]
    n0, _, base = rows[0]
    lines = ["## A worker's CPU against the number of DHT peers", "",
             "| DHT peers N | geometry | load | main | DHT process | p2pd | worker total | / smallest N | "
             "log N / log N0 | N / N0 |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for n, window, means in rows:
        lines.append(f"| {n} | {window.geometry} | {window.load_start:.1f} -> {window.load_end:.1f} | "
                     f"{means['main']:.2f} | {means['dht']:.2f} | {means['p2pd']:.2f} | {means['total']:.2f} | "
                     f"{means['total'] / base['total']:.2f} | {math.log(n) / math.log(n0):.2f} | {n / n0:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", nargs="+", choices=("idle", "loaded"), default=["idle", "loaded"])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2],
                        help="replicas per stage; several: each geometry in turn, and the scale table")
    parser.add_argument("--heartbeat", type=float, default=5.0, help="the workers' DHT heartbeat (join's default)")
    parser.add_argument("--matchmaking", type=float, default=None,
                        help="the run's sync.matchmaking_s (default: tiny's 3 s; the schema's is 40): the averaging "
                        "board is read every quarter of it, every half when quiet")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds after the swarm is up")
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/agora-idle-cpu"))
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    parser.add_argument("--profile", type=Path, default=None, help="write each process's profile of the window here")
    args = parser.parse_args(argv)
    if args.profile is not None:  # the swarm's processes inherit this environment, and with it the hook
        args.profile.mkdir(parents=True, exist_ok=True)
        os.environ["AGORA_BENCH_PROFILE_DIR"] = str(args.profile.resolve())
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROFILE_HOOK), os.environ.get("PYTHONPATH")]))
    windows, series = [], defaultdict(list)
    for mode in args.mode:
        for replicas in args.replicas:
            print(f"idle-cpu: {mode}, {args.stages}x{replicas}", flush=True)
            windows.append(run_mode(mode, argparse.Namespace(**{**vars(args), "replicas": replicas})))
            series[mode].append((args.stages * replicas + 2, windows[-1]))  # + the bootstrap and the authorizer
            print(json.dumps(asdict(windows[-1])), flush=True)
    text = report(windows, "python bench/idle_cpu.py " + " ".join(sys.argv[1:] if argv is None else argv))
    if len(args.replicas) > 1 and "idle" in series:
        text += "\n" + scale_table([w for _, w in series["idle"]], [n for n, _ in series["idle"]])
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
