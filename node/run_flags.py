"""The run flags, generated from the run config's schema (pipeline/config.py), and `config show`.

Each leaf of pipeline/config.py's schema is a flag `--section.field` (`--sync.every-steps 8`,
`--model.rank none`), and the settings the schema gives a short name also answer to it
(`--averaging-every 8`); the help text, type, choices and bounds are the schema's, so a setting is
declared once. Three flags are not one setting: `--config` (the base: a preset, a TOML file or a
checkpoint folder), `--seed` (the run seed, which also seeds the basis and the data order) and
`--stages` (the blocks split evenly); `--steps` is the run's length, and stretches the schedule
when it is longer. A flag given wins over the file, which wins over the preset.

Settings marked machine-local in the schema (device, precision, token cache, a joiner's warm-up)
are this process's own; every other one is in the run fingerprint, so a process with another
value is another run.

A role's options (a worker's queues, the demo's swarm) are sections of the same kind; the fields
that declare a flag are that role's command-line options (pipeline/option_flags.py).
"""

from __future__ import annotations

import argparse
from typing import Any

from agora.pipeline.config import (ConfigError, RunConfig, RuntimeConfig, checked, config_with, load_config_sources,
                                   run_settings, split_layers)
from agora.pipeline.option_flags import shown_default, value_parser
from agora.pipeline.schema import Setting

__all__ = ["add_run_arguments", "run_config", "run_config_sources", "explicit_settings", "setting_flags",
           "check_runtime_flags", "add_config_command"]

# Leaves without a flag of their own: the name is the config's, the seed is --seed's.
_NOT_FLAGS = ("name", "seed")


def _help(item: Setting) -> str:
    return f"{item.help} (default: the config's; {shown_default(item.default)} in the schema)".replace("%", "%%")


def add_run_arguments(parser: argparse.ArgumentParser, *, steps_help: str, seed_flag: str = "--seed",
                      computes: bool = False, skip: tuple[str, ...] = ()) -> None:
    """The run flags. `computes`: this command computes, so the device it is given must exist
    here; `skip`: short names the command uses for something else."""
    parser.add_argument("--config", default=None,
                        help="preset name (tiny, small, pythia-14m, pluralis-8b), TOML file or checkpoint folder "
                             "(default: the run config the authorizer serves, else tiny)")
    parser.add_argument(seed_flag, dest="seed", type=int, default=None,
                        help="run seed: also seeds the basis (model.basis_seed) and the data order (data.seed)")
    parser.add_argument("--stages", type=int, default=None, help="split the blocks evenly over this many stages")
    parser.add_argument("--steps", type=int, default=100, help=steps_help)
    parser.set_defaults(computes=computes)
    # The run config's sixty-odd flags would fill a screen on every mistyped flag: --help lists them.
    parser.usage = "%(prog)s [flags] (--help lists them)"
    run = parser.add_argument_group("run config", "every process of a run must agree on these (a TOML file given "
                                                  "to --config sets the same; `agora-node config show` prints them)")
    machine = parser.add_argument_group("this machine", "settings each process chooses for itself")
    for item in run_settings():
        if item.path in _NOT_FLAGS:
            continue
        names = [item.flag] + ([item.short_flag] if item.short_flag and item.short_flag not in skip else [])
        if item.scalar is bool and item.short_flag in names:  # `--average-optimizer-state` alone means true
            group = machine if item.local else run
            group.add_argument(item.short_flag, dest=item.path, action="store_const", const=True,
                               default=argparse.SUPPRESS, help=_help(item))
            names.remove(item.short_flag)
        (machine if item.local else run).add_argument(
            *names, dest=item.path, type=value_parser(item), default=argparse.SUPPRESS, choices=item.choices,
            nargs="+" if item.is_tuple else None, metavar=item.metavar, help=_help(item))


def explicit_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run settings this command line sets by their own flags, by dotted path."""
    paths = {item.path for item in run_settings()} - set(_NOT_FLAGS)
    return {path: (tuple(value) if isinstance(value, list) else value)
            for path, value in vars(args).items() if path in paths}


def run_config(args: argparse.Namespace, base: RunConfig | None = None) -> RunConfig:
    """The run flags applied to `--config` (default tiny), or to `base` (the config an authorizer serves)."""
    return run_config_sources(args, base)[0]


def run_config_sources(args: argparse.Namespace, base: RunConfig | None = None
                       ) -> tuple[RunConfig, dict[str, str]]:
    """`run_config`, and where each setting's value comes from (`agora-node config show`)."""
    if base is not None and args.config is None:
        config, sources = base, {path: "the authorizer" for path in (item.path for item in run_settings())}
    else:
        config, sources = load_config_sources(args.config or "tiny")
    explicit = explicit_settings(args)
    derived: dict[str, tuple[Any, str]] = {}
    seed = getattr(args, "seed", None)
    if seed is not None:
        derived |= {path: (seed, "--seed") for path in ("seed", "model.basis_seed", "data.seed")}
    if getattr(args, "stages", None) is not None:
        n_layers = explicit.get("model.n_layers", config.model.n_layers)
        derived["model.layer_split"] = (split_layers(n_layers, args.stages), "--stages")
    steps = getattr(args, "steps", None)
    if steps is not None and "optim.total_steps" not in explicit and steps > config.optim.total_steps:
        # A run longer than the schedule would sit at the floor lr; stretch the schedule instead.
        derived["optim.total_steps"] = (steps, "--steps")
    settings = {path: value for path, (value, _) in derived.items()} | explicit
    sources |= {path: source for path, (_, source) in derived.items()}
    flags = {item.path: item.flag for item in run_settings()}
    sources |= {path: flags[path] for path in explicit}
    config = config_with(config, settings)
    if getattr(args, "computes", False):
        from agora.pipeline.runtime import Runtime  # (torch: not for a command that only parses)

        Runtime.from_config(config.runtime)  # a device this machine lacks, from a flag, a file or an authorizer
    return config, sources


def check_runtime_flags(args: argparse.Namespace) -> None:
    """Refuse (ConfigError, one line) a --device/--dtype this machine cannot run, before anything
    starts (admission included)."""
    values = {path.rpartition(".")[2]: value for path, value in explicit_settings(args).items()
              if path.startswith("runtime.")}
    if values:
        from agora.pipeline.runtime import Runtime

        Runtime.from_config(checked(RuntimeConfig, "runtime", **values))


def setting_flags(settings: dict[str, Any]) -> list[str]:
    """The argv that sets `settings` (dotted paths) in a child process: what `add_run_arguments` parses back."""
    known = {item.path: item for item in run_settings()}
    flags: list[str] = []
    for path, value in settings.items():
        if path not in known:
            raise ConfigError(f"{path}: not a setting of the run config")
        values = value if isinstance(value, (tuple, list)) else (value,)
        flags += [known[path].flag,
                  *("none" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for v in values)]
    return flags


def add_config_command(commands) -> None:
    config = commands.add_parser("config", help="the effective run config, and where each value comes from",
                                 description="Resolve the run flags as every role does and print the result.")
    actions = config.add_subparsers(dest="config_action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print the effective run config as TOML (it loads back with --config), "
                                           "each value commented with its source; or as JSON",
                              description="The config a role given these flags would run, as a TOML file that "
                                          "loads back to it, each value commented with its source (default, "
                                          "preset, file, checkpoint or flag); and the run fingerprint it gives.")
    add_run_arguments(show, steps_help="planned run length (stretches the schedule when longer)")
    show.add_argument("--json", action="store_true", help="plain JSON values and sources instead")
    show.set_defaults(handler=_cmd_config_show)


def _cmd_config_show(args: argparse.Namespace) -> int:
    import json

    from agora.pipeline.config import config_to_dict, config_to_toml
    from agora.pipeline.fingerprint import run_fingerprint

    config, sources = run_config_sources(args)
    fingerprint = run_fingerprint(config).text()
    if args.json:
        print(json.dumps({"config": config_to_dict(config), "sources": sources, "fingerprint": fingerprint}))
    else:
        print(f"# agora-node run config; fingerprint {fingerprint}\n{config_to_toml(config, sources)}", end="")
    return 0
