"""`SwarmOptions`: the run a node takes part in and the DHT peers it joins it through.

Every peer of a swarm takes these two flags (`join`, `trainer`, `monitor`, `export`, `generate`,
`serve`), so they are declared once, as a section of the settings schema (pipeline/schema.py).
They are what the user asks for: admission may answer with others (the join file names the run,
the authorizer hands out peers), so a role's own options carry the values admission settled on,
not these. Light (no torch): the CLI builds its parser from it.
"""

from __future__ import annotations

from pydantic import StrictStr
from pydantic.dataclasses import dataclass

from agora.pipeline.option_flags import add_option_flags
from agora.pipeline.schema import SECTION, setting

__all__ = ["SwarmOptions", "add_swarm_flags"]


@dataclass(frozen=True, config=SECTION)
class SwarmOptions:
    run_id: StrictStr = setting("agora", "run identifier shared by every peer of the run", flag="--run-id",
                                min_length=1)
    initial_peers: tuple[StrictStr, ...] = setting(
        (), "DHT multiaddrs to join through, printed by `agora-node bootstrap`; repeatable (default: those the "
        "authorizer hands out, else none: a new swarm)", flag="--initial-peers", metavar="MADDR")


def add_swarm_flags(parser) -> None:
    """`--run-id` and `--initial-peers`, in a group of their own in `--help`."""
    add_option_flags(parser.add_argument_group("swarm", "the run and the peers to join it through"), SwarmOptions)
