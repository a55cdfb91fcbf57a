"""One replica of bench/averaging_scale.py: a stage's averaging as a worker runs it, without the model traffic.

Its own process, so each replica has what a deployed worker has: a `SwarmDHT` (hivemind's DHT
process and p2pd), a `SliceAverager` (hivemind's averager process) started as node/worker/join.py
starts it, a heartbeat of its `WorkerRecord`, the DHT `RoundBoard` and the `AveragingLoop` over a
`LocalReplica` (the stage's compute thread). Only the trainers are missing: the replica reports a
completed global batch to its own compute every `--step-s` seconds on a clock shared by every
replica (`time.monotonic` is system-wide), which steps it as trainers' reports would, so rounds
fall due every `sync.every_steps` steps together, as on a training stage.

Handshake with the bench, by files in `--workdir` written atomically: `replica-I.dht` (its
multiaddrs, once the DHT is up), `replica-I.ready` (once it counts all `--replicas` live
replicas of the stage), then it waits for `go` (the shared start time); after `--rounds` rounds
are due and the last has ended, `replica-I.json` (every round's result, with its start in seconds from
`go`, the loop's stats, and its own DHT requests in that time by operation and record family).
It then keeps its parts up until SIGTERM, so slower replicas' rounds still find it.

    python -m agora.bench.averaging_replica --workdir W --index I --replicas R [--initial-peers ...]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import torch

from agora.dht.averaging import RoundResult, SliceAverager
from agora.dht.heartbeat import Heartbeat
from agora.dht.keys import averaging_prefix
from agora.dht.records import WorkerRecord
from agora.dht.robust import RobustAggregation
from agora.dht.round_board import RoundBoard
from agora.dht.swarm import SwarmDHT
from agora.node.averaging.loop import AveragingLoop
from agora.node.averaging.sparta import (
    SlicePartition,
    averaged_vector_size,
    max_round_weight,
    second_moment_offset,
    stage_parameter_numels,
)
from agora.node.demo.supervision import die_with_parent
from agora.node.replica.local_replica import LocalReplica
from agora.pipeline.config import PRESETS, RunConfig
from agora.pipeline.fingerprint import run_fingerprint
from agora.protos.stage_adapter import StepRequest

__all__ = ["bench_config", "main"]

RUN_ID = "averaging-scale"
PULL = 0.005  # each replica's parameters start this far apart (init std 0.02), so rounds move values
_POLL_S = 0.05
_ALL_LIVE_S = 180.0  # for every replica's record to be read: R processes start on shared cores


def bench_config(stages: int, every_steps: int, matchmaking_s: float) -> RunConfig:
    """tiny split over `stages` (its middle stage is a quarter of the model: compute is negligible),
    a round every `every_steps` steps, the given matchmaking window; the rest is the preset's."""
    config = PRESETS["tiny"].with_stages(stages)
    return dataclasses.replace(config, sync=dataclasses.replace(config.sync, every_steps=every_steps,
                                                                matchmaking_s=matchmaking_s))


def _write(path: Path, text: str) -> None:
    """Atomically: the bench polls for the file and must never read half of it."""
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _start_averager(config: RunConfig, stage: int, swarm: SwarmDHT) -> SliceAverager:
    """The stage's averager with the settings node/worker/join.py gives an insecure worker's."""
    sync = config.sync
    buffer_size = SlicePartition(stage_parameter_numels(config.model, stage), sync.n_slices, config.seed).buffer_size
    robust = RobustAggregation(sync.aggregation, max_weight=max_round_weight(sync, config.train.batch_size),
                               nonnegative_from=second_moment_offset(sync, buffer_size))
    return SliceAverager.start(
        swarm.hivemind_dht, prefix=averaging_prefix(RUN_ID, stage, sync.method),
        size=averaged_vector_size(sync, buffer_size), matchmaking_s=sync.matchmaking_s, request_s=sync.request_s,
        sender_s=sync.sender_s, reducer_s=sync.reducer_s, round_s=sync.round_s, part_size_bytes=sync.part_size_bytes,
        robust=robust, banned=lambda: swarm.bans.banned)


def round_row(result: RoundResult) -> dict:
    """What the bench keeps of one round (no tensors)."""
    return {"round": result.round, "outcome": result.outcome, "group_size": result.group_size,
            "formation_s": result.formation_s, "duration_s": result.duration_s,
            "received_fraction": result.received_fraction, "error": result.error}


def requests_since(before: dict, after: dict) -> dict[str, int]:
    """This replica's own DHT requests (its loop's, its heartbeat's) between two snapshots of its
    `SwarmDHT.timings`, by "operation family"; hivemind's averager reads and stores beside them."""
    counts = {f"{operation} {family}": stats.count - (before[(operation, family)].count
                                                      if (operation, family) in before else 0)
              for (operation, family), stats in after.items()}
    return {name: count for name, count in sorted(counts.items()) if count}


class Replica:
    """The replica's asyncio side: heartbeat, board, loop and the paced steps."""

    def __init__(self, args: argparse.Namespace, config: RunConfig, swarm: SwarmDHT, averager: SliceAverager):
        self.args, self.config, self.swarm, self.averager = args, config, swarm, averager
        self.workdir = Path(args.workdir)
        self.name = f"replica-{args.index}"
        self.rounds: list[dict] = []
        self.recorded = asyncio.Event()
        self.start_at = 0.0  # the shared start (the bench's `go`), once read

    def record(self) -> WorkerRecord:
        return WorkerRecord(peer_id=self.swarm.peer_id, run_id=RUN_ID, endpoint="127.0.0.1:9",  # never dialled
                            stage=self.args.stage, n_stages=self.args.stages, throughput=1.0, queue_depth=0,
                            step=self.worker.compute.optimizer.steps, phase="member", version="bench",
                            updated_at=0.0, fingerprint=run_fingerprint(self.config).text())

    async def run(self) -> None:
        """Until cancelled (SIGTERM): whatever it was doing then, everything it started is stopped."""
        args = self.args
        self.worker = LocalReplica(self.config, args.stage, run_id=RUN_ID, on_reports=True)
        generator = torch.Generator().manual_seed(1000 + args.index)
        await self.worker.on_compute(lambda c: [p.data.add_(PULL * torch.randn(p.shape, generator=generator))
                                                for p in c.optimizer.parameters])
        heartbeat = Heartbeat(self.swarm, self.record, interval=args.heartbeat_s)
        board = RoundBoard(self.swarm, run_id=RUN_ID, stage=args.stage, method=self.config.sync.method,
                           ttl=self.config.sync.matchmaking_s + self.config.sync.request_s)  # as join.py's
        loop = AveragingLoop(self.worker, self.averager, self.config.sync, seed=self.config.seed, board=board)
        loop.round_observers.append(self._observe)
        try:
            await heartbeat.start()
            await loop.start()
            await self._until(lambda: board.replicas(), lambda n: n >= args.replicas, _ALL_LIVE_S, "live replicas")
            _write(self.workdir / f"{self.name}.ready", "ready\n")
            start_at = self.start_at = float(await self._until(self._go, lambda t: t is not None, _ALL_LIVE_S, "go"))
            before = self.swarm.timings.snapshot()
            await self._step_through(start_at)
            await self._last_round_ended(loop)
            _write(self.workdir / f"{self.name}.json", json.dumps(
                {"index": args.index, "peer_id": self.swarm.peer_id, "rounds": self.rounds,
                 "stats": loop.stats.snapshot(), "dht_requests": requests_since(before, self.swarm.timings.snapshot())}))
            await asyncio.Event().wait()  # up for the others' rounds until the bench is done
        finally:
            await loop.stop()
            await heartbeat.stop()
            await self.worker.stop()

    def _observe(self, result: RoundResult, index: int, applied: bool) -> None:
        # When the round started, in seconds from the shared start: the replicas' clocks are one
        # (time.monotonic is system-wide), so the bench sets each replica's start beside the others'.
        started = time.monotonic() - result.duration_s - self.start_at
        self.rounds.append({**round_row(result), "started_s": round(started, 4)})
        self.recorded.set()

    async def _go(self):
        path = self.workdir / "go"
        return float(path.read_text()) if path.exists() else None

    @staticmethod
    async def _until(read, done, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while True:
            value = await read()
            if done(value):
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s:.0f} s (last read: {value})")
            await asyncio.sleep(_POLL_S * 5)

    async def _step_through(self, start_at: float) -> None:
        """Report global batches 0 .. rounds * every_steps - 1, one every `step_s` from `start_at`."""
        args, train = self.args, self.config.train
        for batch in range(args.rounds * self.config.sync.every_steps):
            await asyncio.sleep(max(0.0, start_at + batch * args.step_s - time.monotonic()))
            request = StepRequest(RUN_ID, args.stage, train.microbatches, completed_batch=batch,
                                  replicas=args.replicas)
            await self.worker.on_compute(lambda c: c.step(request))

    async def _last_round_ended(self, loop: AveragingLoop) -> None:
        """Until the window's last round has a result here, or as long as a round may take."""
        sync = self.config.sync
        deadline = time.monotonic() + sync.matchmaking_s + sync.request_s + sync.round_s + 5.0
        while (loop.stats.last_round or 0) < self.args.rounds and time.monotonic() < deadline:
            self.recorded.clear()
            try:
                await asyncio.wait_for(self.recorded.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--replicas", type=int, required=True, help="the stage's replicas, this one included")
    parser.add_argument("--rounds", type=int, default=20, help="rounds due in the window")
    parser.add_argument("--step-s", type=float, default=2.0, help="seconds between the stage's steps")
    parser.add_argument("--every-steps", type=int, default=4, help="sync.every_steps")
    parser.add_argument("--matchmaking-s", type=float, default=3.0, help="sync.matchmaking_s")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--heartbeat-s", type=float, default=5.0, help="join's default heartbeat")
    parser.add_argument("--initial-peers", nargs="*", default=[])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    args = parse(argv)
    torch.set_num_threads(1)
    config = bench_config(args.stages, args.every_steps, args.matchmaking_s)
    swarm = SwarmDHT.start(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        _write(Path(args.workdir) / f"replica-{args.index}.dht", "\n".join(swarm.visible_maddrs()) + "\n")
        averager = _start_averager(config, args.stage, swarm)  # forks: before the compute thread starts
        try:
            asyncio.run(_serve(args, config, swarm, averager))
        finally:
            averager.shutdown()
    finally:
        swarm.shutdown()
    return 0


async def _serve(args: argparse.Namespace, config: RunConfig, swarm: SwarmDHT, averager: SliceAverager) -> None:
    running = asyncio.create_task(Replica(args, config, swarm, averager).run())
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, running.cancel)  # leave cleanly, at any point
    try:
        await running
    except asyncio.CancelledError:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
