"""`agora-node demo`: a whole swarm on loopback, each role its own `agora-node <role>` process.

Order: bootstrap (its ready file carries the DHT multiaddrs) -> one `join` per stage replica
(ready file: gRPC endpoint + peer id, written once announced in the DHT) -> trainers. While
the trainers run, a progress line shows global batches, loss, tokens/s and live workers per
stage. When they finish, workers and the bootstrap get SIGTERM (clean leave), every process
is reaped, the trainers' logs are merged into one JSON line per global batch (run-wide `step`,
the train-local schema) and a summary is printed and optionally written as JSON. Ctrl-C stops
everything the same way and still prints what was done. Workers average with the other replicas
of their stage (the config's `sync` method unless `--averaging` says otherwise); each writes its
averaging counters to a stats file when it leaves, and the summary adds them up per stage.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agora.node.demo.processes import ChildFailed, ChildProcess, Placement, ProcessGroup, agora_node_command
from agora.pipeline.config import ConfigError

__all__ = ["DemoOptions", "run_demo", "merge_logs"]

logger = logging.getLogger("agora.node.demo")


@dataclass(frozen=True)
class DemoOptions:
    config: str = "tiny"
    seed: int | None = None
    stages: int | None = 3
    batch_size: int | None = None
    microbatches: int | None = None
    steps: int = 60
    schedule_steps: int | None = None  # None: the config's schedule (stretched to `steps`)
    replicas: int = 1
    trainers: int = 1
    sync: bool = False
    max_in_flight: int | None = None  # None: the trainer's default (adaptive)
    max_staleness: float | None = None  # None: the trainer's default
    time_budget_s: float | None = None  # trainers stop starting global batches after this long
    pinned_weights: int | None = None  # None: the workers' default
    keep_graphs: int | None = None  # None: the workers' default
    log_json: str | None = None
    summary_json: str | None = None
    workdir: str | None = None
    kill_worker_at: int | None = None
    averaging: str | None = None  # None: the config's sync.method (and the settings below)
    averaging_every: int | None = None
    averaging_fraction: float | None = None
    average_optimizer_state: bool | None = None
    aggregation: str | None = None
    run_id: str = "demo"
    insecure: bool = False  # no authorizer, no TLS, no signed records
    heartbeat_s: float = 1.0  # workers' DHT announces: fast failure detection on one machine
    credential_lifetime: float | None = None  # None: the authorizer's default (1 hour)
    threads: int = 1
    ready_timeout_s: float = 120.0
    # --serve: serve-only workers on a checkpoint's weights and the HTTP API (node/demo/serving.py).
    serve: bool = False
    checkpoint: str | None = None
    http_port: int = 8000

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DemoOptions":
        return cls(config=args.config or "tiny", seed=args.seed, stages=args.stages, batch_size=args.batch_size,
                   microbatches=args.microbatches, steps=args.steps, schedule_steps=args.schedule_steps, replicas=args.replicas,
                   trainers=args.trainers, sync=args.sync,
                   max_in_flight=args.max_in_flight, max_staleness=getattr(args, "max_staleness", None),
                   time_budget_s=getattr(args, "time_budget", None),
                   pinned_weights=getattr(args, "pinned_weights", None),
                   keep_graphs=getattr(args, "keep_graphs", None),
                   log_json=args.log_json, summary_json=args.summary_json,
                   workdir=args.workdir, kill_worker_at=args.kill_worker_at,
                   averaging=getattr(args, "averaging", None), averaging_every=getattr(args, "averaging_every", None),
                   averaging_fraction=getattr(args, "averaging_fraction", None),
                   average_optimizer_state=getattr(args, "average_optimizer_state", None),
                   aggregation=getattr(args, "aggregation", None),
                   insecure=getattr(args, "insecure", False), heartbeat_s=getattr(args, "heartbeat", 1.0),
                   credential_lifetime=getattr(args, "credential_lifetime", None),
                   serve=getattr(args, "serve", False), checkpoint=getattr(args, "checkpoint", None),
                   http_port=getattr(args, "http_port", 8000))

    def validate(self) -> "DemoOptions":
        if self.replicas < 1 or self.trainers < 1 or self.steps < 1:
            raise ConfigError("--replicas, --trainers and --steps must be at least 1")
        if self.sync and (self.replicas != 1 or self.trainers != 1):
            raise ConfigError("--sync needs --replicas 1 and --trainers 1 (one route, one barrier)")
        if self.pinned_weights is not None and self.pinned_weights < 0:
            raise ConfigError(f"--pinned-weights: must be >= 0, got {self.pinned_weights}")
        if self.keep_graphs is not None and self.keep_graphs < 0:
            raise ConfigError(f"--keep-graphs: must be >= 0, got {self.keep_graphs}")
        if not self.heartbeat_s > 0:
            raise ConfigError(f"--heartbeat: must be positive, got {self.heartbeat_s}")
        if self.insecure and self.credential_lifetime is not None:
            raise ConfigError("--credential-lifetime: --insecure runs without credentials")
        if self.credential_lifetime is not None and self.credential_lifetime < 10:
            raise ConfigError(f"--credential-lifetime: at least 10 s, got {self.credential_lifetime:g}")
        if self.serve and (self.checkpoint is None or self.sync or self.trainers != 1 or self.kill_worker_at):
            raise ConfigError("--serve: needs --checkpoint C, and trains nothing (no --sync, --trainers, "
                              "--kill-worker-at)")
        if self.checkpoint is not None and not self.serve:
            raise ConfigError("--checkpoint: only with --serve")
        if self.kill_worker_at is not None and self.replicas < 2:
            raise ConfigError("--kill-worker-at needs --replicas 2 or more, so the stage survives")
        return self

    def worker_flags(self) -> list[str]:
        """Flags for the workers alone (trainers do not take these): weight pinning, kept graphs."""
        flags = [] if self.pinned_weights is None else ["--pinned-weights", str(self.pinned_weights)]
        return flags + ([] if self.keep_graphs is None else ["--keep-graphs", str(self.keep_graphs)])

    def run_flags(self) -> list[str]:
        """Flags every process of the run takes, the authorizer's served config included (the sync
        settings are in the run's fingerprint)."""
        flags = ["--config", self.config, "--steps", str(self.steps)]
        for name, value in (("--seed", self.seed), ("--stages", self.stages), ("--batch-size", self.batch_size),
                            ("--microbatches", self.microbatches), ("--schedule-steps", self.schedule_steps),
                            ("--averaging", self.averaging), ("--averaging-every", self.averaging_every),
                            ("--averaging-fraction", self.averaging_fraction), ("--aggregation", self.aggregation)):
            if value is not None:
                flags += [name, str(value)]
        return flags + (["--average-optimizer-state"] if self.average_optimizer_state else [])


def merge_logs(paths: list[Path]) -> list[dict]:
    """Every trainer's lines, one per global batch, ordered by the run-wide step."""
    lines = []
    for path in paths:
        if path.exists():
            lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(lines, key=lambda line: line["step"])


class _Progress:
    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.stream = total, stream
        self.tty = stream.isatty()
        self.last_print = 0.0

    def show(self, lines: list[dict], workers: dict[int, int], force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_print < (0.5 if self.tty else 10.0):
            return
        self.last_print = now
        step = lines[-1]["step"] if lines else 0
        loss = f"{lines[-1]['loss']:.4f}" if lines else "-"
        rate = sum(line["tokens_per_s"] for line in _latest_per_trainer(lines))
        per_stage = " ".join(f"s{s}:{n}" for s, n in sorted(workers.items()))
        text = f"demo: batch {len(lines)}/{self.total} (step {step}) loss {loss} {rate:,.0f} tok/s workers {per_stage}"
        self.stream.write(("\r" + text + " ") if self.tty else text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _latest_per_trainer(lines: list[dict]) -> list[dict]:
    latest: dict[int, dict] = {}
    for line in lines:
        latest[line.get("trainer", 0)] = line
    return list(latest.values())


def run_demo(options: DemoOptions, placement: Placement | None = None) -> int:
    """`placement`: where each process runs (default: this machine's loopback; bench/wan/ puts each
    in a network namespace of its own behind emulated links)."""
    options.validate()
    if options.serve:
        from agora.node.demo.serving import run_serving_demo

        return run_serving_demo(options)
    workdir = (Path(options.workdir) if options.workdir else Path(tempfile.mkdtemp(prefix="agora-demo-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    group = ProcessGroup(workdir) if placement is None else ProcessGroup(workdir, placement=placement)
    started = time.monotonic()
    trainer_logs = [workdir / f"trainer-{t}.jsonl" for t in range(options.trainers)]
    workers: list[tuple[int, ChildProcess]] = []
    killed: list[str] = []
    progress = _Progress(options.steps)
    outcome = "completed"
    code = 0
    # Ctrl-C and a supervisor's SIGTERM both stop the swarm in order and still print a summary.
    previous = _interrupt_on(signal.SIGINT, signal.SIGTERM)
    try:
        threads = ["--threads", str(options.threads)]
        common = ["--log-level", "WARNING", *threads]
        if options.insecure:
            print("demo: WARNING: --insecure: no authorizer, no TLS, no credential checks, no signed DHT records",
                  file=sys.stderr, flush=True)
        maddrs = _start_bootstrap(group, options, workdir, common)
        swarm = ["--run-id", options.run_id, "--initial-peers", *maddrs] + (["--sync"] if options.sync else [])
        admission = ["--insecure"]
        if not options.insecure:
            authorizer = _start_authorizer(group, options, workdir, maddrs, common)
            print(f"demo: authorizer {authorizer} (run {options.run_id!r}); nodes join with "
                  f"--join-file {workdir / 'authorizer' / 'join.json'}", file=sys.stderr, flush=True)
            admission = ["--join-file", str(workdir / "authorizer" / "join.json")]
        for stage in range(options.stages or 1):
            for replica in range(options.replicas):
                name = f"worker-s{stage}-r{replica}"
                ready = workdir / f"{name}.ready"
                # INFO: each averaging round's milestone line lands in the worker's log file.
                host = group.host(name)
                command = agora_node_command("--log-level", "INFO", *threads, "join", "--stage", str(stage),
                                             "--host", host, "--dht-host", host,
                                             *options.run_flags(), *swarm, *options.worker_flags(), *admission,
                                             *_state_dir(options, workdir, name),
                                             "--stats-file", str(workdir / f"{name}.stats.json"),
                                             "--heartbeat", str(options.heartbeat_s), "--ready-file", str(ready))
                workers.append((stage, group.spawn(name, command, ready)))
        group.wait_ready([w for _, w in workers], options.ready_timeout_s)
        trainers = []
        for index in range(options.trainers):
            command = agora_node_command(
                *common, "trainer", *options.run_flags(), *swarm, *admission,
                *_state_dir(options, workdir, f"trainer-{index}"), "--trainer-index", str(index),
                "--trainers", str(options.trainers),
                *([] if options.max_in_flight is None else ["--max-in-flight", str(options.max_in_flight)]),
                *([] if options.max_staleness is None else ["--max-staleness", str(options.max_staleness)]),
                *([] if options.time_budget_s is None else ["--time-budget", str(options.time_budget_s)]),
                "--log-json", str(trainer_logs[index]),
                "--summary-json", str(workdir / f"trainer-{index}.summary.json"),
                *([] if index == 0 else ["--no-eval"]))
            trainers.append(group.spawn(f"trainer-{index}", command))
        logger.info("swarm up in %.1f s: %d workers, %d trainers", time.monotonic() - started, len(workers),
                    len(trainers))

        while any(t.alive() for t in trainers):
            lines = merge_logs(trainer_logs)
            if options.kill_worker_at is not None and not killed and len(lines) >= options.kill_worker_at:
                victim = next(w for s, w in workers if s == (options.stages or 1) - 1)
                group.kill(victim)
                killed.append(victim.name)
                logger.warning("fault drill: killed %s with SIGKILL after %d global batches", victim.name, len(lines))
            progress.show(lines, _alive_per_stage(workers))
            time.sleep(0.2)  # the progress view's refresh; trainers are waited on via their exit
        failed = [t for t in trainers if t.process.returncode != 0]
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
        progress.show(lines, _alive_per_stage(workers), force=True)
        progress.close()
        exit_codes = group.shutdown()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    summary = _summary(options, lines, workdir, workers, killed, exit_codes, outcome, time.monotonic() - started)
    if options.log_json:
        Path(options.log_json).write_text("".join(json.dumps(line) + "\n" for line in lines))
    if options.summary_json:
        Path(options.summary_json).write_text(json.dumps(summary, indent=1) + "\n")
    _print_summary(summary)
    if not options.workdir and code == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    return code


def _state_dir(options: DemoOptions, workdir: Path, name: str) -> list[str]:
    return [] if options.insecure else ["--state-dir", str(workdir / f"{name}.state")]


def _run_to_end(group: ProcessGroup, name: str, command: list[str], timeout_s: float) -> None:
    child = group.spawn(name, command)
    try:
        code = child.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        raise ChildFailed(f"{name} did not finish within {timeout_s:g} s:\n{child.log_tail()}") from None
    if code != 0:
        raise ChildFailed(f"{name} exited with {code}:\n{child.log_tail()}")


def _start_bootstrap(group: ProcessGroup, options: DemoOptions, workdir: Path, common: list[str]) -> list[str]:
    """The run's DHT bootstrap peer; its multiaddrs. With admission, the operator credentials it offline
    first (which creates the run's CA), and the authorizer then hands its address out."""
    boot_ready = workdir / "bootstrap.ready"
    boot_flags = ["--insecure"]
    if not options.insecure:
        boot_flags = ["--state-dir", str(workdir / "bootstrap.state")]
        _run_to_end(group, "authorizer-issue", agora_node_command(
            *common, "authorizer", "issue", "--state-dir", str(workdir / "authorizer"), "--run-id",
            options.run_id, "--role", "operator", "--out", str(workdir / "bootstrap.state"),
            "--lifetime", str(24 * 3600)), options.ready_timeout_s)
    boot = group.spawn("bootstrap", agora_node_command(*common, "bootstrap", *boot_flags, "--host",
                                                       group.host("bootstrap"), "--ready-file", str(boot_ready)),
                       boot_ready)
    return group.wait_ready([boot], options.ready_timeout_s)["bootstrap"]


def _start_authorizer(group: ProcessGroup, options: DemoOptions, workdir: Path, maddrs: list[str],
                      common: list[str]) -> str:
    """The run's authorizer, with floors low enough for one machine's loopback; its address."""
    ready = workdir / "authorizer.ready"
    lifetime = [] if options.credential_lifetime is None else ["--credential-lifetime", str(options.credential_lifetime)]
    command = agora_node_command(
        *common, "authorizer", "serve", "--state-dir", str(workdir / "authorizer"), "--run-id", options.run_id,
        "--host", group.host("authorizer"), "--ready-file", str(ready), *lifetime, "--min-upload-mbit", "0", "--min-download-mbit", "0",
        "--max-rtt-ms", "inf", "--min-accelerator-gb", "0", "--min-ram-gb", "0", "--preflight-bytes", str(256 << 10),
        "--join-rate", "20", "--join-burst", "64", *options.run_flags(), "--initial-peers", *maddrs)
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


def _summary(options: DemoOptions, lines: list[dict], workdir: Path, workers, killed, exit_codes,
             outcome: str, wall_s: float) -> dict:
    trainer_summaries = []
    for index in range(options.trainers):
        path = workdir / f"trainer-{index}.summary.json"
        if path.exists():
            trainer_summaries.append(json.loads(path.read_text()))
    heldout = [s["heldout_loss"] for s in trainer_summaries if s.get("heldout_loss") is not None]
    tail = lines[-5:]
    per_stage: dict[int, int] = {}
    for stage, _ in workers:
        per_stage[stage] = per_stage.get(stage, 0) + 1
    return {
        "outcome": outcome,
        "steps": len(lines),
        "final_loss": sum(line["loss"] for line in tail) / len(tail) if tail else None,
        "heldout_loss": heldout[0] if heldout else None,
        "tokens": lines[-1]["tokens"] if lines else 0,
        "tokens_per_s": sum(line["tokens_per_s"] for line in _latest_per_trainer(lines)),
        "wall_s": round(wall_s, 2),
        "workers_per_stage": {str(k): v for k, v in sorted(per_stage.items())},
        "reroutes": sum(s.get("reroutes", 0) for s in trainer_summaries),
        "time_split_by_stage": _merge_time_splits([s.get("time_split_by_stage", {}) for s in trainer_summaries]),
        "trainer_split": _mean_trainer_split([s.get("trainer_split", {}) for s in trainer_summaries]),
        "in_flight": [s.get("in_flight") for s in trainer_summaries],
        "busy_retries": sum(s.get("busy", 0) for s in trainer_summaries),
        "averaging_by_stage": _averaging_by_stage(workdir, workers),
        "killed": killed,
        "exit_codes": exit_codes,
        "mode": "sync" if options.sync else "async",
        "security": "insecure" if options.insecure else "admitted",
        "credential_renewals": {"trainers": sum(s.get("credential_renewals", 0) for s in trainer_summaries),
                                "workers": _count_in_logs([w for _, w in workers], "renewed the credential")},
        "revoked": [w.name for _, w in workers if exit_codes.get(w.name) == 3],
    }


def _count_in_logs(children, text: str) -> int:
    total = 0
    for child in children:
        try:
            total += child.log_path.read_text(errors="replace").count(text)
        except OSError:
            pass
    return total


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
        into = merged.setdefault(str(stage), {"method": stats.get("method"), "replicas_reporting": 0,
                                              "rounds_by_outcome": {}, "rejections": {}, "applied": 0, "skipped": 0,
                                              "bytes_sent": 0,
                                              "local_steps": 0, "compute_blocked_s": 0.0, "wall_s": 0.0,
                                              "lag_steps_sum": 0.0, "max_lag_steps": 0})
        into["replicas_reporting"] += 1
        for outcome, n in stats.get("rounds_by_outcome", {}).items():
            into["rounds_by_outcome"][outcome] = into["rounds_by_outcome"].get(outcome, 0) + n
        for reason, n in stats.get("rejections", {}).items():  # what robust aggregation stopped (dht/robust.py)
            into["rejections"][reason] = into["rejections"].get(reason, 0) + n
        for key in ("applied", "skipped", "bytes_sent", "local_steps", "compute_blocked_s", "wall_s"):
            into[key] += stats.get(key, 0)
        into["parameters"] = stats.get("parameters", 0)
        into["lag_steps_sum"] += (stats.get("mean_lag_steps") or 0.0) * stats.get("applied", 0)
        into["max_lag_steps"] = max(into["max_lag_steps"], stats.get("max_lag_steps", 0))
    for into in merged.values():
        into["compute_blocked_fraction"] = into["compute_blocked_s"] / into["wall_s"] if into["wall_s"] else None
        # Local steps from a round's snapshot to its apply, over every applied round of the stage.
        into["mean_lag_steps"] = into.pop("lag_steps_sum") / into["applied"] if into["applied"] else None
    return dict(sorted(merged.items()))


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


def _mean_trainer_split(splits: list[dict]) -> dict:
    """Each trainer's own split (CPU and time outside calls per microbatch), averaged over trainers."""
    keys = sorted({key for split in splits for key in split})
    return {key: round(sum(split.get(key, 0.0) for split in splits) / len(splits), 3) for key in keys} if splits else {}


def _print_summary(summary: dict) -> None:
    print(json.dumps(summary))
