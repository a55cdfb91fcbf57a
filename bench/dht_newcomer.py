"""The newcomer of bench/dht_scale.py: one more worker joining a swarm under traffic, timed through
the coordination a joining worker does before it holds its stage's state.

`python -m agora.bench.dht_newcomer --stage 0 --result R ...` (bench/dht_peer.py's flags), started by
the harness in its own namespace once the window's readings are taken, while the swarm's traffic
goes on. As node/worker/join.py's worker does, in its order:

1. joins the DHT through the bootstrap (`SwarmDHT.start`, its credential's identity, as every peer);
2. reads every stage's worker records and plans its donors from them (`all_workers_async` and
   node/membership/state_download.py's `plan_donors`: join.py's `_stage_members`, which needs a whole
   `JoinOptions` and `RunConfig`), again every `RETRY_S` until the plan names a donor;
3. announces its own record, in weight sync (`Heartbeat.beat`: the worker's first announce comes
   after its entry phase is decided from those members).

`--result` gets the wall times of each step's end ("start": just before `SwarmDHT.start`), each read of
step 2 (its start, end and the records it returned per stage: a newcomer's first read is far slower
than the swarm's, its connections not yet open) and its peer id; then it goes on beating, as a joiner
in weight sync does while it downloads, until SIGTERM.
The download itself is the data plane (gRPC streams of the state), not measured here: "donor found"
is the coordination part of "to state". Whether others see the record is for another peer to say:
the harness's monitor peer watches the stage (bench/dht_peer.py's `watch_for_newcomer`).
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import sys
import time
from pathlib import Path

from agora.bench.dht_peer import CONFIG, Peer, build_parser, start_swarm
from agora.bench.dht_traffic import Dilation, TrafficModel
from agora.dht.bootstrap import write_ready_file
from agora.dht.records import Phase
from agora.dht.swarm import SwarmDHT
from agora.node.demo.supervision import die_with_parent
from agora.node.membership.state_download import plan_donors
from agora.node.replica.epoch import DEFAULT_REPORT_AHEAD
from agora.pipeline.files import atomic_write
from agora.pipeline.fingerprint import run_fingerprint

__all__ = ["find_donor", "main"]

RETRY_S = 0.5
DONOR_DEADLINE_S = 60.0


async def find_donor(swarm: SwarmDHT, run_id: str, stages: int, stage: int, deadline_s: float = DONOR_DEADLINE_S,
                     reads: list | None = None) -> tuple[int, float | None]:
    """(donors planned, wall time of the read that found one; None: none within `deadline_s`). Each read
    is appended to `reads`: its wall start and end and the records it returned per stage."""
    fingerprint, rng = run_fingerprint(CONFIG), random.Random()
    give_up = time.monotonic() + deadline_s
    while True:
        started = time.time()
        by_stage = await swarm.all_workers_async(run_id, stages, fingerprint=fingerprint)
        if reads is not None:
            reads.append({"start": started, "end": time.time(),
                          "records": [len(by_stage.get(s, ())) for s in range(stages)]})
        plan = plan_donors(by_stage, stage, swarm.peer_id, rng, max_gap=DEFAULT_REPORT_AHEAD)
        if plan.donors:
            return len(plan.donors), time.time()
        if time.monotonic() > give_up:
            return 0, None
        await asyncio.sleep(RETRY_S)


async def join(swarm: SwarmDHT, args, times: dict) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    model, dilation = TrafficModel(stages=args.stages), Dilation(args.dilation)
    epoch = float(Path(args.go_file).read_text().split()[0])  # the swarm's traffic started then
    peer = Peer(swarm, args, model, dilation, epoch)
    peer.phase = Phase.WEIGHT_SYNC
    try:
        times["reads"] = []
        times["donors"], times["donor"] = await find_donor(swarm, args.run_id, args.stages, args.stage,
                                                           reads=times["reads"])
        times["announced"] = time.time() if await peer.heartbeat.beat() else None
        times["peer_id"] = swarm.peer_id
        atomic_write(args.result, json.dumps(times).encode())
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), peer.heartbeat.interval)
            except asyncio.TimeoutError:
                await peer.heartbeat.beat()
    finally:
        await peer.close()


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    parser = build_parser()
    parser.prog = "python -m agora.bench.dht_newcomer"
    parser.add_argument("--result", required=True, help="where the steps' wall times are written")
    args = parser.parse_args(argv)
    times = {"start": time.time()}
    swarm, log = start_swarm(args)
    times["joined"] = time.time()
    try:
        write_ready_file(args.ready_file, swarm.visible_maddrs())
        asyncio.run(join(swarm, args, times))
        log.flush()
    finally:
        swarm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
