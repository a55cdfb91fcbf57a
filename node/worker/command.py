"""`agora-node join`: admit the worker, check that its stage fits in memory, hold its checkpoint
folder, run the daemon (node/worker/join.py), and start again on another stage when rebalancing
moves it.

Every option is read and checked before admission, so a bad flag costs no round trip to the
authorizer; what admission settles (the stage, the run, the peers, the authorizer, the default
checkpoint folder beside the credential) is filled in afterwards. Light at the top (no torch):
the CLI mounts the command from here.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

from agora.node.admission import (Admission, AdmissionOptions, add_admission_arguments, admit_node, config_chooser,
                                  free_port)
from agora.node.inference.commands import serve_only_config_flags
from agora.node.observability import MetricsOptions, add_metrics_arguments
from agora.node.rpc.server import announced_host
from agora.node.run_flags import add_run_arguments, check_runtime_flags, explicit_settings, run_config
from agora.node.swarm_options import SwarmOptions, add_swarm_flags
from agora.node.worker.join_options import JoinOptions
from agora.node.worker.options import WorkerOptions
from agora.node.worker.watchdog_rules import exit_codes_help
from agora.pipeline.files import hold_folder
from agora.pipeline.option_flags import add_option_flags, options_from_args

__all__ = ["add_join_command"]


def add_join_command(commands) -> None:
    join = commands.add_parser("join", help="host one replica of one pipeline stage (contributor)",
                               description="Serve one pipeline stage over gRPC, announce it in the DHT, train it; "
                                           "SIGTERM leaves cleanly (withdraw, tell the authorizer, finish in-flight, "
                                           "checkpoint), and so does its watchdog when a rule trips.",
                               epilog=exit_codes_help())
    add_run_arguments(join, steps_help="planned run length in global batches (sets the lr schedule)", computes=True)
    add_swarm_flags(join)
    add_option_flags(join.add_argument_group("worker", "how this worker serves (its bounds, the weights it keeps, "
                                                       "inference sessions)"), WorkerOptions)
    add_option_flags(join.add_argument_group("join", "the daemon around it: its DHT peer, checkpoints, the files it "
                                                     "writes, the sync phases and rebalancing"), JoinOptions)
    add_admission_arguments(join)
    add_metrics_arguments(join)
    join.set_defaults(handler=_cmd_join)


def _cmd_join(args: argparse.Namespace) -> int:
    from agora.node.worker.join import run_worker

    check_runtime_flags(args)  # a device this machine lacks is refused before admission
    serve_only_config_flags(args)  # --serve-only: the checkpoint is the run config unless --config
    swarm = options_from_args(SwarmOptions, args, "swarm")
    options = options_from_args(JoinOptions, args, "join", run_id=swarm.run_id)
    worker_options = options_from_args(WorkerOptions, args, "worker")
    metrics = options_from_args(MetricsOptions, args, "metrics")
    admission_options = options_from_args(AdmissionOptions, args, "admission")
    if worker_options.port == 0:  # the authorizer's dial-back and then the gRPC server take this port
        worker_options = replace(worker_options, port=free_port(worker_options.host))
    announce = (announced_host(worker_options.host, worker_options.announce_host), worker_options.port)
    admission = admit_node(admission_options, role="worker", run_id=swarm.run_id, stage=options.stage,
                           config_for=config_chooser(args, run_config), initial_peers=swarm.initial_peers,
                           announce=announce, listen_host=worker_options.host,
                           device=explicit_settings(args).get("runtime.device"))
    if options.memory_check and not worker_options.serve_only:  # before the DHT peer and the stage exist
        _check_memory(admission, worker_options)
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
        _start_again(args.argv, ended.move_to, admission)
    return ended.code


def _check_memory(admission: Admission, worker_options: WorkerOptions) -> None:
    """Refuse (ConfigError, one line) a stage that does not fit this machine's memory."""
    from agora.node.plan import check_stage_fits, worker_memory_options
    from agora.pipeline.runtime import Runtime

    check_stage_fits(admission.config, admission.stage, Runtime.from_config(admission.config.runtime),
                     worker_memory_options(admission.config, rows=worker_options.max_rows,
                                           pinned_versions=worker_options.pinned_weights,
                                           in_flight=worker_options.stash_capacity,
                                           inference=worker_options.inference))


def _start_again(argv: list[str], stage: int, admission: Admission) -> None:
    """Replace this process with the same worker (key, flags) on `stage`."""
    from agora.node.membership.rebalance import moved_argv

    state_dir = str(admission.credentials.directory) if admission.credentials is not None else None
    command = [sys.executable, "-m", "agora.node", *moved_argv(argv, stage, state_dir)]
    logging.getLogger("agora.node.join").info("starting again as stage %d: %s", stage, " ".join(command[3:]))
    logging.shutdown()
    os.execv(sys.executable, command)
