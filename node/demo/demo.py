"""`agora-node demo`: a whole swarm on loopback, each role its own `agora-node <role>` process.

Order: bootstrap (its ready file carries the DHT multiaddrs) -> one `join` per stage replica
(ready file: gRPC endpoint + peer id, written once announced in the DHT) -> trainers. Unless
`--no-monitor`, an `agora-node monitor` starts beside the workers (after the authorizer, whose
monitor credential it joins with) and the demo prints its status page's URL; every
process serves Prometheus metrics on a free port (workers and trainers announce theirs in the
DHT; the authorizer's and the bootstrap's are given to the monitor as static targets), so the
monitor's `/sd` lists them all. In an admitted run the monitor keeps the ledger of verified work
(`ledger.sqlite` in the work directory) and the trainers post their receipts to it. While the trainers run, a progress bar (plain lines when not a
terminal) shows global batches, loss, tokens/s and live workers per stage. When they finish,
workers and the bootstrap get SIGTERM (clean leave), every process is reaped, the trainers'
logs are merged into one JSON line per global batch (run-wide `step`, the train-local schema)
and a short human-readable summary is printed; `--summary-json` writes the full one. Ctrl-C
stops everything the same way and still prints what was done. Workers average with the other replicas
of their stage (the config's `sync` method unless `--averaging` says otherwise); each writes its
averaging counters to a stats file when it leaves, and the summary adds them up per stage.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from agora.node.authorizer import LOCAL_RUN_FLAGS, issue_credential
from agora.node.demo.launcher import warm_up
from agora.node.demo.processes import ChildFailed, ChildProcess, Placement, ProcessGroup, agora_node_command
from agora.node.demo.chaos import Chaos, ChaosEvent
from agora.node.demo.stall import StallWatch, report_stall, stage_left_empty
from agora.node.host_cpu import CpuWindow
from agora.node.demo.summary import build_summary, churn_summary, format_summary, latest_per_trainer, merge_logs
from agora.node.progress import Progress
from agora.node.demo.options import DemoOptions
from agora.pipeline.checkpoint import checkpoint_steps
from agora.pipeline.config import ConfigError
from agora.pipeline.files import atomic_write

__all__ = ["DemoOptions", "run_demo", "merge_logs"]

logger = logging.getLogger("agora.node.demo")


def run_demo(options: DemoOptions, placement: Placement | None = None) -> int:
    """`placement`: where each process runs (default: this machine's loopback; bench/wan/ puts each
    in a network namespace of its own behind emulated links)."""
    workdir = (Path(options.workdir) if options.workdir else Path(tempfile.mkdtemp(prefix="agora-demo-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    group = ProcessGroup(workdir) if placement is None else ProcessGroup(workdir, placement=placement)
    warm_up()  # the children's fork server imports while the operator's credential is minted
    started = time.monotonic()
    resume_step = _resume_step(workdir, options) if options.resume else None
    workers: list[tuple[int, ChildProcess]] = []
    trainers: list[ChildProcess] = []
    trainer_logs: list[Path] = []
    killed: list[str] = []
    chaos = Chaos(options.chaos_s, options.chaos_seed) if options.chaos_s else None
    joins: list[tuple[str, datetime]] = []
    live_log = _LiveLog(Path(options.log_json)) if options.log_json else None
    progress = Progress(options.steps, "demo")
    outcome = "completed"
    code = 0
    lines: list[dict] = []
    cpu: dict | None = None  # CpuWindow's reading over the training
    # Ctrl-C and a supervisor's SIGTERM both stop the swarm in order and still print a summary.
    previous = _interrupt_on(signal.SIGINT, signal.SIGTERM)
    try:
        threads = ["--threads", str(options.threads)]
        common = ["--log-level", "WARNING", *threads]
        # Every process serves its metrics on a port the kernel picks (a port picked here could be
        # taken by another process before the child binds it). Workers and trainers announce theirs
        # in their DHT records; those outside the DHT's records (the bootstrap, the authorizer) write
        # it to a file once serving, and the monitor gets it as a static target.
        static_targets: list[str] = []

        def metrics_flags(role: str | None = None) -> list[str]:
            if role is None:
                return ["--metrics-port", "auto"]
            return ["--metrics-port", "auto", "--metrics-file", str(_metrics_file(workdir, role))]

        if options.insecure:
            print("demo: WARNING: --insecure: no authorizer, no TLS, no credential checks, no signed DHT records",
                  file=sys.stderr, flush=True)
        if resume_step is not None:
            print(f"demo: resuming every role from its checkpoint of step {resume_step} in {workdir}",
                  file=sys.stderr, flush=True)
        maddrs = _start_bootstrap(group, options, workdir, common, metrics_flags("bootstrap"))
        static_targets.append(_static_target(workdir, "bootstrap"))
        swarm = ["--run-id", options.run_id, "--initial-peers", *maddrs] + (["--sync"] if options.sync else [])
        admission = ["--insecure"]
        if not options.insecure:
            authorizer = _start_authorizer(group, options, workdir, maddrs, common, metrics_flags("authorizer"))
            static_targets.append(_static_target(workdir, "authorizer"))
            print(f"demo: authorizer {authorizer} (run {options.run_id!r}); nodes join with "
                  f"--join-file {workdir / 'authorizer' / 'join.json'}", file=sys.stderr, flush=True)
            admission = ["--join-file", str(workdir / "authorizer" / "join.json")]
        # The monitor starts beside the workers (it only reads the DHT) and is waited for with them.
        monitor = _start_monitor(group, options, workdir, swarm, admission, static_targets, common) \
            if options.monitor else None

        def start_worker(stage: int, name: str, resume: bool) -> ChildProcess:
            ready = workdir / f"{name}.ready"
            checkpoints = [] if options.checkpoint_every is None else ["--checkpoint-every", str(options.checkpoint_every)]
            if resume:
                checkpoints += ["--resume-step", str(resume_step)]
            # INFO: each averaging round's milestone line lands in the worker's log file.
            host = group.host(name)
            command = agora_node_command("--log-level", "INFO", *threads, "join", "--stage", str(stage),
                                         "--host", host, "--dht-host", host,
                                         *options.run_flags(), *swarm, *options.worker_flags(),
                                         *options.tracing_flags(), *admission,
                                         *_state_dir(options, workdir, name), *checkpoints,
                                         "--stats-file", str(workdir / f"{name}.stats.json"),
                                         "--heartbeat", str(options.heartbeat_s), "--ready-file", str(ready),
                                         *metrics_flags())
            return group.spawn(name, command, ready)

        def start_trainer(index: int, name: str, newcomer: bool = False) -> ChildProcess:
            log = workdir / f"{name}.jsonl"
            # --time-budget is the run's training time: a newcomer trainer (chaos) gets what is left
            # of it, not a budget of its own that each kill would restart (the run would end only
            # once a trainer outlived a whole budget). Nothing left: a millisecond, one batch at most.
            budget = options.time_budget_s
            if budget is not None and newcomer:
                budget = max(1e-3, budget - (time.monotonic() - trainers_started))
            trainer_logs.append(log)
            start = []
            if resume_step:
                _truncate_log(log, resume_step)
                start = ["--start-step", str(resume_step)]
            command = agora_node_command(
                *common, "trainer", *options.run_flags(), *swarm,
                *_operator_issued(options, workdir, name, "trainer", admission),
                "--trainer-index", str(index), "--trainers", str(options.trainers), *start, *options.tracing_flags(),
                *([] if options.max_in_flight is None else ["--max-in-flight", str(options.max_in_flight)]),
                *([] if options.max_staleness is None else ["--max-staleness", str(options.max_staleness)]),
                *([] if budget is None else ["--time-budget", f"{budget:.3f}"]),
                *([] if options.trainer_lease_s is None else ["--lease", str(options.trainer_lease_s)]),
                "--log-json", str(log), "--summary-json", str(workdir / f"{name}.summary.json"),
                "--heartbeat", str(options.heartbeat_s), *metrics_flags(), *([] if index == 0 else ["--no-eval"]),
                *ledger_url)
            return group.spawn(name, command)

        for stage in range(options.stages or 1):
            for replica in range(options.replicas):
                workers.append((stage, start_worker(stage, f"worker-s{stage}-r{replica}", resume_step is not None)))
        ready = group.wait_ready([w for _, w in workers] + ([monitor] if monitor else []), options.ready_timeout_s)
        ledger_url: list[str] = []  # the trainers post their receipts to the monitor's ledger (secure runs)
        if monitor is not None:
            url = ready["monitor"][0]
            ledger_url = [] if options.insecure else ["--ledger-url", url.rstrip("/")]
            print(f"demo: status page {url} (Prometheus: service discovery {url}sd, swarm metrics {url}metrics)",
                  file=sys.stderr, flush=True)
        trainers_started = time.monotonic()  # the run's --time-budget counts from here
        trainers += [start_trainer(index, f"trainer-{index}") for index in range(options.trainers)]
        # What the other roles and the whole host burn while the run trains (the trainers read their own).
        cpu_window = CpuWindow({c.name: c.process.pid for c in group.children if c not in trainers})
        joined: list[str] = []
        logger.info("swarm up in %.1f s: %d workers, %d trainers", time.monotonic() - started, len(workers),
                    len(trainers))

        stall = StallWatch()
        while any(t.alive() for t in trainers):
            lines = merge_logs(trainer_logs)
            if cpu is None and len(lines) >= options.steps:  # the last batch is in: held-out evals are not training
                cpu = cpu_window.end()
            if stall.stalled(len(lines)):
                report_stall(group.children, len(lines), stall.after_s)
            if live_log is not None:
                live_log.write(trainer_logs)
            if options.kill_worker_at is not None and not killed and len(lines) >= options.kill_worker_at:
                victim = next(w for s, w in workers if s == (options.stages or 1) - 1 and w.alive())
                group.kill(victim)
                killed.append(victim.name)
                logger.warning("fault drill: killed %s with SIGKILL after %d global batches", victim.name, len(lines))
            while len(joined) < len(options.join_at) and len(lines) >= sorted(options.join_at)[len(joined)]:
                # A new contributor (own identity, empty state): it syncs before it counts (node/membership/phases.py).
                name = f"worker-s0-r{options.replicas + len(joined)}"
                workers.append((0, start_worker(0, name, False)))
                joined.append(name)
                logger.warning("a new replica of stage 0 joins after %d global batches", len(lines))
            # No churn once every batch is logged: a newcomer started while the swarm is being stopped
            # got SIGTERM inside torch's shared-memory start (hivemind's first MPFuture) and hung there
            # until its grace ran out and it was killed (seen twice in the chaos test, both times there).
            if chaos is not None and len(lines) < options.steps and chaos.due(time.monotonic() - started):
                _chaos_kill(chaos, group, workers, trainers, killed, joins, start_worker, start_trainer,
                            time.monotonic() - started)
            emptied = stage_left_empty(workers)
            if emptied is not None:
                raise ChildFailed(emptied)
            _show(progress, lines, _alive_per_stage(workers))
            time.sleep(0.2)  # the progress view's refresh; trainers are waited on via their exit
        if cpu is None:
            cpu = cpu_window.end()
        failed = [t for t in trainers if t.process.returncode != 0 and t.name not in killed]
        if failed:
            outcome = "failed"
            code = 1
            for t in failed:
                print(f"demo: {t.name} exited with {t.process.returncode}:\n{t.log_tail()}", file=sys.stderr)
    except ChildFailed as error:
        outcome, code = "failed", 1
        print(f"demo: {error}", file=sys.stderr)
    except KeyboardInterrupt:
        # Ending a demo early is a normal way to use it: clean stop, summary, exit 0.
        outcome = "interrupted"
    finally:
        for signum in previous:  # a second Ctrl-C must not cut the shutdown short
            signal.signal(signum, signal.SIG_IGN)
        lines = merge_logs(trainer_logs)
        _show(progress, lines, _alive_per_stage(workers), force=True)
        progress.close()
        exit_codes = group.shutdown()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    summary = build_summary(options, lines, workdir, workers, killed, exit_codes, outcome, time.monotonic() - started,
                            trainers=[t.name for t in trainers], cpu=cpu)
    if chaos is not None or resume_step is not None:
        summary["churn"] = churn_summary(options, lines, chaos.events if chaos else [], joins, workdir, resume_step)
    if live_log is not None:  # the run is over: its log in step order
        atomic_write(Path(options.log_json), "".join(json.dumps(line) + "\n" for line in lines).encode(), mode=0o644)
    if options.summary_json:
        Path(options.summary_json).write_text(json.dumps(summary, indent=1) + "\n")
    _print_summary(summary)
    if not options.workdir and code == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    return code


def _chaos_kill(chaos: Chaos, group: ProcessGroup, workers: list[tuple[int, ChildProcess]],
                trainers: list[ChildProcess], killed: list[str], joins: list[tuple[str, datetime]],
                start_worker, start_trainer, elapsed_s: float) -> None:
    """Kill the victim chaos picks and start a newcomer in its place (node/demo/chaos.py)."""
    # Only processes at work count: a worker serving (its ready file), a trainer that has run a unit
    # (its log). A newcomer still joining is no replica yet; while one is, nobody else is killed, so
    # the churn is one machine at a time.
    alive_workers = {w.name: stage for stage, w in workers if w.alive() and _ready(w)}
    alive_trainers = [t.name for t in trainers if t.alive() and _ready(t)]
    if any(event.replacement not in alive_workers and event.replacement not in alive_trainers
           and event.replacement not in killed for event in chaos.events[-1:]):
        chaos.choose(elapsed_s, {}, [])  # the last newcomer is still joining: this kill is skipped
        return
    victim = chaos.choose(elapsed_s, alive_workers, alive_trainers)
    if victim is None:
        return
    generation = sum(1 for event in chaos.events if event.killed.split(".")[0] == victim.split(".")[0]) + 1
    replacement = f"{victim.split('.')[0]}.j{generation}"
    if victim in alive_workers:
        stage = alive_workers[victim]
        group.kill(next(w for _, w in workers if w.name == victim))
        joins.append((replacement, datetime.now()))
        workers.append((stage, start_worker(stage, replacement, False)))
        chaos.events.append(ChaosEvent(round(elapsed_s, 2), victim, replacement, "worker", stage))
    else:
        group.kill(next(t for t in trainers if t.name == victim))
        index = int(victim.split(".")[0].rsplit("-", 1)[1])
        joins.append((replacement, datetime.now()))
        trainers.append(start_trainer(index, replacement, newcomer=True))
        chaos.events.append(ChaosEvent(round(elapsed_s, 2), victim, replacement, "trainer"))
    killed.append(victim)
    logger.warning("chaos: killed %s with SIGKILL; %s joins in its place", victim, replacement)


def _ready(child: ChildProcess) -> bool:
    if child.ready_path is not None:
        return child.ready_path.exists()
    log = child.log_path.with_suffix(".jsonl")  # a trainer: it has completed a global batch
    return log.exists() and log.stat().st_size > 0


class _LiveLog:
    """The demo's --log-json while the run goes: each trainer line appended as it appears, so a
    user can follow it with `tail -f` and a killed run leaves what it did."""

    def __init__(self, path: Path):
        self.path = path
        self._seen: dict[Path, int] = {}
        path.write_text("")

    def write(self, sources: list[Path]) -> None:
        new = []
        for source in sources:
            try:
                text = source.read_text()
            except OSError:
                continue
            complete = text[:text.rfind("\n") + 1]  # a line still being written waits for the next look
            rows = complete.splitlines()
            new += rows[self._seen.get(source, 0):]
            self._seen[source] = len(rows)
        if new:
            with open(self.path, "a") as handle:
                handle.write("".join(row + "\n" for row in new if row.strip()))


def _resume_step(workdir: Path, options: DemoOptions) -> int:
    """The newest step every stage's first replicas have a checkpoint of (their state directories)."""
    steps = None
    for stage in range(options.stages or 1):
        for replica in range(options.replicas):
            found = set(checkpoint_steps(workdir / f"worker-s{stage}-r{replica}.state" / "checkpoints"))
            steps = found if steps is None else steps & found
    if not steps:
        raise ConfigError(f"--resume: no step that every worker in {workdir} has a checkpoint of")
    return max(steps)


def _truncate_log(path: Path, step: int) -> None:
    """Keep a trainer's log lines up to `step`: what a run resumed from that step has done."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and line.endswith("}") and json.loads(line)["step"] <= step]
    atomic_write(path, "".join(line + "\n" for line in kept).encode(), mode=0o644)


def _show(progress: Progress, lines: list[dict], workers: dict[int, int], force: bool = False) -> None:
    loss = f"{lines[-1]['loss']:.4f}" if lines else "-"
    rate = sum(line["tokens_per_s"] for line in latest_per_trainer(lines))
    per_stage = " ".join(f"s{s}:{n}" for s, n in sorted(workers.items()))
    progress.update(len(lines), f"loss {loss} {rate:,.0f} tok/s workers {per_stage}", force=force)


def _start_monitor(group: ProcessGroup, options: DemoOptions, workdir: Path, swarm: list[str], admission: list[str],
                   static_targets: list[str], common: list[str]) -> ChildProcess:
    """`agora-node monitor` (read-only, a monitor credential when admitted), started; its ready file
    holds its status page's URL."""
    ready = workdir / "monitor.ready"
    targets = [flag for target in static_targets for flag in ("--target", target)]
    swarm = [flag for flag in swarm if flag != "--sync"]
    command = agora_node_command(*common, "monitor", *options.run_flags(), *swarm, *admission,
                                 *_state_dir(options, workdir, "monitor"), "--port", str(options.monitor_port),
                                 "--poll", str(options.heartbeat_s), *targets, "--ready-file", str(ready),
                                 *([] if options.insecure else ["--ledger", str(workdir / "ledger.sqlite")]))
    return group.spawn("monitor", command, ready)


def _metrics_file(workdir: Path, role: str) -> Path:
    return workdir / f"{role}.metrics"


def _static_target(workdir: Path, role: str) -> str:
    """The monitor's scrape target for a ready role outside the DHT's records: the endpoint it wrote
    (`--metrics-file`) before its ready file."""
    return f"{role}={_metrics_file(workdir, role).read_text().strip()}"


def _state_dir(options: DemoOptions, workdir: Path, name: str) -> list[str]:
    return [] if options.insecure else ["--state-dir", str(workdir / f"{name}.state")]


def _operator_issued(options: DemoOptions, workdir: Path, name: str, role: str, admission: list[str]) -> list[str]:
    """How a role the authorizer does not admit by itself (a trainer, a client) gets in: the demo is
    the operator and mints its credential into its state directory (`agora-node authorizer issue`),
    as an operator does for the machines it runs; the node then starts from that credential, with
    no join file, and renews it through the authorizer as usual. `admission`: under --insecure."""
    if options.insecure:
        return admission
    state = workdir / f"{name}.state"
    lifetime = {} if options.credential_lifetime is None else {"lifetime_s": options.credential_lifetime}
    issue_credential(str(workdir / "authorizer"), str(state), role=role, **lifetime)
    return ["--state-dir", str(state)]


def _start_bootstrap(group: ProcessGroup, options: DemoOptions, workdir: Path, common: list[str],
                     extra: list[str] = ()) -> list[str]:
    """The run's DHT bootstrap peer; its multiaddrs. With admission, the operator credentials it offline
    first (`agora-node authorizer issue`, here in this process: it creates the run's CA), and the
    authorizer then hands its address out. `extra`: more flags for it (its metrics port)."""
    boot_ready = workdir / "bootstrap.ready"
    boot_flags = ["--insecure"]
    if not options.insecure:
        boot_flags = ["--state-dir", str(workdir / "bootstrap.state")]
        issue_credential(str(workdir / "authorizer"), str(workdir / "bootstrap.state"), role="operator",
                         run_id=options.run_id, lifetime_s=24 * 3600)
    boot = group.spawn("bootstrap", agora_node_command(*common, "bootstrap", *boot_flags, "--host",
                                                       group.host("bootstrap"), "--ready-file", str(boot_ready),
                                                       *extra), boot_ready)
    return group.wait_ready([boot], options.ready_timeout_s)["bootstrap"]


def _start_authorizer(group: ProcessGroup, options: DemoOptions, workdir: Path, maddrs: list[str],
                      common: list[str], extra: list[str]) -> str:
    """The run's authorizer, with floors low enough for one machine's loopback and the limits of a
    local run (every node shares one address and network; the dial-back reaches private addresses,
    which the WAN harness's namespaces use); its address."""
    ready = workdir / "authorizer.ready"
    lifetime = [] if options.credential_lifetime is None else ["--credential-lifetime", str(options.credential_lifetime)]
    command = agora_node_command(
        *common, "authorizer", "serve", "--state-dir", str(workdir / "authorizer"), "--run-id", options.run_id,
        "--host", group.host("authorizer"), "--ready-file", str(ready), *lifetime, "--min-upload-mbit", "0", "--min-download-mbit", "0",
        "--max-rtt-ms", "inf", "--min-accelerator-gb", "0", "--min-ram-gb", "0", "--preflight-bytes", str(256 << 10),
        *LOCAL_RUN_FLAGS, *options.run_flags(), *extra, "--initial-peers", *maddrs)
    child = group.spawn("authorizer", command, ready)
    return group.wait_ready([child], options.ready_timeout_s)["authorizer"][0]


def _interrupt_on(*signals: int) -> dict[int, object]:
    """Raise KeyboardInterrupt on these signals (main thread only); the previous handlers."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    return {signum: signal.signal(signum, interrupt) for signum in signals}


def _alive_per_stage(workers: list[tuple[int, ChildProcess]]) -> dict[int, int]:
    alive: dict[int, int] = {}
    for stage, worker in workers:
        alive[stage] = alive.get(stage, 0) + (1 if worker.alive() else 0)
    return alive


def _print_summary(summary: dict) -> None:
    print(format_summary(summary))
