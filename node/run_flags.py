"""The run flags: what every process of one run must agree on (`--config`, `--seed`, `--stages`,
the batch, the schedule, the averaging), and the run config they make.

`agora-node`'s subcommands take them through `add_run_arguments` and read them with `run_config`;
they are all in the run fingerprint, so a process with other values is another run. (Device and
precision are this machine's: node/runtime_flags.py.)
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from agora.node.runtime_flags import apply_runtime_flags
from agora.pipeline.config import RunConfig, load_config

__all__ = ["add_run_arguments", "add_averaging_arguments", "run_config", "non_negative_int", "SYNC_FLAGS"]


def run_config(args: argparse.Namespace, base: RunConfig | None = None) -> RunConfig:
    """The run flags applied to `--config` (default tiny), or to `base` (the config an authorizer serves)."""
    config = base if base is not None and args.config is None else load_config(args.config or "tiny")
    if getattr(args, "seed", None) is not None:
        config = replace(config, seed=args.seed, model=replace(config.model, basis_seed=args.seed),
                         data=replace(config.data, seed=args.seed))
    if getattr(args, "stages", None) is not None:
        config = config.with_stages(args.stages)
    if getattr(args, "batch_size", None) is not None:
        config = replace(config, train=replace(config.train, batch_size=args.batch_size))
    if getattr(args, "microbatches", None) is not None:
        config = replace(config, train=replace(config.train, microbatches=args.microbatches))
    if getattr(args, "schedule_steps", None) is not None:
        config = replace(config, optim=replace(config.optim, total_steps=args.schedule_steps))
    elif getattr(args, "steps", None) is not None and args.steps > config.optim.total_steps:
        # A run longer than the schedule would sit at the floor lr; stretch the schedule instead.
        config = replace(config, optim=replace(config.optim, total_steps=args.steps))
    sync = {name: getattr(args, flag) for name, flag in SYNC_FLAGS.items() if getattr(args, flag, None) is not None}
    if sync:
        config = replace(config, sync=replace(config.sync, **sync))
    return apply_runtime_flags(args, config).validate()


# config.sync fields set by `join`/`demo` flags (argparse destination of each flag).
SYNC_FLAGS = {"method": "averaging", "every_steps": "averaging_every", "fraction": "averaging_fraction",
               "average_optimizer_state": "average_optimizer_state", "aggregation": "aggregation"}


def add_averaging_arguments(parser: argparse.ArgumentParser) -> None:
    """How replicas of a stage stay together; must be identical on every worker of the run."""
    parser.add_argument("--averaging", default=None, choices=["sparta", "diloco", "none"],
                        help="sync method between replicas of a stage (default: the config's sync.method)")
    parser.add_argument("--averaging-every", type=int, default=None, metavar="STEPS",
                        help="local steps between averaging rounds (default: the config's sync.every_steps)")
    parser.add_argument("--averaging-fraction", type=float, default=None, metavar="P",
                        help="sparta: share of the stage averaged per round (default: sync.fraction)")
    parser.add_argument("--average-optimizer-state", action="store_true", default=None,
                        help="sparta: also average the Adam moments of the slice")
    parser.add_argument("--aggregation", default=None, choices=["centered_clip", "mean"],
                        help="how a reducer combines its group: centered_clip (weight caps, outliers rejected, "
                             "CenteredClip, bounded moves; the default) or mean (hivemind's plain weighted mean, "
                             "for trusted machines only)")


def add_run_arguments(parser: argparse.ArgumentParser, *, steps_help: str, averaging: bool = True,
                       seed_flag: str = "--seed") -> None:
    """Flags that must be identical on every process of one run (they are all in its fingerprint,
    the averaging ones included: a trainer or an authorizer with other sync settings is another run)."""
    parser.add_argument("--config", default=None,
                        help="preset name (tiny, small, pythia-14m, pluralis-8b), TOML file or checkpoint folder "
                             "(default: the run config the authorizer serves, else tiny)")
    parser.add_argument(seed_flag, dest="seed", type=int, default=None, help="run seed (basis, init and data order)")
    parser.add_argument("--stages", type=int, default=None, help="split the blocks evenly over this many stages")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per global batch")
    parser.add_argument("--microbatches", type=int, default=None, help="microbatches per global batch")
    parser.add_argument("--steps", type=int, default=100, help=steps_help)
    parser.add_argument("--schedule-steps", type=int, default=None, metavar="STEPS",
                        help="length of the learning-rate schedule in global batches (default: the config's "
                             "optim.total_steps, stretched to --steps when shorter)")
    if averaging:
        add_averaging_arguments(parser)


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
