"""The settings of `agora-node authorizer`'s commands, beside what the authorizer admits
(`AuthorizerSettings`, auth/settings.py) and the run config it serves.

`AuthorityFolder` is the flag every action takes (`--state-dir`: the authorizer is its folder),
`AuthorizerServeOptions` what `serve` writes and hands out, `IssueOptions` the credential `issue`
mints. Sections of the settings schema (pipeline/schema.py): their flags are generated, and a bad
value is one line naming `authorizer.<field>` or `issue.<field>` before any key is read or
written. A ban's PEER_ID and --reason, and `list --json`, are the action's input, not settings.
Light (no torch, no grpc): the CLI builds its parser from it.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, StrictFloat, StrictInt, StrictStr
from pydantic.dataclasses import dataclass

from agora.auth.authority import DEFAULT_CREDENTIAL_LIFETIME_S
from agora.auth.credentials import ROLES
from agora.pipeline.schema import SECTION, setting

__all__ = ["AuthorityFolder", "AuthorizerServeOptions", "IssueOptions", "check_run_id"]

_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_run_id(text: str) -> str:
    """A run id names folders and DHT keys: a short word, nothing a path or a key could trip on."""
    if not _RUN_ID.fullmatch(text):
        raise ValueError("letters, digits, '_' and '-' only (1-64 characters)")
    return text


RunId = Annotated[StrictStr, AfterValidator(check_run_id)]


@dataclass(frozen=True, config=SECTION)
class AuthorityFolder:
    state_dir: StrictStr = setting(help="the authorizer's folder: CA keys, bans, admitted nodes", flag="--state-dir",
                                   min_length=1)


@dataclass(frozen=True, config=SECTION)
class AuthorizerServeOptions:
    run_id: RunId | None = setting(None, "run identifier (needed on first start)", flag="--run-id")
    ready_file: StrictStr | None = setting(None, "write the address and root fingerprint here once serving",
                                           flag="--ready-file", min_length=1)
    join_file: StrictStr | None = setting(None, "where to write the join file (default STATE_DIR/join.json)",
                                          flag="--join-file", min_length=1)
    initial_peers: tuple[StrictStr, ...] = setting(
        (), "DHT multiaddrs handed to admitted nodes; repeatable (default: none, and bans reach no DHT)",
        flag="--initial-peers", metavar="MADDR")


@dataclass(frozen=True, config=SECTION)
class IssueOptions:
    role: Literal[ROLES] = setting(help="the credential's role", flag="--role")
    out: StrictStr = setting(help="the node's state folder", flag="--out", min_length=1)
    stage: StrictInt | None = setting(None, "pipeline stage (workers only)", flag="--stage", ge=0)
    lifetime_s: StrictFloat = setting(DEFAULT_CREDENTIAL_LIFETIME_S, "seconds the credential is valid",
                                      flag="--lifetime", metavar="S", gt=0)
    run_id: RunId | None = setting(
        None, "create the run's CA in --state-dir if it has none yet (e.g. to credential a DHT bootstrap peer "
        "before `serve` is started with its address)", flag="--run-id")
