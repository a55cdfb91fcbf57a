"""`agora-node`: one console script, one subcommand per role.

Each subcommand parses its flags, builds its objects and runs; the work lives in the modules it
calls. A user's mistake (bad config, missing file) ends in one readable line and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import logging
import sys
from dataclasses import replace
from pathlib import Path

from agora.node.admission import add_admission_arguments
from agora.node.demo.supervision import PARENT_PID_ENV
from agora.node.logs import LOG_FORMATS, configure_logging
from agora.node.observability import MetricsOptions, add_metrics_arguments
from agora.node.run_flags import (add_config_command, add_option_flags, add_run_arguments, check_runtime_flags,
                                  explicit_settings, options_from_args, run_config)
from agora.node.swarm_options import SwarmOptions, add_swarm_flags
from agora.node.trainer.options import TrainLocalOptions
from agora.pipeline.files import hold_folder
from agora.pipeline.config import ConfigError

__all__ = ["main", "build_parser"]


def _cmd_train_local(args: argparse.Namespace) -> int:
    from agora.node.progress import Progress
    from agora.pipeline.centralized import CentralizedTrainer
    from agora.pipeline.data import build_data

    options = options_from_args(TrainLocalOptions, args, "train_local")
    config = run_config(args)
    held = None
    if options.checkpoint_dir:  # one writer per checkpoint folder, as for a worker's
        held = hold_folder(options.checkpoint_dir, "--checkpoint-dir")
    data = build_data(config)
    log_json = open(options.log_json, "a" if options.resume else "w") if options.log_json else None
    bar = Progress(args.steps, "train-local")

    def progress(record, total: int) -> None:
        evaluation = f" eval {record.eval_loss:.3f}" if record.eval_loss is not None else ""
        bar.update(record.step, f"loss {record.loss:.4f}{evaluation} lr {record.lr:.2e} "
                                f"{record.tokens_per_s:,.0f} tok/s", force=record.step >= total)

    try:
        trainer = CentralizedTrainer(config, data, wire_dtype=options.wire_dtype,
                                     checkpoint_dir=options.checkpoint_dir, log_json=log_json, progress=progress)
        if options.resume and trainer.resume():
            logging.info("resumed from step %d", trainer.step)
        records = trainer.run(args.steps)
        final = trainer.evaluate()
    finally:
        bar.close()
        if log_json is not None:
            log_json.close()
        del held
    last = records[-1].loss if records else float("nan")
    tokens_per_s = records[-1].tokens_per_s if records else 0.0
    print(f"train-local: {config.name} stages={len(config.layer_split)} steps={trainer.step} "
          f"loss={last:.4f} heldout={final:.4f} tokens/s={tokens_per_s:,.0f} on {trainer.runtime.describe()}")
    return 0


def _cmd_export_hf(args: argparse.Namespace) -> int:
    from agora.pipeline.checkpoint import load_checkpoint
    from agora.pipeline.interop import save_pretrained, save_tokenizer
    from agora.pipeline.stages import assemble_model

    step, config, states, _ = load_checkpoint(args.checkpoint)
    if sorted(s.index for s in states) != list(range(len(config.layer_split))):
        raise ConfigError(f"--checkpoint: {args.checkpoint} does not hold every stage (has {[s.index for s in states]})")
    model = assemble_model(config.model, [s.model for s in states])
    save_pretrained(model, args.out)
    try:
        save_tokenizer(config.data.tokenizer, args.out)
    except ConfigError as error:  # the weights are worth keeping: the tokenizer file can be copied in later
        print(f"export-hf: no tokenizer written: {error}")
    print(f"export-hf: step {step} -> {args.out}")
    return 0


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    from agora.dht.bootstrap import run_bootstrap
    from agora.dht.swarm import DHTRequestError

    from agora.node.observability import NodeMetrics, package_version

    metrics = NodeMetrics.for_role(MetricsOptions.from_args(args), role="bootstrap", run_id=_bootstrap_run(args),
                                   version=package_version())
    try:
        return run_bootstrap(args.host, args.port, tuple(args.initial_peers), args.identity_path, args.ready_file,
                             state_dir=args.state_dir, insecure=args.insecure,
                             on_started=lambda swarm: _serve_bootstrap_metrics(metrics, swarm))
    except (ValueError, DHTRequestError) as error:
        raise ConfigError(str(error)) from None
    finally:
        metrics.close()


def _serve_bootstrap_metrics(metrics, swarm) -> None:
    from agora.monitor.dht_metrics import DHTMetrics

    DHTMetrics(metrics.registry, swarm.bans, swarm.timings)  # its requests; secured: refusals, the ban list
    metrics.serve()


def _bootstrap_run(args: argparse.Namespace) -> str:
    """The run a bootstrap's credential is for ("" for an open --insecure peer, which serves any run)."""
    if args.insecure or not args.state_dir:
        return ""
    import time

    from agora.auth.credentials import CredentialError
    from agora.auth.node_state import NodeCredentials

    try:
        return NodeCredentials(args.state_dir, clock=time.time).identity().run_id
    except (CredentialError, OSError, ValueError):
        return ""  # run_bootstrap reports the unusable state directory in one line


def _cmd_join(args: argparse.Namespace) -> int:
    from agora.node.worker.join import run_worker
    from agora.node.worker.join_options import JoinOptions

    from agora.node.admission import AdmissionOptions, admit_node, config_chooser, free_port
    from agora.node.inference.commands import serve_only_config_flags
    from agora.node.rpc.server import announced_host

    check_runtime_flags(args)  # a device this machine lacks is refused before admission
    serve_only_config_flags(args)  # --serve-only: the checkpoint is the run config unless --config
    swarm = options_from_args(SwarmOptions, args, "swarm")
    options = options_from_args(JoinOptions, args, "join", run_id=swarm.run_id)  # refused before admission
    worker_options = _worker_options(args)
    metrics = MetricsOptions.from_args(args)
    if worker_options.port == 0:  # the authorizer's dial-back and then the gRPC server take this port
        worker_options = replace(worker_options, port=free_port(worker_options.host))
    announce = (announced_host(worker_options.host, worker_options.announce_host), worker_options.port)
    admission = admit_node(AdmissionOptions.from_args(args), role="worker", run_id=swarm.run_id, stage=options.stage,
                           config_for=config_chooser(args, run_config), initial_peers=swarm.initial_peers,
                           announce=announce, listen_host=worker_options.host,
                           device=explicit_settings(args).get("runtime.device"))
    if options.memory_check and not worker_options.serve_only:  # before the DHT peer and the stage exist
        from agora.node.plan import check_stage_fits, worker_memory_options
        from agora.pipeline.runtime import Runtime

        check_stage_fits(admission.config, admission.stage, Runtime.from_config(admission.config.runtime),
                         worker_memory_options(admission.config, rows=worker_options.max_rows,
                                               pinned_versions=worker_options.pinned_weights,
                                               in_flight=worker_options.stash_capacity,
                                               inference=worker_options.inference))
    held = None
    if options.checkpoint_dir is not None:  # (the default one lies in the --state-dir, held by the admission)
        held = hold_folder(options.checkpoint_dir, "--checkpoint-dir")
    elif admission.credentials is not None:  # on by default beside the credential
        options = replace(options, checkpoint_dir=str(Path(admission.credentials.directory) / "checkpoints"))
    options = replace(options, stage=admission.stage, run_id=admission.run_id, initial_peers=admission.initial_peers,
                      authorizer=admission.authorizer)
    try:
        ended = run_worker(admission.config, options, worker_options, credentials=admission.credentials,
                           metrics=metrics)
    finally:
        del held  # the folders stay held until here (and the kernel frees them if this process dies)
    if ended.move_to is not None:  # rebalancing: the same worker (key, flags) joins the other stage
        from agora.node.membership.rebalance import moved_argv

        state_dir = str(admission.credentials.directory) if admission.credentials is not None else None
        argv = [sys.executable, "-m", "agora.node", *moved_argv(args.argv, ended.move_to, state_dir)]
        logging.getLogger("agora.node.join").info("starting again as stage %d: %s", ended.move_to, " ".join(argv[3:]))
        logging.shutdown()
        os.execv(sys.executable, argv)
    return ended.code


def _worker_options(args: argparse.Namespace):
    from agora.node.worker.options import WorkerOptions

    return options_from_args(WorkerOptions, args, "worker")


def _cmd_trainer(args: argparse.Namespace) -> int:
    import json

    from agora.node.trainer.command import run_swarm_trainer
    from agora.node.trainer.options import TrainerOptions

    from agora.node.admission import AdmissionOptions, admit_node, config_chooser

    metrics = MetricsOptions.from_args(args)
    check_runtime_flags(args)
    swarm = options_from_args(SwarmOptions, args, "swarm")
    options = options_from_args(TrainerOptions, args, "trainer", run_id=swarm.run_id)  # refused before admission
    admission = admit_node(AdmissionOptions.from_args(args), role="trainer", run_id=swarm.run_id, stage=None,
                           config_for=config_chooser(args, run_config), initial_peers=swarm.initial_peers)
    options = replace(options, run_id=admission.run_id)
    log_json = open(options.log_json, "a" if options.start_step else "w") if options.log_json else None
    try:
        summary = run_swarm_trainer(admission.config, options, initial_peers=admission.initial_peers,
                                    steps=args.steps, log_json=log_json, evaluate=options.evaluate,
                                    credentials=admission.credentials, authorizer=admission.authorizer,
                                    metrics=metrics)
    finally:
        if log_json is not None:
            log_json.close()
    text = json.dumps(summary)
    if options.summary_json:
        Path(options.summary_json).write_text(text + "\n")
    print(text)
    return 0


def _cmd_monitor(args: argparse.Namespace) -> int:
    import contextlib

    from agora.auth.admission import CredentialRenewer
    from agora.dht.security import DHTSecurity
    from agora.dht.swarm import DHTRequestError, SwarmDHT
    from agora.monitor.metrics import CredentialMetrics
    from agora.monitor.options import MonitorOptions
    from agora.monitor.service import run_monitor
    from agora.node.admission import AdmissionOptions, admit_node, config_chooser
    from agora.node.observability import NodeMetrics, package_version

    swarm_options = options_from_args(SwarmOptions, args, "swarm")
    options = options_from_args(MonitorOptions, args, "monitor")  # refused before admission
    admission = admit_node(AdmissionOptions.from_args(args), role="monitor", run_id=swarm_options.run_id, stage=None,
                           config_for=config_chooser(args, run_config), initial_peers=swarm_options.initial_peers)
    credentials = admission.credentials
    if not admission.initial_peers:
        print("agora-node monitor: WARNING: no --initial-peers (and none from an authorizer): this starts a new, "
              "empty swarm to watch", file=sys.stderr)
    if options.ledger is not None and credentials is None:
        raise ConfigError("--ledger: receipts are verified against the run's root certificate; a monitor without a "
                          "credential (--insecure) has none")
    security = DHTSecurity.from_state_dir(credentials.directory) if credentials is not None else None
    try:  # read-only: a client peer (a monitor credential's stores are refused anyway)
        swarm = SwarmDHT.start(initial_peers=admission.initial_peers, client_mode=True, security=security)
    except DHTRequestError as error:
        raise ConfigError(f"--initial-peers: {error}") from None
    metrics = NodeMetrics.for_role(MetricsOptions(), role="monitor", run_id=admission.run_id,
                                   version=package_version())
    companions = []
    if credentials is not None and admission.authorizer:
        renewer = CredentialRenewer(admission.authorizer, credentials,
                                    on_revoked=lambda reason: logging.error("monitor credential revoked: %s", reason))
        CredentialMetrics(metrics.registry, credentials.remaining_s, lambda: renewer.renewals)
        companions.append(renewer)

    def serving(url: str) -> None:
        print(f"monitor of run {admission.run_id!r}: status page {url}  Prometheus: {url}metrics, "
              f"service discovery {url}sd", flush=True)

    try:
        return run_monitor(swarm, options, metrics.registry, run_id=admission.run_id,
                           n_stages=len(admission.config.layer_split), on_serving=serving, companions=companions,
                           root_pem=credentials.root_pem() if credentials is not None else None)
    except OSError as error:
        raise ConfigError(f"--host/--port: cannot listen on {options.host}:{options.port} "
                          f"({error.strerror or error})") from None
    finally:
        with contextlib.suppress(Exception):
            swarm.shutdown()


def _cmd_demo(args: argparse.Namespace) -> int:
    from agora.node.demo.demo import DemoOptions, run_demo

    if args.checkpoint is not None:
        args.checkpoint = str(Path(args.checkpoint).resolve())  # the children run in the demo's workdir
    if args.serve and args.config is None and args.checkpoint is not None:
        args.config = args.checkpoint  # a serving swarm runs the checkpoint's config
    check_runtime_flags(args)
    run_config(args)  # refuse a bad config before starting any process
    if args.serve:
        from agora.node.demo.serving import run_serving_demo

        return run_serving_demo(DemoOptions.from_args(args))
    return run_demo(DemoOptions.from_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agora-node", description="Agora node: peer-to-peer pipeline-parallel training of subspace-compressed transformers.")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="text lines for people (default), or one JSON object per line with milestone events "
                             "(joined, sync_phase, phase_changed, state_downloaded, averaging_round, reroute, ban, "
                             "checkpoint_written, credential_renewed)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train-local", help="centralized reference run, stage by stage in one process",
                                description="Train the model centrally through the same stages and wire codec "
                                            "the swarm uses; the reference the swarm is compared with.")
    add_run_arguments(train, steps_help="optimizer steps (global batches) in total", computes=True)
    add_option_flags(train.add_argument_group("train-local", "how the reference run computes, and its files"),
                     TrainLocalOptions)
    train.set_defaults(handler=_cmd_train_local)

    export = commands.add_parser("export-hf", help="write a transformers checkpoint (config.json + safetensors + "
                                 "the run's tokenizer)",
                                 description="Assemble every stage of a checkpoint into one model and save it so "
                                             "AutoModelForCausalLM.from_pretrained loads it.")
    export.add_argument("--checkpoint", required=True, help="checkpoint folder (or a folder with 'latest')")
    export.add_argument("--out", required=True, help="output folder")
    export.set_defaults(handler=_cmd_export_hf)

    from agora.dht.bootstrap import add_bootstrap_arguments

    bootstrap = commands.add_parser("bootstrap", help="start a DHT peer that others join first",
                                    description="Start a hivemind DHT peer and print the multiaddrs that other "
                                                "peers pass as --initial-peers; serves until SIGINT/SIGTERM.")
    add_bootstrap_arguments(bootstrap)
    add_metrics_arguments(bootstrap)
    bootstrap.set_defaults(handler=_cmd_bootstrap)

    from agora.node.worker.watchdog_rules import exit_codes_help

    join = commands.add_parser("join", help="host one replica of one pipeline stage (contributor)",
                               description="Serve one pipeline stage over gRPC, announce it in the DHT, train it; "
                                           "SIGTERM leaves cleanly (withdraw, tell the authorizer, finish in-flight, "
                                           "checkpoint), and so does its watchdog when a rule trips.",
                               epilog=exit_codes_help())
    add_run_arguments(join, steps_help="planned run length in global batches (sets the lr schedule)", computes=True)
    add_swarm_flags(join)
    from agora.node.worker.join_options import JoinOptions
    from agora.node.worker.options import WorkerOptions

    add_option_flags(join.add_argument_group("worker", "how this worker serves (its bounds, the weights it keeps, "
                                                       "inference sessions)"), WorkerOptions)
    add_option_flags(join.add_argument_group("join", "the daemon around it: its DHT peer, checkpoints, the files it "
                                                     "writes, the sync phases and rebalancing"), JoinOptions)
    from agora.node.inference.commands import add_client_commands

    add_admission_arguments(join)
    add_metrics_arguments(join)
    join.set_defaults(handler=_cmd_join)

    trainer = commands.add_parser("trainer", help="push microbatches through the swarm",
                                  description="Take data units, route microbatches through one worker per stage, "
                                              "reroute on failure; logs the train-local JSON schema.")
    # A trainer holds no weights: its --device/--dtype are checked, and its tensors stay on the host.
    add_run_arguments(trainer, steps_help="global batches of the whole run (over all trainers)", computes=True)
    add_swarm_flags(trainer)
    from agora.node.trainer.options import TrainerOptions

    add_option_flags(trainer.add_argument_group("trainer", "how this trainer runs"), TrainerOptions)
    add_admission_arguments(trainer)
    add_metrics_arguments(trainer)
    trainer.set_defaults(handler=_cmd_trainer)

    monitor = commands.add_parser("monitor", help="the swarm's status page, Prometheus service discovery and metrics",
                                  description="Join the DHT read-only and serve, on one HTTP port: / (a live "
                                              "status page), /api/swarm (the same as JSON), /sd (Prometheus HTTP "
                                              "service discovery of every node's metrics endpoint) and /metrics "
                                              "(swarm-level gauges).")
    add_run_arguments(monitor, steps_help="planned run length (only for the run fingerprint at admission)")
    add_swarm_flags(monitor)
    from agora.monitor.options import MonitorOptions

    add_option_flags(monitor.add_argument_group("monitor", "what it serves, and how often it reads the swarm"),
                     MonitorOptions)
    add_admission_arguments(monitor)
    monitor.set_defaults(handler=_cmd_monitor)

    demo = commands.add_parser("demo", help="a whole swarm on this machine, one process per role",
                               description="Start bootstrap, workers and trainers on loopback, each as the "
                                           "`agora-node <role>` command a user would run, train, and summarize.")
    add_run_arguments(demo, steps_help="global batches in total (over all trainers)", computes=True)
    from agora.node.demo.options import DemoOptions

    add_option_flags(demo.add_argument_group("demo", "the swarm it starts"), DemoOptions)
    demo.set_defaults(handler=_cmd_demo, stages=3, steps=200)

    from agora.node.authorizer import add_authorizer_commands
    from agora.node.export import add_export_command

    add_authorizer_commands(commands)
    add_export_command(commands)
    from agora.node.plan import add_plan_command

    add_plan_command(commands)
    from agora.node.doctor_command import add_doctor_command

    add_doctor_command(commands)
    from agora.node.ledger_command import add_ledger_command

    add_ledger_command(commands)
    from agora.node.simulate.command import add_simulate_command

    add_simulate_command(commands)
    add_config_command(commands)
    add_client_commands(commands)
    return parser


def _die_with_parent() -> None:
    """A supervised child is killed when its supervisor dies, even by kill -9 (Linux's parent-death
    signal), so a killed demo leaves no workers behind holding ports and state directories. Its own
    helper processes (hivemind's) follow it: they exit when their owner is gone."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # it died before the signal was set up
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a worker that moves stage starts again with them
    configure_logging(args.log_level, args.log_format)
    if args.threads is not None:
        _set_threads(max(1, args.threads))
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print(f"agora-node {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        code = _exit_code(error)
        if code is None:
            raise
        print(f"agora-node {args.command}: error: {error}", file=sys.stderr)
        return code


def _exit_code(error: Exception) -> int | None:
    """2 for the user's mistake (a flag, a config, a checkpoint, a folder in use), 1 for the swarm's
    (nobody answered, or the DHT process died), None for a bug (its traceback is shown)."""
    if isinstance(error, ConfigError):
        return 2
    # Only on this path: these modules import torch and hivemind, which a command that raised
    # one of their errors has imported already.
    from agora.pipeline.checkpoint import CheckpointError

    if isinstance(error, CheckpointError):
        return 2
    from agora.dht.swarm import DHTRequestError

    return 1 if isinstance(error, DHTRequestError) else None


def _set_threads(threads: int) -> None:
    """torch's intra-op threads. A command that never imports torch (`authorizer issue`, `--help`)
    does not pay for importing it here: torch reads OMP_NUM_THREADS when it is first imported,
    which gives the same pool as set_num_threads."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    else:
        os.environ["OMP_NUM_THREADS"] = str(threads)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
