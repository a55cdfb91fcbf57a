"""`DemoOptions`: what `demo` starts (a section of the settings schema, pipeline/schema.py; its
flags come from here). Light: the CLI imports it to build its parser, before torch."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator
from pydantic.dataclasses import dataclass

from agora.node.run_flags import explicit_settings, setting_flags
from agora.node.tracing_options import TracingOptions
from agora.node.trainer.options import TrainerOptions
from agora.node.worker.join_options import JoinOptions
from agora.node.worker.options import WorkerOptions
from agora.node.worker.watchdog_rules import WatchdogOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.option_flags import options_from_args
from agora.pipeline.schema import SECTION, like, setting

__all__ = ["DemoOptions"]


@dataclass(frozen=True, config=SECTION)
class DemoOptions:
    """What `demo` starts; the fields with a flag are its options (the trainers' and workers' ones
    it hands on are theirs: `like`)."""

    config: StrictStr = setting("tiny", "preset, TOML file or checkpoint folder (every process's --config)")
    seed: StrictInt | None = setting(None, "the run seed (None: the config's)")
    stages: StrictInt | None = setting(3, "stages the blocks are split over (None: the config's)", gt=0)
    steps: StrictInt = setting(60, "global batches in total (over all trainers)", ge=1)
    # Run settings by dotted path ({"train.microbatches": 32}): every process gets them (node/run_flags.py).
    settings: dict[str, Any] = setting(default_factory=dict, help="run settings every process gets")
    replicas: StrictInt = setting(1, "workers per stage", flag="--replicas", ge=1)
    trainers: StrictInt = setting(1, "trainer processes", flag="--trainers", ge=1)
    sync: StrictBool = setting(False, "synchronous mode (needs --replicas 1 --trainers 1): must equal train-local",
                               flag="--sync")
    max_in_flight: StrictInt | None = like(TrainerOptions, "max_in_flight")
    max_staleness: StrictFloat | None = like(TrainerOptions, "max_staleness", default=None)
    time_budget_s: StrictFloat | None = like(TrainerOptions, "time_budget_s")
    pinned_weights: StrictInt | None = like(WorkerOptions, "pinned_weights", default=None)
    keep_graphs: StrictInt | None = like(WorkerOptions, "keep_graphs", default=None)
    log_json: StrictStr | None = setting(None, "one JSON line per global batch, run-wide step", flag="--log-json")
    summary_json: StrictStr | None = setting(
        None, "write the full run summary here as JSON (the terminal gets a short one)", flag="--summary-json")
    workdir: StrictStr | None = setting(None, "keep logs and ready files here (default: a temp folder)",
                                        flag="--workdir")
    kill_worker_at: StrictInt | None = setting(
        None, "fault drill: kill -9 one worker of the last stage after STEP global batches", flag="--kill-worker-at",
        ge=0)
    join_at: tuple[Annotated[StrictInt, Field(ge=0)], ...] = setting(
        (), "a new replica of stage 0 joins (a new contributor, empty state) after STEP global batches: it syncs "
        "(weight sync, optimizer sync) before it is a member; repeat for more (a stage that ends up over-covered "
        "gives a replica to another: rebalancing)", flag="--join-at")
    sync_phases: StrictBool = setting(
        True, "a joining replica is a member at once, with its fresh weights (to measure what the sync phases buy)",
        flag="--no-sync-phases")
    watchdog: StrictBool = like(WatchdogOptions, "enabled")
    run_id: StrictStr = setting("demo", "the run's identifier", min_length=1)
    insecure: StrictBool = setting(False, "run without the authorizer: no admission, no TLS, no signed DHT records",
                                   flag="--insecure")
    heartbeat_s: StrictFloat = like(JoinOptions, "heartbeat_s", default=1.0, description=(
        "seconds between the workers' DHT announces (quick failure detection on one machine; `join` defaults to 5)"))
    credential_lifetime: StrictFloat | None = setting(
        None, "seconds each credential is valid (nodes renew at half life; default: the authorizer's, 1 hour)",
        flag="--credential-lifetime", ge=10)
    threads: StrictInt = setting(1, "torch threads of each process", ge=1)
    ready_timeout_s: StrictFloat = setting(120.0, "how long a process may take to be ready", gt=0)
    # --serve: serve-only workers on a checkpoint's weights and the HTTP API (node/demo/serving.py).
    serve: StrictBool = setting(
        False, "serve --checkpoint instead of training: serve-only workers and the OpenAI-compatible API, up "
        "until Ctrl-C", flag="--serve")
    checkpoint: StrictStr | None = setting(None, "with --serve: the checkpoint to serve", flag="--checkpoint")
    http_port: StrictInt = setting(8000, "with --serve: the API's port", flag="--http-port", ge=0, lt=65536)
    monitor: StrictBool = setting(True, "do not start the monitor (status page, /sd, /metrics)", flag="--no-monitor")
    monitor_port: StrictInt = setting(0, "the monitor's HTTP port: status page, /sd, /metrics (0: a free one)",
                                      flag="--monitor-port", ge=0, lt=65536)
    checkpoint_every: StrictInt | None = like(JoinOptions, "checkpoint_every")
    rebalance_s: StrictFloat | None = like(JoinOptions, "rebalance_s")
    resume: StrictBool = setting(
        False, "restart every role of --workdir from its checkpoints: workers from the newest step all of them "
        "have, trainers from that step on", flag="--resume")
    chaos_s: StrictFloat | None = setting(
        None, "kill -9 a random worker (one whose stage keeps another replica) or trainer every SECONDS and start a "
        "newcomer in its place (new identity, empty state); the summary counts kills, joins, their seconds to "
        "member, and units committed, lost and run twice", flag="--chaos", gt=0)
    chaos_seed: StrictInt = setting(0, "seed of --chaos's choice of victims", flag="--chaos-seed")
    lease_s: StrictFloat | None = like(TrainerOptions, "lease_s", default=None)  # None: 5 s under --chaos
    tracing: TracingOptions = setting(default_factory=TracingOptions)  # handed to every trainer and worker

    @model_validator(mode="after")
    def _agree(self) -> "DemoOptions":
        if self.sync and (self.replicas != 1 or self.trainers != 1):
            raise ValueError("sync: --sync needs --replicas 1 and --trainers 1 (one route, one barrier)")
        if self.insecure and self.credential_lifetime is not None:
            raise ValueError("credential_lifetime: --insecure runs without credentials")
        if self.serve and (self.checkpoint is None or self.sync or self.trainers != 1 or self.kill_worker_at):
            raise ValueError("serve: --serve needs --checkpoint C, and trains nothing (no --sync, --trainers, "
                             "--kill-worker-at)")
        if self.checkpoint is not None and not self.serve:
            raise ValueError("checkpoint: --checkpoint only with --serve")
        if self.kill_worker_at is not None and self.replicas < 2:
            raise ValueError("kill_worker_at: --kill-worker-at needs --replicas 2 or more, so the stage survives")
        if self.resume and not self.workdir:
            raise ValueError("resume: give the --workdir of the run to resume")
        if self.chaos_s is not None and self.sync:
            raise ValueError("chaos_s: --chaos not with --sync (one trainer, one replica per stage: nothing survives "
                             "a kill)")
        return self

    @property
    def trainer_lease_s(self) -> float | None:
        """The trainers' unit leases: the given one, 5 s under --chaos (a killed trainer's units come back
        quickly), else theirs."""
        return self.lease_s if self.lease_s is not None or self.chaos_s is None else 5.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DemoOptions":
        return options_from_args(cls, args, "demo", config=args.config or "tiny", seed=args.seed, stages=args.stages,
                                 steps=args.steps, settings=explicit_settings(args))

    def worker_flags(self) -> list[str]:
        """Flags for the workers alone (trainers do not take these): weight pinning, rebalancing's
        readings, kept graphs, the sync phases, the watchdog."""
        flags = [] if self.pinned_weights is None else ["--pinned-weights", str(self.pinned_weights)]
        if self.rebalance_s is not None:
            flags += ["--rebalance-every", str(self.rebalance_s)]
        if self.keep_graphs is not None:
            flags += ["--keep-graphs", str(self.keep_graphs)]
        return flags + ([] if self.sync_phases else ["--no-sync-phases"]) + ([] if self.watchdog else ["--no-watchdog"])

    def tracing_flags(self) -> list[str]:
        """The tracing flags it was given, for its trainers and workers alike."""
        given = (("--otlp-endpoint", self.tracing.otlp_endpoint), ("--trace-sample", self.tracing.trace_sample))
        return [text for flag, value in given if value is not None for text in (flag, str(value))]

    def run_flags(self) -> list[str]:
        """Flags every process of the run takes, the authorizer's served config included (all but
        the machine-local settings are in the run's fingerprint)."""
        flags = ["--config", _config_argument(self.config), "--steps", str(self.steps)]
        for name, value in (("--seed", self.seed), ("--stages", self.stages)):
            if value is not None:
                flags += [name, str(value)]
        return flags + setting_flags(self.settings)


def _config_argument(config: str) -> str:
    """A config as every child reads it: a preset by name, a TOML file or checkpoint folder by its
    absolute path (each child runs in a working folder of its own, where a relative path means nothing)."""
    return config if config in PRESETS or not Path(config).exists() else str(Path(config).resolve())
