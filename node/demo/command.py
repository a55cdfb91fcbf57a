"""`agora-node demo`: a whole swarm on this machine, one process per role (node/demo/demo.py), or
a serving swarm on a checkpoint's weights (node/demo/serving.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from agora.node.demo.options import DemoOptions
from agora.node.run_flags import add_run_arguments, check_runtime_flags, run_config
from agora.pipeline.option_flags import add_option_flags

__all__ = ["add_demo_command"]


def add_demo_command(commands) -> None:
    demo = commands.add_parser("demo", help="a whole swarm on this machine, one process per role",
                               description="Start bootstrap, workers and trainers on loopback, each as the "
                                           "`agora-node <role>` command a user would run, train, and summarize.")
    add_run_arguments(demo, steps_help="global batches in total (over all trainers)", computes=True)
    add_option_flags(demo.add_argument_group("demo", "the swarm it starts"), DemoOptions)
    demo.set_defaults(handler=_cmd_demo, stages=3, steps=200)


def _cmd_demo(args: argparse.Namespace) -> int:
    from agora.node.demo.demo import run_demo

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
