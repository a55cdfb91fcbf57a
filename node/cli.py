"""`agora-node`: one console script, one subcommand per role.

This module is the command table: each role's module mounts its subcommand (`add_*_command`: its
flags, generated from the role's settings sections, and its handler, which builds the role's
objects and runs), and `main` runs the one given. A user's mistake (bad config, missing file)
ends in one readable line and exit code 2, a failure of the swarm in exit code 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Literal

from pydantic import StrictInt
from pydantic.dataclasses import dataclass

from agora.node.authorizer import add_authorizer_commands
from agora.node.bootstrap_command import add_bootstrap_command
from agora.node.demo.command import add_demo_command
from agora.node.demo.supervision import die_with_parent
from agora.node.doctor_command import add_doctor_command
from agora.node.export import add_export_command, add_export_hf_command
from agora.node.inference.commands import add_client_commands
from agora.node.ledger_command import add_ledger_command
from agora.node.logs import LOG_FORMATS, configure_logging
from agora.node.monitor_command import add_monitor_command
from agora.node.plan import add_plan_command
from agora.node.run_flags import add_config_command
from agora.node.simulate.command import add_simulate_command
from agora.node.train_local_command import add_train_local_command
from agora.node.trainer_command import add_trainer_command
from agora.node.worker.command import add_join_command
from agora.pipeline.config import ConfigError
from agora.pipeline.option_flags import add_option_flags, options_from_args
from agora.pipeline.schema import SECTION, setting

__all__ = ["main", "build_parser", "ProcessOptions"]


@dataclass(frozen=True, config=SECTION)
class ProcessOptions:
    """What every command's process takes before the command's name (`agora-node --threads 1 join ...`):
    how it logs, how many threads torch computes on."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = setting(
        "INFO", "logging level (any case)", flag="--log-level")
    log_format: Literal[LOG_FORMATS] = setting(
        "text", "text lines for people, or one JSON object per line with milestone events (joined, sync_phase, "
        "phase_changed, state_downloaded, averaging_round, reroute, ban, checkpoint_written, credential_renewed)",
        flag="--log-format")
    threads: StrictInt | None = setting(None, "torch intra-op threads (default: torch's choice)", flag="--threads",
                                        metavar="N", gt=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agora-node", description="Agora node: peer-to-peer pipeline-parallel "
                                                                    "training of subspace-compressed transformers.")
    add_option_flags(parser, ProcessOptions)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_local_command(commands)
    add_export_hf_command(commands)
    add_bootstrap_command(commands)
    add_join_command(commands)
    add_trainer_command(commands)
    add_monitor_command(commands)
    add_demo_command(commands)
    add_authorizer_commands(commands)
    add_export_command(commands)
    add_plan_command(commands)
    add_doctor_command(commands)
    add_ledger_command(commands)
    add_simulate_command(commands)
    add_config_command(commands)
    add_client_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a worker that moves stage starts again with them
    try:
        process = options_from_args(ProcessOptions, args, "process")
    except ConfigError as error:
        print(f"agora-node: error: {error}", file=sys.stderr)
        return 2
    configure_logging(process.log_level, process.log_format)
    if process.threads is not None:
        _set_threads(process.threads)
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
