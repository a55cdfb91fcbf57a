"""`agora-node plan`, and the memory check `join` runs before it loads anything (pipeline/memory.py).

    agora-node plan --config C [--stages S] [--device D] [--dtype D] [--microbatch M]
                    [--pinned-weights N] [--in-flight N] [--max-kv-cache-gib G] [--memory-gb G] [--json]

prints, per stage, what one worker holds at its peak and whether it fits G GB (exit 1 when a
stage does not). It plans for the device type it is told, not the one this machine has: an
operator can size a run for GPUs from a laptop. `join` plans its own stage on its own device with
its own options (the run's microbatch or `--max-rows`, `--pinned-weights`, the stash capacity,
the inference sessions' cache budget) and, when the peak exceeds the memory free there, refuses in one line naming the shortfall and
what would shrink it, before it starts a DHT peer or builds the stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import logging
from typing import TYPE_CHECKING, Literal

from pydantic import StrictFloat, StrictInt
from pydantic.dataclasses import dataclass

from agora.node.inference.options import InferenceOptions
from agora.node.worker.options import WorkerOptions
from agora.pipeline.config import ConfigError, RunConfig, RuntimeConfig
from agora.pipeline.schema import SECTION, like, setting

if TYPE_CHECKING:  # torch: imported by the commands that plan, not by parsing their flags
    from agora.pipeline.memory import MemoryOptions, StagePlan
    from agora.pipeline.runtime import DeviceMemory, Runtime

__all__ = ["PlanOptions", "add_plan_command", "cached_plan_stage", "check_stage_fits", "stage_memory_problem",
           "worker_memory_options"]

logger = logging.getLogger("agora.node.plan")


@dataclass(frozen=True, config=SECTION)
class PlanOptions:
    """What `plan` sizes the workers for: the device and precision it plans on (not this machine's),
    and the worker options that change what a worker holds (a worker's own declarations, `like`)."""

    device: Literal["auto", "cpu", "cuda"] | None = setting(
        None, "the device type to plan for (default: the config's, auto: this machine's)", flag="--device")
    dtype: Literal["fp32", "bf16"] | None = like(RuntimeConfig, "dtype", default=None,
                                                 description="compute precision (default: the config's)")
    microbatch: StrictInt | None = setting(
        None, "samples per microbatch (default: the run's train.microbatch_size)", flag="--microbatch", metavar="M",
        gt=0)
    pinned_weights: StrictInt | None = like(WorkerOptions, "pinned_weights", default=None)
    in_flight: StrictInt | None = setting(
        None, "forward inputs a worker stashes at most (default: the worker's stash capacity, worker.stash_capacity)",
        flag="--in-flight", metavar="N", gt=0)
    max_kv_cache_gib: StrictFloat | None = like(InferenceOptions, "max_kv_cache_gib")
    memory_gb: StrictFloat | None = setting(
        None, "say per stage whether it fits G GB (decimal, as cards are sold) of device memory", flag="--memory-gb",
        metavar="G", gt=0)


def worker_memory_options(config: RunConfig, *, rows: int | None = None, pinned_versions: int | None = None,
                          in_flight: int | None = None, inference: InferenceOptions | None = None) -> MemoryOptions:
    """What a worker with these options keeps: by default `join`'s (the run's microbatch, 2 pinned
    versions, the stash's 64 entries, the inference sessions' cache budget) and the Abort records of
    a whole global batch (one replica)."""
    from agora.node.worker.options import DEFAULT_PINNED_VERSIONS
    from agora.pipeline.memory import MemoryOptions

    inference = inference or InferenceOptions()
    return MemoryOptions(
        microbatch=rows or config.train.microbatch_size, seq_len=config.train.seq_len,
        in_flight=WorkerOptions().stash_capacity if in_flight is None else in_flight,
        pinned_versions=DEFAULT_PINNED_VERSIONS if pinned_versions is None else pinned_versions,
        applied=config.train.microbatches, session_positions=inference.session_positions(config),
        kv_cache_bytes=inference.set_kv_cache_bytes)


def _cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from agora.node.run_flags import run_config
    from agora.pipeline.memory import format_plan, plan_run
    from agora.pipeline.option_flags import options_from_args

    asked = options_from_args(PlanOptions, args, "plan")
    config = run_config(args)  # (the plan's --device/--dtype are not this machine's: kept apart from it)
    device = asked.device or config.runtime.device
    device_type = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device.split(":")[0]
    dtype = asked.dtype or config.runtime.dtype
    inference = InferenceOptions(max_kv_cache_gib=asked.max_kv_cache_gib)
    options = worker_memory_options(config, rows=asked.microbatch, pinned_versions=asked.pinned_weights,
                                    in_flight=asked.in_flight, inference=inference)
    plans = plan_run(config, options, device_type=device_type, dtype=dtype, weights=config.runtime.weights)
    available = None if asked.memory_gb is None else int(asked.memory_gb * 1e9)
    if args.json:
        print(json.dumps({"config": config.name, "device": device_type, "microbatch": options.microbatch,
                          "seq_len": options.seq_len, "in_flight": options.in_flight,
                          "pinned_versions": options.pinned_versions, "applied": options.applied,
                          "session_positions": options.session_positions, "kv_cache_bytes": options.kv_cache_bytes,
                          "stages": [plan.as_dict() for plan in plans]}))
    else:
        print(f"memory plan: {config.name}, {len(plans)} stages, {device_type} {dtype}, "
              f"microbatch {options.microbatch} x {options.seq_len} tokens, {options.in_flight} forwards stashed, "
              f"{options.pinned_versions} pinned versions, {options.applied} microbatches per step, inference "
              + (f"caches of {asked.max_kv_cache_gib:g} GiB" if asked.max_kv_cache_gib is not None else
                 f"caches for {inference.max_sessions} sessions of {inference.session_tokens(config)} positions"))
        print(format_plan(plans, asked.memory_gb))
    return 1 if available is not None and any(plan.shortfall(available) for plan in plans) else 0


def add_plan_command(commands) -> None:
    from agora.node.run_flags import add_run_arguments
    from agora.pipeline.option_flags import add_option_flags

    plan = commands.add_parser("plan", help="what one worker of each stage needs in memory, and whether it fits",
                               description="Per stage: parameters, gradients, optimizer state, pinned weight "
                                           "versions, fixed buffers (U, T), the stash of forward inputs, Abort "
                                           "records, the inference sessions' caches, the worst job's working set, "
                                           "and the peak, in GiB, computed from the stage's modules without "
                                           "allocating them. Exit 1 when a stage does not fit --memory-gb.")
    add_run_arguments(plan, steps_help="planned run length (does not change the plan)", skip=("--device", "--dtype"))
    add_option_flags(plan.add_argument_group("plan", "what it plans for"), PlanOptions)
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object (bytes)")
    plan.set_defaults(handler=_cmd_plan)


def _remedies(plan: StagePlan, runtime: Runtime, options: MemoryOptions) -> str:
    from agora.pipeline.memory import GiB

    ideas = []
    if runtime.dtype == "fp32":
        ideas.append("--dtype bf16")
    if options.pinned_versions and plan.pinned and not plan.pinned_on_host:
        ideas.append("--pinned-weights 0")
    if plan.kv_cache:
        ideas.append(f"a --max-kv-cache-gib below the sessions' {plan.kv_cache / GiB:.2f}")
    ideas.append("a run with smaller microbatches (train.microbatches)")
    return ", ".join(ideas)


# The modules a plan is computed from: any change to one of them is a new plan.
_PLAN_SOURCES = ("agora.pipeline.memory", "agora.pipeline.inference", "agora.pipeline.model", "agora.pipeline.stages", "agora.pipeline.optim",
                 "agora.pipeline.runtime", "agora.pipeline.config")


def _plan_key(config: RunConfig, stage: int, runtime: Runtime, options: MemoryOptions) -> str:
    """Everything a stage's plan depends on: the geometry (not the seeds: they fill tensors, not
    size them), the optimizer, the worker's options, device type and dtypes, torch and our code."""
    import torch

    described = {"model": dataclasses.asdict(dataclasses.replace(config.model, basis_seed=0)),
                 "optim": dataclasses.asdict(config.optim), "stage": stage, "options": dataclasses.asdict(options),
                 "device": runtime.device.type, "dtype": runtime.dtype, "weights": runtime.weights,
                 "torch": torch.__version__}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())
    for name in _PLAN_SOURCES:
        with open(importlib.import_module(name).__file__, "rb") as source:
            digest.update(source.read())
    return digest.hexdigest()[:32]


def cached_plan_stage(config: RunConfig, stage: int, runtime: Runtime, options: MemoryOptions) -> StagePlan:
    """`plan_stage`, kept in the cache folder (the token cache's: data.cache_dir, $AGORA_CACHE_DIR or
    ~/.cache/agora-node) under a hash of everything it depends on. Planning runs the stage's jobs on
    fake tensors: 0.3 to 0.7 CPU-s for `tiny`, each time a worker starts. An unreadable entry is
    planned again and rewritten."""
    from agora.pipeline.data import resolve_cache_dir
    from agora.pipeline.files import atomic_write
    from agora.pipeline.memory import StagePlan, plan_stage

    path = resolve_cache_dir(config.data) / "plans" / f"{_plan_key(config, stage, runtime, options)}.json"
    try:
        cached = StagePlan(**json.loads(path.read_text()))
        if all(type(getattr(cached, field.name)).__name__ == field.type for field in dataclasses.fields(cached)):
            return cached
    except (OSError, ValueError, TypeError):
        pass
    plan = plan_stage(config, stage, options, device_type=runtime.device.type, dtype=runtime.dtype,
                      weights=runtime.weights)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(dataclasses.asdict(plan)).encode(), mode=0o644)
    except OSError as error:  # a read-only cache only costs the next start the planning again
        logger.debug("memory plan: not cached (%s)", error)
    return plan


def stage_memory_problem(config: RunConfig, stage: int, runtime: Runtime,
                         options: MemoryOptions) -> tuple[StagePlan, DeviceMemory, str | None]:
    """Plan `stage` for this worker against the memory free on its device (its RAM for the CPU): the
    plan, that memory, and when the peak exceeds it one line naming the shortfall and what would
    shrink it (else None)."""
    from agora.pipeline.memory import GiB
    from agora.pipeline.runtime import device_memory

    plan = cached_plan_stage(config, stage, runtime, options)
    memory = device_memory(runtime.device, free=True)
    short = plan.shortfall(memory.free_bytes)
    where = f"{runtime.device} ({memory.name})" if memory.accelerator else "this machine's RAM"
    if not short:
        return plan, memory, None
    return plan, memory, (
        f"memory plan: stage {plan.index} ({plan.kind}) needs {plan.peak / GiB:.2f} GiB on {where} at its peak "
        f"({plan.working_job}, microbatch {options.microbatch} x {options.seq_len}, {runtime.dtype}), but "
        f"{memory.free_bytes / GiB:.2f} GiB are free: short by {short / GiB:.2f} GiB; try "
        f"{_remedies(plan, runtime, options)}, or see `agora-node plan`")


def check_stage_fits(config: RunConfig, stage: int, runtime: Runtime, options: MemoryOptions) -> StagePlan:
    """Plan `stage` for this worker; ConfigError naming the shortfall when its peak exceeds what is
    free on the device (its RAM for the CPU): `join` calls this before loading anything."""
    from agora.pipeline.memory import GiB

    plan, memory, problem = stage_memory_problem(config, stage, runtime, options)
    if problem is not None:
        raise ConfigError(f"{problem} (--no-memory-check skips this)")
    where = f"{runtime.device} ({memory.name})" if memory.accelerator else "this machine's RAM"
    logger.info("memory plan: stage %d (%s) needs %.2f GiB at its peak on %s, %.2f GiB free", plan.index, plan.kind,
                plan.peak / GiB, where, memory.free_bytes / GiB)
    return plan
