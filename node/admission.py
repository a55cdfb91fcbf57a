"""How a node's command line gets it into a run: admitted through an authorizer, with a credential
minted for it offline, or explicitly `--insecure`.

Every role that is admitted (`join`, `trainer`, `monitor`, `export`, `generate`, `serve`, `doctor`)
takes the same flags, the fields of `AdmissionOptions` (a section of the settings schema):

    --join-file F                       the authorizer's address and root fingerprint, as written by
                                        `agora-node authorizer serve` (or the two flags below)
    --authorizer HOST:PORT --ca-fingerprint SHA256
    --state-dir D                       the node's key and credential (default: a folder per run and
                                        role under ~/.local/state/agora-node)
    --insecure                          no admission, no TLS, no signed records (a warning says so)

Design choices:

- Admission runs before anything else starts (the DHT needs the credential to join, the gRPC
  server needs it to serve), in a short event loop of its own; everything it learned is in the
  state directory afterwards, which is what the DHT process, the gRPC server and the renewer read.
- The run config comes from the authorizer unless the user gives `--config`: a contributor
  needs only the join file. Either way the node's fingerprint is computed here, from the config
  it will actually run, and the authorizer refuses a mismatch naming the field.
- With an authorizer, a node is admitted on every start (a restarted node keeps its key, so its
  peer id, and passes the same checks again; a banned one is refused). Without one, a state
  directory holding a valid credential for the role (and stage) is used as is: a credential
  minted with `agora-node authorizer issue` for an operator's own machine. A running node renews
  at half life through its `CredentialRenewer` when it knows its authorizer.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Callable, Optional

from pydantic import AfterValidator, StrictBool, StrictStr, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from agora.pipeline.config import ConfigError, RunConfig
from agora.pipeline.files import hold_folder
from agora.pipeline.option_flags import add_option_flags
from agora.pipeline.schema import SECTION, checked, setting

__all__ = ["AdmissionOptions", "Admission", "add_admission_arguments", "admit_node", "default_state_dir", "free_port",
           "starting_dht_security"]

logger = logging.getLogger("agora.node.admission")


def _sha256_hex(text: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", text.lower()):
        raise ValueError("expected the 64 hex digits of a SHA-256")
    return text.lower()


@pydantic_dataclass(frozen=True, config=SECTION)
class AdmissionOptions:
    """How this node gets into its run: a section of the settings schema (pipeline/schema.py), the
    same flags for every role; a bad value is one line naming `admission.<field>`."""

    join_file: StrictStr | None = setting(
        None, "the run's join file (authorizer address and CA fingerprint), from `authorizer serve`",
        flag="--join-file", metavar="F", min_length=1)
    authorizer: StrictStr | None = setting(None, "the run's authorizer", flag="--authorizer", metavar="HOST:PORT",
                                           min_length=1)
    root_fingerprint: Annotated[StrictStr, AfterValidator(_sha256_hex)] | None = setting(
        None, "SHA-256 of the run's root CA certificate, as the operator published it", flag="--ca-fingerprint",
        metavar="SHA256")
    state_dir: StrictStr | None = setting(
        None, "this node's key and credential (default: ~/.local/state/agora-node/<run>/<role>)", flag="--state-dir",
        metavar="D", min_length=1)
    insecure: StrictBool = setting(False, "run without admission: no TLS, no credential checks, no signed DHT "
                                          "records", flag="--insecure")
    run_id: StrictStr | None = setting(None, "the join file's run: names the default state directory")

    @model_validator(mode="after")
    def _one_way_in(self) -> "AdmissionOptions":
        if self.insecure and (self.authorizer or self.join_file or self.root_fingerprint):
            raise ValueError("insecure: runs without an authorizer; drop --authorizer/--ca-fingerprint/--join-file")
        if not self.join_file and bool(self.authorizer) != bool(self.root_fingerprint):
            raise ValueError("authorizer: --authorizer and --ca-fingerprint go together (or give --join-file)")
        return self

    def resolved(self) -> "AdmissionOptions":
        """The authorizer and fingerprint from the join file when given (the flags win)."""
        if self.insecure or not self.join_file:
            return self
        from agora.auth.admission import JoinFile

        try:
            join = JoinFile.read(self.join_file)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return checked(AdmissionOptions, "admission", **{
            **asdict(self), "authorizer": self.authorizer or join.authorizer,
            "root_fingerprint": self.root_fingerprint or join.root_fingerprint, "run_id": join.run_id})


def add_admission_arguments(parser: argparse.ArgumentParser) -> None:
    add_option_flags(parser.add_argument_group("admission (an authorizer admits this node; see `agora-node "
                                               "authorizer`)"), AdmissionOptions)


@dataclass(frozen=True)
class Admission:
    """The outcome: the node's credentials (None under --insecure), the config to run, the authorizer
    to renew with (None for an offline credential), and the DHT peers to join through."""

    credentials: object  # NodeCredentials | None (imported lazily: the CLI stays light)
    config: RunConfig
    authorizer: Optional[str]
    initial_peers: tuple[str, ...]
    run_id: str
    stage: Optional[int] = None  # a worker's stage: asked for, or assigned by the authorizer
    state_lock: object = None  # the --state-dir held for this process (pipeline/files.hold_folder)


def default_state_dir(run_id: str, role: str, stage: Optional[int]) -> Path:
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "agora-node"
    return base / run_id / (role if stage is None else f"{role}-s{stage}")


def free_port(host: str) -> int:
    """A port free on ``host`` now: the dial-back listener and then the gRPC server take it in turn."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def admit_node(options: AdmissionOptions, *, role: str, run_id: str, stage: Optional[int],
               config_for: Callable[[Optional[dict]], RunConfig], initial_peers: tuple[str, ...],
               announce: Optional[tuple[str, int]] = None, listen_host: Optional[str] = None,
               device: Optional[str] = None) -> Admission:
    """Admit this node (blocking); ``config_for(run_config_dict_or_None)`` builds the config to run
    from the authorizer's (None when there is none). ``device`` (a --device value): the accelerator
    whose memory the hardware report names. Raises ConfigError with one readable line."""
    options = options.resolved()
    if options.insecure:
        print(f"agora-node {role}: WARNING: --insecure: no admission, no TLS, no credential checks; anyone who "
              "reaches this node's ports can use or poison it", file=sys.stderr)
        if role == "worker" and stage is None:
            raise ConfigError("--stage: a worker run --insecure must say which stage it hosts")
        return Admission(None, config_for(None), None, initial_peers, run_id, stage)
    from agora.auth.admission import AdmissionError, admit
    from agora.auth.credentials import CredentialError
    from agora.auth.node_state import NodeCredentials
    from agora.pipeline.fingerprint import run_fingerprint

    state_dir = (Path(options.state_dir) if options.state_dir
                 else default_state_dir(options.run_id or run_id, role, stage))
    held = hold_folder(state_dir, "--state-dir")  # one daemon per identity: held until this process ends
    node = NodeCredentials(state_dir, clock=time.time)
    if options.authorizer is None:
        if not node.has_credential():
            raise ConfigError(f"--state-dir {state_dir}: no credential; give --join-file (or --authorizer and "
                              "--ca-fingerprint), or run --insecure")
        try:
            identity = node.identity()
        except CredentialError as error:
            raise ConfigError(f"--state-dir {state_dir}: {error}") from None
        run = node.run_info()
        if identity.role != role or (stage is not None and identity.stage != stage):
            raise ConfigError(f"--state-dir {state_dir}: holds a {identity.describe()} credential, not a {role}"
                              + ("" if stage is None else f" of stage {stage}"))
        config = config_for(run.config)
        return Admission(node, config, run.authorizer or None, initial_peers or run.initial_peers, run.run_id,
                         identity.stage, held)

    def fingerprint(run_config: dict) -> str:
        return run_fingerprint(config_for(run_config)).text()

    def queued(position: int) -> None:
        print(f"agora-node {role}: the run is full; waiting in the authorizer's queue at position {position}",
              file=sys.stderr, flush=True)

    from agora.auth.admission import hardware_report
    from agora.pipeline.runtime import resolve_device

    hardware = hardware_report(resolve_device(device or "auto"))

    async def run_admission():
        return await admit(options.authorizer, options.root_fingerprint, node, role=role, fingerprint=fingerprint,
                           hardware=hardware, stage=stage, announce=announce, listen_host=listen_host,
                           on_queued=queued)

    try:
        run = asyncio.run(run_admission())
    except AdmissionError as error:
        raise ConfigError(str(error)) from None
    config = config_for(run.config)
    logger.info("admitted to run %r as %s", run.run_id, node.identity().describe())
    return Admission(node, config, options.authorizer, initial_peers or run.initial_peers, run.run_id, run.stage,
                     held)


def starting_dht_security(authorizer: Optional[str], credentials):
    """The security a node's DHT peer starts with (None: insecure), its credential renewed first if past
    half its life: the renewer starts only once the node serves, and a slow start outlives a short
    credential (auth/admission.py, `renew_if_past_half_life`). Blocking, as a node's start is."""
    if credentials is None:
        return None
    from agora.auth.admission import renew_if_past_half_life  # the DHT's modules load only where one starts
    from agora.dht.security import DHTSecurity

    renew_if_past_half_life(authorizer, credentials)
    return DHTSecurity.from_state_dir(credentials.directory)


def config_chooser(args: argparse.Namespace, run_config: Callable[..., RunConfig]) -> Callable[[Optional[dict]], RunConfig]:
    """The config a node runs: the user's `--config` (with the run flags) when given, else the
    authorizer's with the user's run flags on top, else the default preset."""
    def choose(served: Optional[dict]) -> RunConfig:
        if args.config is not None or served is None:
            return run_config(args)
        from agora.pipeline.config import config_from_dict

        return run_config(args, base=config_from_dict(served))
    return choose
