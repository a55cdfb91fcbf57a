"""`agora-node doctor`: before queueing to join a run, whether this machine would be admitted and
useful (the verdicts are node/doctor.py's).

    agora-node doctor --join-file F [--stage I] [--json] [join's run and worker flags]

checks, one line each: the authorizer and the run's description (GetRun); the round-trip time,
upload and download rates, accelerator memory and RAM against the run's floors, measured by the
authorizer as for a Join; whether the authorizer can dial this node back on the address it would
announce; this clock against the authorizer's; the memory plan of the stage it would host (the
one asked for with --stage, else the one the authorizer would assign now, else every stage) against
the memory free on its device and host; the round trips to a few of that stage's current members
(and, with the probe credential the dry run issues, the upload and download rates to each:
node/doctor_links.py) and the share of its microbatches this machine would take
(node/doctor_stage.py); every stage's
capacity and the pipeline's bottleneck, with this machine on that stage (node/doctor_pipeline.py);
free disk for checkpoints; the versions it runs. Exit code 0 when no check failed (a WARN does not fail), 1
otherwise, 2 for a usage or config mistake.

Design choices:

- It takes join's flags (the run flags, the worker's, --checkpoint-dir, admission's), so what it
  checks is what `join` with the same command line would do: the same announced address, the
  same config and so the same run fingerprint, the same memory plan.
- The authorizer's part is one dry run of a Join (auth/join_check.py, the CheckJoin RPC): the
  same preflight and floor comparison as admission, the dial-back included, and nobody is
  admitted, no slot or queue place is taken, the state directory is not touched. What it issues
  is a two-minute probe credential for the dry run's key, which the members' link probes take
  (and nothing else does), so the member lines come right after it.
- The memory plan and the checkpoint size come from node/plan.py (its cache included); a
  checkpoint holds the stage's weights, buffers and optimizer state, and the folder holds the
  newest ``keep`` of them (pipeline/checkpoint.py) and the one being written.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import inspect
import json
import shutil
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from agora.node.admission import add_admission_arguments
from agora.node.doctor import (FAIL, Check, authorizer_check, as_json, clock_check, disk_check, exit_code,
                               floor_checks, format_line, memory_check, reachability_check, refused_check, unknown,
                               version_check)
from pydantic import StrictInt, StrictStr
from pydantic.dataclasses import dataclass

from agora.node.run_flags import add_run_arguments
from agora.node.worker.join_options import JoinOptions
from agora.pipeline.config import ConfigError, RunConfig
from agora.pipeline.option_flags import add_option_flags
from agora.pipeline.schema import SECTION, like

if TYPE_CHECKING:
    from agora.auth.join_check import JoinCheckResult
    from agora.protos.authorizer_adapter import JoinCheck

__all__ = ["DoctorOptions", "add_doctor_command"]

_AUTHORIZER_CHECKS = ("rtt", "upload", "download", "accelerator", "ram", "reachability", "clock")


@dataclass(frozen=True, config=SECTION)
class DoctorOptions:
    """Which stage the doctor checks and where its checkpoints would go: `join`'s declarations."""

    stage: StrictInt | None = like(JoinOptions, "stage", description=(
        "the stage to check (default: the one the authorizer would assign now, else every stage)"))
    checkpoint_dir: StrictStr | None = like(JoinOptions, "checkpoint_dir", description=(
        "where checkpoints would go (default: checkpoints/ in the --state-dir join would use)"))


def add_doctor_command(commands) -> None:
    from agora.node.worker.options import WorkerOptions

    doctor = commands.add_parser(
        "doctor", help="before joining: would this machine be admitted to the run, and useful in it?",
        description="Check, without joining, what admission checks (the authorizer, the link floors, the "
                    "dial-back, the clock) and what the stage needs here (memory, disk, versions); one line "
                    "per check. Exit 0 when none failed, 1 otherwise, 2 for a usage or config mistake.")
    add_run_arguments(doctor, steps_help="as for join", computes=True)
    add_option_flags(doctor.add_argument_group("worker", "as for join: where it listens and announces, what it "
                                                         "keeps (the memory plan)"), WorkerOptions,
                     skip=("--otlp-endpoint", "--trace-sample"))  # it serves no calls to trace
    add_option_flags(doctor.add_argument_group("doctor", "what it checks"), DoctorOptions)
    doctor.add_argument("--json", action="store_true", help="print one JSON object with every check")
    add_admission_arguments(doctor)
    doctor.set_defaults(handler=_cmd_doctor)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from agora.auth.admission import hardware_report
    from agora.node.admission import AdmissionOptions, config_chooser, free_port
    from agora.node.rpc.server import announced_host
    from agora.node.run_flags import check_runtime_flags, explicit_settings, run_config
    from agora.node.worker.options import WorkerOptions
    from agora.pipeline.option_flags import options_from_args
    from agora.pipeline.runtime import resolve_device

    options = options_from_args(AdmissionOptions, args, "admission").resolved()
    if options.authorizer is None:
        raise ConfigError("--join-file: doctor checks admission to a run: give the run's join file (or --authorizer "
                          "and --ca-fingerprint)")
    check_runtime_flags(args)
    worker = options_from_args(WorkerOptions, args, "worker")
    asked = options_from_args(DoctorOptions, args, "doctor")
    port = worker.port or free_port(worker.host)
    try:
        announce = (announced_host(worker.host, worker.announce_host), port)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    hardware = hardware_report(resolve_device(explicit_settings(args).get("runtime.device") or "auto"))
    config_for = config_chooser(args, run_config)
    checks, config, run_id, result = asyncio.run(_authorizer_checks(
        options, config_for, hardware=hardware, announce=announce, listen_host=worker.host, stage=asked.stage))
    verdict = result.check if result is not None else None
    stages = _stages(config, asked.stage, verdict.stage if verdict is not None else None)
    stage_assigned = (verdict is not None and verdict.refused is None and verdict.stage is not None
                      and config is not None and 0 <= verdict.stage < len(config.model.layer_split))
    if stage_assigned:
        checks += asyncio.run(_member_links(result, config))
    machine = _machine_checks(config, stages, worker, asked.checkpoint_dir, run_id)
    checks += machine[:-1] + (_stage_checks(config, verdict) if stage_assigned else []) + machine[-1:]  # versions last
    print(as_json(checks) if args.json else "\n".join(format_line(check) for check in checks))
    sys.stdout.flush()
    return exit_code(checks)


async def _authorizer_checks(options, config_for: Callable[[dict], RunConfig], *, hardware, announce: tuple[str, int],
                             listen_host: str, stage: Optional[int]
                             ) -> tuple[list[Check], Optional[RunConfig], Optional[str], Optional[JoinCheckResult]]:
    """The checks the authorizer answers, the config join would run (the served one with the run flags
    on top: ConfigError for flags that do not apply), the run id and the dry run (its verdict: the
    stage it would assign, a sample of that stage's members, a probe credential for them)."""
    from agora.auth.admission import AdmissionError, AuthorizerUntrusted
    from agora.auth.join_check import check_join, describe_run
    from agora.auth.policy import Floors, LinkMeasurement, floor_verdicts
    from agora.pipeline.fingerprint import run_fingerprint

    address = options.authorizer
    try:
        run = await describe_run(address, options.root_fingerprint)
    except AdmissionError as error:
        untrusted = isinstance(error, AuthorizerUntrusted)
        return [authorizer_check(address, None, str(error), untrusted=untrusted)] + [
            unknown(name, "the authorizer did not answer") for name in _AUTHORIZER_CHECKS], None, None, None
    config = config_for(json.loads(run.config_json))
    fingerprint = run_fingerprint(config).text()
    checks = [authorizer_check(address, run.run_id, None)]
    shown = f"{announce[0]}:{announce[1]}"
    try:
        result = await check_join(address, options.root_fingerprint, announce=announce, listen_host=listen_host,
                                  stage=stage, hardware=hardware,
                                  fingerprint=lambda served: fingerprint)
    except AdmissionError as error:
        checks.append(Check("dry run", FAIL, shown, detail=str(error),
                            fix="as the line says: a --port in use here, the authorizer's rate limits (try again "
                                "in a minute), or its refusal"))
        return checks + [unknown(name, "the dry run did not complete") for name in _AUTHORIZER_CHECKS], \
            config, run.run_id, None
    verdict = result.check
    if verdict.refused is not None:
        checks.append(refused_check(verdict.refused.field, verdict.refused.reason))
        checks += [unknown(name, "a Join would be refused before this check") for name in _AUTHORIZER_CHECKS[:-1]]
    else:
        link = LinkMeasurement(verdict.rtt_ms, verdict.download_mbit, verdict.upload_mbit)
        checks += floor_checks(floor_verdicts(Floors(**asdict(verdict.floors)), hardware, link))
        checks.append(reachability_check(shown, verdict.unreachable))
    checks.append(clock_check(result.skew_s, verdict.tolerated_skew_s))
    return checks, config, run.run_id, result


async def _member_links(result: JoinCheckResult, config: RunConfig) -> list[Check]:
    """The round trips to the members of the assigned stage the authorizer showed, and with its probe
    credential, the rates each way to each."""
    from agora.auth.join_check import MEMBERS_SHOWN
    from agora.auth.keys import private_key_pem
    from agora.node.doctor_links import probe_members
    from agora.node.doctor_probes import time_member_links
    from agora.node.doctor_stage import member_link_checks
    from agora.pipeline.fingerprint import run_fingerprint

    verdict = result.check
    members = verdict.members[:MEMBERS_SHOWN]
    links = await time_member_links([member.address for member in members])
    if verdict.probe_credential_pem and result.key is not None:
        probes = await probe_members(members, stage=verdict.stage, credential_pem=verdict.probe_credential_pem,
                                     key_pem=private_key_pem(result.key), root_pem=result.root_pem,
                                     fingerprint=run_fingerprint(config).text())
        links = [replace(link, probe=probe) for link, probe in zip(links, probes)]
    floors = verdict.floors
    return member_link_checks(verdict.stage, links, floors.max_rtt_ms, min_upload_mbit=floors.min_upload_mbit,
                              min_download_mbit=floors.min_download_mbit)


def _stage_checks(config: RunConfig, verdict: JoinCheck) -> list[Check]:
    """The share of the assigned stage this machine would take, from its compute timed here, then every
    stage's capacity and the pipeline's bottleneck with this machine on its stage."""
    from agora.node.doctor_pipeline import pipeline_checks
    from agora.node.doctor_probes import stage_samples_per_s
    from agora.node.doctor_stage import predicted_share, share_check
    from agora.pipeline.runtime import Runtime

    stage, train = verdict.stage, config.train
    members = verdict.member_samples_per_s
    try:
        own = stage_samples_per_s(config, stage, Runtime.from_config(config.runtime))
    except RuntimeError as error:  # out of memory, a device that cannot run it: the memory line says more
        own = share = None
        shares = unknown(f"share stage {stage}", f"this machine could not run the stage to time it: "
                                                 f"{str(error).splitlines()[0]}")
    else:
        share = predicted_share(own, members, train.microbatches, train.microbatch_size)
        shares = share_check(stage, own, members, train.microbatches, train.microbatch_size, share=share)
    return [shares, *pipeline_checks(stage, verdict.stage_capacities, len(config.model.layer_split),
                                     train.microbatch_size, own_samples_per_s=own, share=share)]


def _stages(config: Optional[RunConfig], asked: Optional[int], assigned: Optional[int]) -> list[int]:
    if config is None:
        return []
    if asked is not None:
        return [asked]
    return [assigned] if assigned is not None else list(range(len(config.model.layer_split)))


def _machine_checks(config: Optional[RunConfig], stages: list[int], worker, checkpoint_dir: Optional[str],
                    run_id: Optional[str]) -> list[Check]:
    """Memory per stage, disk, versions: what this machine brings to the stage."""
    import torch

    from agora.node.plan import stage_memory_problem, worker_memory_options
    from agora.pipeline.runtime import Runtime, device_memory

    running = {"agora-node": importlib.metadata.version("agora-node"), "torch": torch.__version__,
               "protocol": _protocol()}
    if config is None:
        return [unknown("memory", "no run config: the authorizer did not describe the run"),
                unknown("disk", "no run config: the authorizer did not describe the run"),
                version_check(running, {})]
    if any(not 0 <= stage < len(config.model.layer_split) for stage in stages):
        return [unknown("memory", f"--stage: the run has stages 0-{len(config.model.layer_split) - 1}"),
                unknown("disk", "no stage to size a checkpoint of"), version_check(running, {})]
    runtime = Runtime.from_config(config.runtime)
    options = worker_memory_options(config, rows=worker.max_rows, pinned_versions=worker.pinned_weights,
                                    in_flight=worker.stash_capacity, inference=worker.inference)
    host_free = device_memory(torch.device("cpu"), free=True).free_bytes
    checks, checkpoint_bytes = [], 0
    for stage in stages:
        plan, memory, problem = stage_memory_problem(config, stage, runtime, options)
        where = f"{runtime.device} ({memory.name})" if memory.accelerator else "this machine's RAM"
        checks.append(memory_check(stage, plan.kind, plan.peak, memory.free_bytes, where, host_bytes=plan.host,
                                   host_free_bytes=host_free if memory.accelerator else None, problem=problem))
        checkpoint_bytes = max(checkpoint_bytes, plan.parameters + plan.fixed + plan.optimizer)
    checks.append(_disk(checkpoint_dir, run_id, stages, checkpoint_bytes))
    checks.append(version_check(running, {}))
    return checks


def _disk(checkpoint_dir: Optional[str], run_id: Optional[str], stages: list[int], checkpoint_bytes: int) -> Check:
    from agora.node.admission import default_state_dir
    from agora.pipeline.checkpoint import save_checkpoint

    folder = Path(checkpoint_dir) if checkpoint_dir else \
        default_state_dir(run_id or "agora", "worker", stages[0] if len(stages) == 1 else None) / "checkpoints"
    existing = next((path for path in (folder, *folder.parents) if path.exists()), Path("/"))
    copies = inspect.signature(save_checkpoint).parameters["keep"].default + 1  # the kept ones and the next
    return disk_check(str(folder), shutil.disk_usage(existing).free, copies * checkpoint_bytes, copies)


def _protocol() -> str:
    from agora.protos.authorizer_adapter import SERVICE_NAME

    return SERVICE_NAME.rpartition(".")[0]
