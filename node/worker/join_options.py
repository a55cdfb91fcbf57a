"""`JoinOptions`: how the `join` daemon around a worker runs, beside how the worker serves
(`WorkerOptions`, node/worker/options.py) and the run's config.

Its DHT peer (where it listens, how often it announces), its checkpoints (folder, interval, the
step to resume), the files it writes (ready, averaging counters), whether it goes through the sync
phases and rebalancing, and the checks before it starts. A section of the settings schema
(pipeline/schema.py): the fields with a flag are `join`'s options, and a bad value is one line
naming `join.<field>` and the value. The others are settled after admission (the stage the
authorizer assigns, the run and peers it names, the authorizer to renew with) or by code (the
download's deadline). Light (no torch): the CLI builds its flags from it.
"""

from __future__ import annotations

from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr
from pydantic.dataclasses import dataclass

from agora.dht.key_families import MAX_HEARTBEAT_S
from agora.pipeline.schema import SECTION, setting

__all__ = ["JoinOptions"]


@dataclass(frozen=True, config=SECTION)
class JoinOptions:
    run_id: StrictStr = setting(help="the run's identifier (--run-id, or the join file's)", min_length=1)
    stage: StrictInt | None = setting(
        None, "pipeline stage index to host (default: the authorizer assigns the stage least covered by announced "
        "throughput; required with --insecure)", flag="--stage", metavar="STAGE", ge=0)
    initial_peers: tuple[StrictStr, ...] = setting((), "DHT multiaddrs it joins through (--initial-peers, or the "
                                                       "authorizer's)")
    dht_host: StrictStr = setting("127.0.0.1", "address the DHT peer listens on", flag="--dht-host", min_length=1)
    dht_port: StrictInt = setting(0, "DHT port (0: pick a free one)", flag="--dht-port", ge=0, lt=65536)
    heartbeat_s: StrictFloat = setting(
        5.0, f"seconds between DHT announces (at most {MAX_HEARTBEAT_S:g}: peers refuse announces meant to outlive "
        "a few of the longest beats)", flag="--heartbeat", metavar="S", gt=0, le=MAX_HEARTBEAT_S)
    memory_check: StrictBool = setting(
        True, "start even when the memory plan (agora-node plan) says the stage does not fit",
        flag="--no-memory-check")
    ready_file: StrictStr | None = setting(None, "write the gRPC endpoint and peer id here once serving",
                                           flag="--ready-file")
    checkpoint_dir: StrictStr | None = setting(
        None, "resume from and checkpoint into this folder (default: checkpoints/ in --state-dir; none under "
        "--insecure)", flag="--checkpoint-dir")
    checkpoint_every: StrictInt | None = setting(
        None, "optimizer steps between checkpoints (default: the config's train.checkpoint_every; 0: only when "
        "leaving)", flag="--checkpoint-every", metavar="STEPS", ge=0)
    resume_step: StrictInt | None = setting(
        None, "resume from this step's checkpoint in --checkpoint-dir (default: the newest complete one)",
        flag="--resume-step", metavar="STEP", ge=0)
    stats_file: StrictStr | None = setting(None, "write the averaging counters here (JSON) on exit",
                                           flag="--stats-file")
    authorizer: StrictStr | None = setting(None, "HOST:PORT to renew the credential with (None: no renewal)")
    serve_checkpoint: StrictStr | None = setting(
        None, "with --serve-only: the checkpoint whose weights this stage serves (also the run config unless "
        "--config)", flag="--checkpoint", metavar="C")
    sync_phases: StrictBool = setting(
        True, "join as a member at once, without downloading the stage's state (only when this replica's state is "
        "known to be the stage's)", flag="--no-sync-phases")
    state_download_s: StrictFloat = setting(480.0, "the whole weight-sync download, over every donor tried", gt=0)
    rebalance: StrictBool = setting(
        True, "stay on this stage even when it is over-covered (by announced throughput) and another is short of "
        "replicas (default: move there, through weight sync)", flag="--no-rebalance")
    rebalance_s: StrictFloat | None = setting(
        None, "seconds between two readings of the stages for rebalancing; a move needs two readings in a row that "
        "agree (default: 6 heartbeats)", flag="--rebalance-every", metavar="S", gt=0)

    def checkpoint_interval(self, configured: int) -> int:
        """Optimizer steps between periodic checkpoints: `checkpoint_every`, else the run config's."""
        return configured if self.checkpoint_every is None else self.checkpoint_every
