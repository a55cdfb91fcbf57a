"""`agora-node export --out DIR`: the whole model, gathered from the swarm, as a checkpoint and a
transformers export. Only an operator may run it: no contributor ever holds more than its stage.

Design choices:
- One member replica per stage, through the same state transfer a joiner uses (DownloadState,
  node/membership/state_download.py): the best announced donor first, the others if it is busy or
  fails, chunked and resumable, the SHA-256 checked, and the same checks of what it holds
  (node/membership/state_verify.py): finite, in range, and confirmed by another member's sketch
  where the stage has another member; a state refused there is never written, its donor reported,
  the next one tried. The bounds are the schema's defaults (`StateCheckOptions`): export's flags
  are its own parser's. A worker gives its state to an operator credential of its run
  (auth/grpc_policy.py, node/membership/state_transfer.py); under --insecure to anyone of the run.
- A stage with no member announcing itself fails the export in one line naming it (a replica
  still syncing has not got the stage's state), once the stages have been read again for
  `members_wait_s` (one read can miss a stage on a loaded swarm), and so does one whose members'
  states all fail their checks.
- `DIR/checkpoint` is a complete checkpoint of every stage (parameters, optimizer state, averaging
  state: pipeline/checkpoint.py), loadable by `train-local --resume`, `export-hf` and
  `join --serve-only --checkpoint`; its step is the lowest of the stages' (replicas of different
  stages are a few steps apart in an asynchronous run: each stage's own step, donor and the
  members whose sketch confirmed its state are in the checkpoint's `extra`). `DIR/hf` is the
  transformers export of the assembled model and the run's tokenizer (pipeline/interop.py), which
  also checks that the stages fit together (a strict load).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from pydantic import StrictFloat, StrictStr
from pydantic.dataclasses import dataclass as pydantic_dataclass

from agora.auth.node_state import NodeCredentials
from agora.node.admission import AdmissionOptions, add_admission_arguments, admit_node, config_chooser
from agora.node.run_flags import add_run_arguments, run_config
from agora.node.swarm_options import SwarmOptions, add_swarm_flags
from agora.pipeline.config import ConfigError, RunConfig
from agora.pipeline.option_flags import add_option_flags, options_from_args
from agora.pipeline.schema import SECTION, setting

if TYPE_CHECKING:  # hivemind and torch: imported by the export itself, not by `agora-node`'s parser
    from agora.dht.swarm import SwarmDHT
    from agora.pipeline.checkpoint import StageState

__all__ = ["ExportOptions", "ExportHfOptions", "run_export", "add_export_command", "cmd_export",
           "add_export_hf_command"]

logger = logging.getLogger("agora.node.export")

_MEMBERS_RETRY_S = 1.0  # between reads of the stages' members while one has none (`members_wait_s`)


@pydantic_dataclass(frozen=True, config=SECTION)
class ExportOptions:
    """`export`'s settings (a section of the settings schema); the run and its peers are the ones
    admission settles on."""

    out: StrictStr = setting(help="where DIR/checkpoint and DIR/hf are written", flag="--out", metavar="DIR",
                             min_length=1)
    run_id: StrictStr = setting(help="the run (--run-id, or the join file's)", min_length=1)
    initial_peers: tuple[StrictStr, ...] = setting((), "the swarm's DHT peers (--initial-peers, or the credential's)")
    timeout_s: StrictFloat = setting(480.0, "each stage's download, over every donor tried", flag="--timeout",
                                     metavar="S", gt=0)
    members_wait_s: StrictFloat = setting(30.0, "how long the DHT is read again for a stage no member was seen "
                                          "announcing, before the export fails naming it", gt=0)


@pydantic_dataclass(frozen=True, config=SECTION)
class ExportHfOptions:
    checkpoint: StrictStr = setting(help="checkpoint folder (or a folder with 'latest')", flag="--checkpoint",
                                    min_length=1)
    out: StrictStr = setting(help="output folder", flag="--out", min_length=1)


def run_export(config: RunConfig, options: ExportOptions, credentials: Optional[NodeCredentials]) -> int:
    """Blocking: gather every stage and write DIR/checkpoint and DIR/hf; 0, or ConfigError in one line."""
    from agora.dht.security import DHTSecurity
    from agora.dht.swarm import SwarmDHT
    from agora.node.rpc.server import run as run_loop

    # hivemind forks its DHT process: before the event loop and any gRPC channel exist.
    security = DHTSecurity.from_state_dir(credentials.directory) if credentials is not None else None
    swarm = SwarmDHT.start(initial_peers=options.initial_peers, client_mode=True, security=security)
    try:
        return run_loop(_export(config, options, swarm, credentials))
    finally:
        swarm.shutdown()


async def _export(config: RunConfig, options: ExportOptions, swarm: SwarmDHT,
                  credentials: Optional[NodeCredentials]) -> int:
    from agora.node.averaging.sparta import stage_parameter_numels
    from agora.node.rpc.tls import InsecureChannels, TlsChannels
    from agora.node.membership.state_download import DonorPlan, StateDownloader, StateDownloadError, plan_donors
    from agora.node.replica.epoch import DEFAULT_REPORT_AHEAD
    from agora.node.membership.state_transfer import state_bytes_bound
    from agora.pipeline.checkpoint import StageState
    from agora.pipeline.fingerprint import run_fingerprint

    started = time.monotonic()
    n_stages = len(config.layer_split)
    fingerprint = run_fingerprint(config)
    rng = random.Random()
    while True:
        by_stage = await swarm.all_workers_async(options.run_id, n_stages, fingerprint=fingerprint)
        plans = {stage: plan_donors(by_stage, stage, swarm.peer_id, rng, max_gap=DEFAULT_REPORT_AHEAD)
                 for stage in range(n_stages)}
        missing = [stage for stage in range(n_stages) if not plans[stage].donors and not plans[stage].outliers]
        if not missing:
            break
        # A fresh node's first reads open every connection they use, and on a loaded swarm one may miss a
        # stage whose members are there (a member between heartbeats, a holder slow to answer): read again.
        if time.monotonic() - started >= options.members_wait_s:
            raise ConfigError(f"stage {', '.join(map(str, missing))} of run {options.run_id!r}: no member replica "
                              f"announces itself in the DHT after {options.members_wait_s:g} s (is the swarm up, and "
                              "are --initial-peers and --run-id its own?)")
        logger.info("export: no member of stage %s seen yet; reading again", ", ".join(map(str, missing)))
        await asyncio.sleep(_MEMBERS_RETRY_S)
    channels = TlsChannels(credentials) if credentials is not None else InsecureChannels()
    states, sources = [], {}

    async def members_now(stage: int) -> DonorPlan:
        """The stage's members as the DHT has them now: the stages are downloaded one after another,
        and a member may leave or move meanwhile."""
        by_stage = await swarm.all_workers_async(options.run_id, n_stages, fingerprint=fingerprint)
        return plan_donors(by_stage, stage, swarm.peer_id, rng, max_gap=DEFAULT_REPORT_AHEAD)

    for stage in range(n_stages):
        downloader = StateDownloader(run_id=options.run_id, stage=stage, fingerprint=fingerprint, channels=channels,
                                     max_bytes=state_bytes_bound(stage_parameter_numels(config.model, stage)),
                                     checks=_state_checks(config, stage), timeout_s=options.timeout_s,
                                     label="export")
        try:
            result = await downloader.download(plans[stage], replan=functools.partial(members_now, stage))
        except StateDownloadError as error:
            raise ConfigError(f"export: {error}") from None
        tree = result.tree
        if not isinstance(tree, dict) or tree.get("stage") != stage or not isinstance(tree.get("model"), dict):
            raise ConfigError(f"export: the donor of stage {stage} ({result.donor.endpoint}) sent another stage's "
                              "state")
        states.append(StageState(stage, tree["model"], tree.get("optimizer"), tree.get("averaging")))
        confirmed_by = list(result.check.confirmed_by)
        sources[str(stage)] = {"peer": result.donor.peer_id, "endpoint": result.donor.endpoint, "step": result.step,
                               "bytes": result.total_bytes, "confirmed_by": confirmed_by}
        logger.info("export: stage %d at step %d from %s (%d bytes; %s)", stage, result.step, result.donor.endpoint,
                    result.total_bytes, f"confirmed by {', '.join(confirmed_by)}" if confirmed_by
                    else "the stage's only member: checked alone")
    return _write(config, options, states, sources, time.monotonic() - started)


def _state_checks(config: RunConfig, stage: int):
    """What a stage's state must pass before it is written (node/membership/state_verify.py): the
    schema's default bounds; the scale reference without a second member is the run's
    initialisation of the stage, which every replica started from."""
    from agora.node.membership.check_options import StateCheckOptions
    from agora.node.membership.state_check import norms_of
    from agora.node.membership.state_verify import StateChecks
    from agora.pipeline.stages import build_stage

    async def initialisation():
        return await asyncio.to_thread(lambda: norms_of(build_stage(config.model, stage).state_dict()))

    return StateChecks.for_run(StateCheckOptions(), config.optim, initialisation)


def _write(config: RunConfig, options: ExportOptions, states: list[StageState], sources: dict, seconds: float) -> int:
    from agora.pipeline.checkpoint import save_checkpoint
    from agora.pipeline.interop import save_pretrained, save_tokenizer
    from agora.pipeline.stages import assemble_model

    try:
        model = assemble_model(config.model, [state.model for state in states])  # a strict load: they fit together
    except (RuntimeError, ValueError) as error:
        raise ConfigError(f"export: the stages' states do not make one model of this run's config: {error}") from None
    out = Path(options.out)
    step = min(source["step"] for source in sources.values())
    checkpoint = save_checkpoint(out / "checkpoint", step, config, states,
                                 extra={"exported_from": sources, "run_id": options.run_id})
    hf = save_pretrained(model, out / "hf")
    try:
        save_tokenizer(config.data.tokenizer, hf)
    except ConfigError as error:  # the weights are worth keeping: the tokenizer file can be copied in later
        logger.warning("export: %s has no tokenizer: %s", hf, error)
    steps = ", ".join(f"stage {stage} step {source['step']}" for stage, source in sources.items())
    print(f"export: {len(states)} stages ({steps}) in {seconds:.1f} s -> {checkpoint} and {hf}")
    return 0


def add_export_command(commands) -> None:
    """Mount `agora-node export`."""
    export = commands.add_parser(
        "export", help="the whole model from the swarm, as a checkpoint and a transformers export (operator)",
        description="Download one member replica of every stage (an operator credential: `agora-node authorizer "
                    "issue --role operator`) and write DIR/checkpoint (every stage, optimizer and averaging state "
                    "included) and DIR/hf (`AutoModelForCausalLM.from_pretrained(DIR/hf)` loads it).")
    add_run_arguments(export, steps_help="planned run length (only for the run fingerprint)")
    add_option_flags(export.add_argument_group("export", "where it writes, how long a stage may take"), ExportOptions)
    add_swarm_flags(export)
    add_admission_arguments(export)
    export.set_defaults(handler=cmd_export)


def cmd_export(args) -> int:
    swarm = options_from_args(SwarmOptions, args, "swarm")
    options = options_from_args(ExportOptions, args, "export", run_id=swarm.run_id)
    admission_options = options_from_args(AdmissionOptions, args, "admission")
    admission = admit_node(admission_options, role="operator", run_id=swarm.run_id, stage=None,
                           config_for=config_chooser(args, run_config), initial_peers=swarm.initial_peers)
    if not admission.initial_peers:
        raise ConfigError("--initial-peers: the swarm's DHT peers are needed (the operator credential names none)")
    options = replace(options, run_id=admission.run_id, initial_peers=admission.initial_peers)
    return run_export(admission.config, options, admission.credentials)


def add_export_hf_command(commands) -> None:
    export = commands.add_parser("export-hf", help="write a transformers checkpoint (config.json + safetensors + "
                                 "the run's tokenizer)",
                                 description="Assemble every stage of a checkpoint into one model and save it so "
                                             "AutoModelForCausalLM.from_pretrained loads it.")
    add_option_flags(export, ExportHfOptions)
    export.set_defaults(handler=_cmd_export_hf)


def _cmd_export_hf(args: argparse.Namespace) -> int:
    from agora.pipeline.checkpoint import load_checkpoint
    from agora.pipeline.interop import save_pretrained, save_tokenizer
    from agora.pipeline.stages import assemble_model

    options = options_from_args(ExportHfOptions, args, "export_hf")
    step, config, states, _ = load_checkpoint(options.checkpoint)
    if sorted(s.index for s in states) != list(range(len(config.layer_split))):
        raise ConfigError(f"--checkpoint: {options.checkpoint} does not hold every stage "
                          f"(has {[s.index for s in states]})")
    model = assemble_model(config.model, [s.model for s in states])
    save_pretrained(model, options.out)
    try:
        save_tokenizer(config.data.tokenizer, options.out)
    except ConfigError as error:  # the weights are worth keeping: the tokenizer file can be copied in later
        print(f"export-hf: no tokenizer written: {error}")
    print(f"export-hf: step {step} -> {options.out}")
    return 0
