"""`--device` and `--dtype`: where a role computes and in what precision (pipeline/runtime.py).

`join`, `trainer`, `train-local` and `demo` take them; they override the config's `[runtime]`
section (or the one an authorizer serves: the run's suggestion, not its rule, since `[runtime]` is
not in the run fingerprint). A device this machine cannot provide is refused in one line before
anything is admitted or loaded. A trainer holds no weights: it checks the flags, so one set of
flags can be given to every process of a run, and keeps its tensors on the host.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from agora.pipeline.config import COMPUTE_DTYPES, ConfigError, RunConfig, RuntimeConfig

__all__ = ["add_runtime_arguments", "apply_runtime_flags", "check_runtime_flags", "runtime_flag_values"]


def _device_spec(text: str) -> str:
    try:
        RuntimeConfig(device=text).validate()
    except ConfigError:
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}") from None
    return text


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, metavar="DEVICE", type=_device_spec,
                        help="auto (cuda when available, else cpu), cpu, cuda or cuda:N (default: the config's "
                             "runtime.device, auto)")
    parser.add_argument("--dtype", default=None, choices=COMPUTE_DTYPES,
                        help="compute precision: fp32, or bf16 (bf16 autocast over fp32 master weights and optimizer "
                             "state; default: the config's runtime.dtype, fp32)")


def runtime_flag_values(args: argparse.Namespace) -> dict[str, str]:
    """The `[runtime]` fields the command line sets."""
    values = {"device": getattr(args, "device", None), "dtype": getattr(args, "dtype", None)}
    return {name: value for name, value in values.items() if value is not None}


def apply_runtime_flags(args: argparse.Namespace, config: RunConfig) -> RunConfig:
    """`config` with the command line's --device/--dtype in its `[runtime]`. For a command that takes
    them (one that computes), the result must be runnable here: a `[runtime]` from a config file or
    an authorizer asking for a device this machine lacks is refused like the flag, before loading."""
    values = runtime_flag_values(args)
    config = replace(config, runtime=replace(config.runtime, **values)) if values else config
    if hasattr(args, "device"):
        from agora.pipeline.runtime import Runtime  # (torch: not for a command that only parses)

        Runtime.from_config(config.runtime)
    return config


def check_runtime_flags(args: argparse.Namespace) -> None:
    """Refuse (ConfigError, one line) a --device/--dtype this machine cannot run, before anything starts."""
    values = runtime_flag_values(args)
    if values:
        from agora.pipeline.runtime import Runtime

        Runtime.from_config(RuntimeConfig(**values))
