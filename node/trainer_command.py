"""`agora-node trainer`: admit the trainer, then run it (node/trainer/command.py) and print its summary.

Every option is read and checked before admission, so a bad flag costs no round trip to the
authorizer. Light at the top (no torch): the CLI mounts the command from here.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from agora.node.admission import AdmissionOptions, add_admission_arguments, admit_node, config_chooser
from agora.node.observability import MetricsOptions, add_metrics_arguments
from agora.node.run_flags import add_run_arguments, check_runtime_flags, run_config
from agora.node.swarm_options import SwarmOptions, add_swarm_flags
from agora.node.trainer.options import TrainerOptions
from agora.pipeline.option_flags import add_option_flags, options_from_args

__all__ = ["add_trainer_command"]


def add_trainer_command(commands) -> None:
    trainer = commands.add_parser("trainer", help="push microbatches through the swarm",
                                  description="Take data units, route microbatches through one worker per stage, "
                                              "reroute on failure; logs the train-local JSON schema.")
    # A trainer holds no weights: its --device/--dtype are checked, and its tensors stay on the host.
    add_run_arguments(trainer, steps_help="global batches of the whole run (over all trainers)", computes=True)
    add_swarm_flags(trainer)
    add_option_flags(trainer.add_argument_group("trainer", "how this trainer runs"), TrainerOptions)
    add_admission_arguments(trainer)
    add_metrics_arguments(trainer)
    trainer.set_defaults(handler=_cmd_trainer)


def _cmd_trainer(args: argparse.Namespace) -> int:
    from agora.node.trainer.command import run_swarm_trainer  # torch and hivemind: not for --help

    metrics = options_from_args(MetricsOptions, args, "metrics")
    check_runtime_flags(args)
    swarm = options_from_args(SwarmOptions, args, "swarm")
    options = options_from_args(TrainerOptions, args, "trainer", run_id=swarm.run_id)  # refused before admission
    admission_options = options_from_args(AdmissionOptions, args, "admission")
    admission = admit_node(admission_options, role="trainer", run_id=swarm.run_id, stage=None,
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
