"""One DHT peer of bench/dht_scale.py: a real admitted `SwarmDHT` playing one role's DHT traffic.

`python -m agora.bench.dht_peer --role worker --stage 1 --state-dir D ...`, started by the harness
inside its own network namespace (a fork of the launcher's server: node/demo/launcher.py). It
starts its DHT peer as the role's daemon does (its credential's identity, the token authorizer and
record validators of dht/security.py; a trainer in client mode), joins through the bootstrap
peer, writes its multiaddrs to `--ready-file`, then waits for the harness's `--go-file` (its one
line: the wall time the schedule starts) so that every peer's traffic starts together, after the
harness has measured the swarm at rest.

Then it runs its role's actions (bench/dht_traffic.py) through the code the roles run: `Heartbeat`
with a real `WorkerRecord` or `TrainerRecord` (the run's fingerprint, endpoints on its own address),
`RoundBoard` announcements, closes and probes, `read_block` (every trainer's chain checked by the
DHT's validator), `LeasedUnits` over a `LeaseBoard` (claims, commits and renewals of real units), the
ban list as the bootstrap publishes it (`BanPublisher`, signed by the run's CA), the monitor's
whole refresh (`SwarmMonitor.poll`, monitor/service.py: its reads and the view it builds from
them). Every period is
`--dilation` times its logical length, and so are the lifetimes of what it stores, within the
bounds peers accept (`Dilation.ttl_s`). Two timers of the code are stretched from here too: the ban
list's age a read accepts (`SwarmDHT.ban_refresh_s`) and the trainer's block refresh; the lease is
`--dilation` times 30 s up to `MAX_LEASE_S`, so above a dilation of 20 renewals come more often
than the model's.

Every request `SwarmDHT` sends is timed where its own `RequestTimings` times it, and also written,
one JSON array a line ([end wall time, operation, family, seconds, failed]), to `--calls` every
couple of seconds and at exit; `<calls>.summary.json` holds each action's runs and errors, and the
monitor's polls ([end wall time, seconds] each); `<calls>.traffic.jsonl` what its DHT process carried
so far, every couple of seconds (dht/entry_traffic.py: the entries it received by family, the requests
it sent by method and family). SIGTERM or SIGINT ends it.

The monitor also watches for the harness's newcomer (bench/dht_newcomer.py): once `--watch-file`
names a stage, it reads that stage's workers (the key every reader of the stage reads), writes
`<watch>.armed`, and reads it again every `WATCH_S` until a peer it did not see at first is there:
`<watch>.seen` holds that read's end (wall time) and the peer. The newcomer is then visible to others.

First reads. A worker or trainer announces its record within `--first-reads-s` of the go word (its
daemon does so when it starts), and within the next `--first-reads-s` makes each of its role's reads
once (`first_reads`), each peer at its own drawn moments, while the harness is still warming up. A daemon's first read of a key is whole: every entry, each with its
writer's credential chain; later reads get what changed, chains named by hash (dht/changed_finds.py,
dht/entry_chains.py), and its round board knows the stage's replicas, so two of them announce a round.
With the schedule dilated, a read of period P comes 180 / (K x P) times in a window of 180 real
seconds: without these, the window's reads of the slower actions (the replica count every 30 logical
s, the rebalancer's) would nearly all be first reads, a cost a swarm that has run for a while pays
once per key and newcomer (measured apart: bench/dht_newcomer.py), not every minute.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Awaitable, Callable

from prometheus_client import CollectorRegistry

from agora.auth.authority import RunAuthority
from agora.bench.dht_traffic import Action, Dilation, Timetable, TrafficModel, first_due_s, role_actions
from agora.dht.bans import BAN_REFRESH_S
from agora.dht.bootstrap import host_maddrs, write_ready_file
from agora.dht.heartbeat import Heartbeat
from agora.dht.key_families import ROUNDS, TRAINERS, WORKERS
from agora.dht.keys import move_key
from agora.dht.leases import LeaseBoard, read_block
from agora.dht.op_timings import RequestTimings
from agora.dht.record_fields import BLOCK_UNITS, MAX_UNIT_BLOCKS
from agora.dht.records import MAX_LEASE_S, MoveRecord, Phase, TrainerRecord, WorkerRecord
from agora.dht.round_board import RoundBoard
from agora.dht.security import DHTSecurity
from agora.dht.swarm import DHTRequestError, SwarmDHT
from agora.monitor.options import MonitorOptions
from agora.monitor.service import SwarmMonitor
from agora.node.averaging.loop import ROUND_LEAD
from agora.node.ban_publisher import BanPublisher
from agora.node.demo.supervision import die_with_parent
from agora.node.observability import package_version
from agora.node.trainer.units import LeasedUnits
from agora.pipeline.config import PRESETS
from agora.pipeline.files import atomic_write
from agora.pipeline.fingerprint import run_fingerprint

__all__ = ["ACTIONS", "CallLog", "Peer", "main"]

logger = logging.getLogger("agora.bench.dht_peer")

FLUSH_S = 2.0
GO_POLL_S = 0.2
WATCH_S = 0.25  # between two reads of the newcomer's stage: the resolution of its "visible to others"
IN_FLIGHT = 2  # a trainer's units held at once: the one it runs and the next it claimed
GRPC_PORT, METRICS_PORT = 50051, 9100  # announced, as a worker's record does; nothing listens here
CONFIG = PRESETS["tiny"]  # the demo's run: its fingerprint is what the workers announce
# bench/dht_traffic.py's actions, and the `Peer` method that plays each.
ACTIONS = {"heartbeat": "beat", "probe": "probe", "replicas": "read_replicas", "round": "run_round", "units": "read_units",
           "rebalance": "rebalance", "roster": "roster", "batch": "batch", "renew": "renew", "bans": "read_bans",
           "poll": "poll"}
# The actions that read (`first_reads` makes each once before the window).
FIRST_READS = frozenset({"probe", "replicas", "units", "rebalance", "roster", "poll"})


class CallLog(RequestTimings):
    """`RequestTimings` that also keeps every request for the harness (module docstring)."""

    def __init__(self, path: Path):
        super().__init__()
        self._path = path
        self.traffic_path = Path(f"{path}.traffic.jsonl")  # `note_traffic`'s
        self._pending: list[list] = []
        self._pending_lock = threading.Lock()

    def record(self, operation: str, family: str, seconds: float, *, failed: bool = False) -> None:
        super().record(operation, family, seconds, failed=failed)
        with self._pending_lock:
            self._pending.append([round(time.time(), 4), operation, family, round(seconds, 5), failed])

    def flush(self) -> None:
        with self._pending_lock:
            lines, self._pending = self._pending, []
        if lines:
            with self._path.open("a") as out:
                out.write("".join(json.dumps(line) + "\n" for line in lines))


class Peer:
    """One role's actions over a started `SwarmDHT` (the module docstring)."""

    def __init__(self, swarm: SwarmDHT, args: argparse.Namespace, model: TrafficModel, dilation: Dilation,
                 epoch: float):
        self.swarm, self.args, self.model, self.dilation, self.epoch = swarm, args, model, dilation, epoch
        self.run_id = args.run_id
        self.round = 0
        self.fingerprint = run_fingerprint(CONFIG).text()
        interval = dilation.real_s(model.heartbeat_s)
        self.heartbeat = Heartbeat(swarm, self._record, interval=interval)
        bound = (TRAINERS if args.role == "trainer" else WORKERS).max_ttl_s
        self.heartbeat.ttl = dilation.ttl_s(model.heartbeat_s * 3, bound)
        self.board = RoundBoard(swarm, run_id=self.run_id, stage=args.stage, method="sparta",
                                ttl=dilation.ttl_s(model.round_announcement_s, ROUNDS.max_ttl_s))
        lease = LeaseBoard(swarm, run_id=self.run_id, lease_s=min(dilation.real_s(model.lease_s), MAX_LEASE_S))
        self.units = LeasedUnits(lease, total=MAX_UNIT_BLOCKS * BLOCK_UNITS, stripe=(args.trainer_index, args.trainers),
                                 clock=swarm.clock, refresh_s=dilation.real_s(1.0))
        self.held: collections.deque[int] = collections.deque()
        self.phase = Phase.MEMBER  # what its worker record announces (a newcomer: weight sync)
        self.monitor = None if args.role != "monitor" else SwarmMonitor(
            swarm, MonitorOptions(poll_s=dilation.real_s(model.monitor_poll_s)), CollectorRegistry(),
            run_id=self.run_id, n_stages=model.stages)
        self.polls: list[list[float]] = []  # the monitor's: [end wall time, seconds]

    # ---- what the roles announce

    def logical_s(self) -> float:
        return max(0.0, time.time() - self.epoch) / self.dilation.factor

    def batches(self) -> int:
        """Global batches the swarm has run by now at the model's pace (a record's step)."""
        return int(self.logical_s() * self.model.batches_per_s * self.args.trainers)

    def _record(self) -> WorkerRecord | TrainerRecord:
        host, version = self.args.host, package_version()
        if self.args.role == "trainer":
            batches = int(self.logical_s() * self.model.batches_per_s)
            return TrainerRecord(peer_id=self.swarm.peer_id, run_id=self.run_id, trainer_index=self.args.trainer_index,
                                 batches=batches, step=self.batches(), loss=3.5, tokens_per_s=1400.0, version=version,
                                 updated_at=0.0, metrics_endpoint=f"{host}:{METRICS_PORT}")
        return WorkerRecord(peer_id=self.swarm.peer_id, run_id=self.run_id, endpoint=f"{host}:{GRPC_PORT}",
                            stage=self.args.stage, n_stages=self.model.stages, throughput=1400.0, queue_depth=1,
                            step=self.batches(), phase=self.phase, version=version, updated_at=0.0,
                            fingerprint=self.fingerprint, metrics_endpoint=f"{host}:{METRICS_PORT}",
                            averaging_rounds=self.round, averaging_committed=self.round, capacity=8, credits=4,
                            in_flight_credits=2)

    # ---- the actions (bench/dht_traffic.py names them)

    def actions(self) -> dict[str, Callable[[], Awaitable[None]]]:
        return {name: getattr(self, method) for name, method in ACTIONS.items()}

    async def beat(self) -> None:
        await self.heartbeat.beat()

    async def probe(self) -> None:
        await self.board.announced_round(self.round + ROUND_LEAD)

    async def read_replicas(self) -> None:
        await self.board.replicas()

    async def run_round(self) -> None:
        """A round as its replica's loop runs it: announced and closed if it is one of the round's
        announcers (dht/round_board.py, from the peers its last count saw), else nothing stored."""
        self.round += 1
        if not self.board.announces(self.round):
            return
        await self.board.announce(self.round)
        await asyncio.sleep(self.dilation.real_s(self.model.round_s))
        await self.board.close(self.round)

    async def read_units(self) -> None:
        """The block the swarm's units are in now, as a worker refreshes it while work comes."""
        await read_block(self.swarm, self.run_id, self.batches() // BLOCK_UNITS)

    async def rebalance(self) -> None:
        await self._all_workers()
        await self.swarm.owned_entries_async(move_key(self.run_id), MoveRecord)

    async def roster(self) -> None:
        await self._all_workers()

    async def _all_workers(self) -> None:
        """Every stage's workers, read concurrently as `all_workers` reads them, each get timed."""
        await asyncio.gather(*(self.swarm.live_workers_async(self.run_id, stage) for stage in range(self.model.stages)))

    async def batch(self) -> None:
        """Claim the next unit; commit the one claimed `IN_FLIGHT` batches ago."""
        unit = await self.units.next_unit()
        if unit is not None:
            self.held.append(unit)
        while len(self.held) > IN_FLIGHT:
            await self.units.committed(self.held.popleft())

    async def renew(self) -> None:
        """Nothing: `LeasedUnits` renews its claims on its own timer, a third of the (dilated) lease,
        as a trainer's do; the action is in the model for its rate."""

    async def poll(self) -> None:
        """One whole refresh of the monitor: every read it makes and the view it builds from them."""
        started = time.time()
        await self.monitor.poll()
        ended = time.time()
        self.polls.append([round(ended, 4), round(ended - started, 5)])

    async def read_bans(self) -> None:
        await self.swarm.refresh_bans_async(self.dilation.real_s(self.model.heartbeat_s) / 2)

    async def close(self) -> None:
        await self.units.close()


async def run_action(action: Action, work: Callable[[], Awaitable[None]], period_s: float, first_s: float,
                     tally: dict[str, collections.Counter]) -> None:
    loop = asyncio.get_running_loop()
    table = Timetable(period_s, loop.time() + first_s)
    while True:
        await asyncio.sleep(max(0.0, table.next_s - loop.time()))
        try:
            await work()
            tally["runs"][action.name] += 1
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - a failed action is counted, the schedule goes on
            tally["errors"][action.name] += 1
            logger.warning("%s failed: %s: %s", action.name, type(error).__name__, error)
        table.ran(loop.time())


async def wait_for_word(path: Path, stop: asyncio.Event, kind: type = float):
    """The first word of a file the harness writes (the go file's start time, the watch file's
    stage), once it is there; None if stopped first."""
    while not stop.is_set():
        try:
            return kind(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            await asyncio.sleep(GO_POLL_S)
    return None


async def watch_for_newcomer(swarm: SwarmDHT, run_id: str, path: Path, stop: asyncio.Event) -> None:
    """The monitor's watch for the newcomer (the module docstring)."""
    stage = await wait_for_word(path, stop, int)
    if stage is None:
        return
    known = None
    while True:
        try:  # a read that fails (a peer not answering in time) is tried again, as the monitor's poll is
            peers = [record.peer_id for record in await swarm.live_workers_async(run_id, stage)]
        except DHTRequestError as error:
            logger.warning("watch: stage %d's workers not read (%s); reading again", stage, error)
            peers = None
        if peers is not None and known is None:
            known = set(peers)
            atomic_write(Path(f"{path}.armed"), b"armed\n")
        elif peers is not None:
            fresh = [peer for peer in peers if peer not in known]
            if fresh:
                atomic_write(Path(f"{path}.seen"), json.dumps({"seen": time.time(), "peer_id": fresh[0]}).encode())
                return
        await asyncio.sleep(WATCH_S)


async def flush_forever(log: CallLog, swarm: SwarmDHT) -> None:
    while True:
        await asyncio.sleep(FLUSH_S)
        await asyncio.to_thread(log.flush)
        await asyncio.to_thread(note_traffic, swarm, log.traffic_path)


def note_traffic(swarm: SwarmDHT, path: Path) -> None:
    """Append what the peer's DHT process carried so far (dht/entry_traffic.py) as one line:
    [wall time, {"received": {family: [entries, bytes]}, "sent": {"method family": [calls, out, back]}}]."""
    try:
        traffic = swarm.traffic()
    except DHTRequestError as error:
        logger.warning("DHT traffic not read: %s", error)
        return
    with path.open("a") as out:
        out.write(json.dumps([round(time.time(), 4), traffic]) + "\n")


async def first_reads(work: dict[str, Callable[[], Awaitable[None]]], actions: tuple[Action, ...],
                      epoch: float, after_s: float, rng: random.Random) -> None:
    """Announce within `after_s` of `epoch` (as a daemon does when it starts), then within the next
    `after_s` make each of the role's reads once: a peer of a swarm that has run a while has read
    every key it reads, and holds their entries and their writers' chains (the module docstring).
    Each at a moment drawn for this peer: all at once, 64 peers' announces took the bootstrap's ban
    list store past its 10 s deadline."""
    names = {action.name for action in actions}
    try:
        if "heartbeat" in names:
            await asyncio.sleep(max(0.0, epoch + rng.uniform(0.0, 0.8 * after_s) - time.time()))
            await work["heartbeat"]()
        await asyncio.sleep(max(0.0, epoch + after_s * rng.uniform(1.0, 1.8) - time.time()))
        for name in sorted(names & FIRST_READS):
            await work[name]()
    except asyncio.CancelledError:
        raise
    except Exception as error:  # noqa: BLE001 - the schedule's own reads go on; the window shows the cost
        logger.warning("a first read failed: %s: %s", type(error).__name__, error)


async def publish_bans(swarm: SwarmDHT, args: argparse.Namespace, stop: asyncio.Event) -> None:
    """The bootstrap publishes the run's ban list as the traffic starts, trying again until a store
    is answered (a store past its deadline must not end the peer every other one joined through)."""
    publisher = BanPublisher(RunAuthority(args.ca_dir), swarm)
    while not stop.is_set():
        try:
            await asyncio.to_thread(publisher.publish_if_due)
            return
        except DHTRequestError as error:
            logger.warning("publishing the ban list failed, trying again: %s", error)
            await asyncio.sleep(1.0)


async def play(swarm: SwarmDHT, args: argparse.Namespace, log: CallLog) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    model, dilation = TrafficModel(stages=args.stages), Dilation(args.dilation)
    epoch = await wait_for_word(Path(args.go_file), stop)
    if epoch is None:
        return
    if args.role == "bootstrap":
        await publish_bans(swarm, args, stop)
    peer = Peer(swarm, args, model, dilation, epoch)
    work = peer.actions()
    rng = random.Random(f"{args.seed}:{args.name}")
    tally = {"runs": collections.Counter(), "errors": collections.Counter()}
    tasks = [asyncio.create_task(flush_forever(log, swarm))]
    if args.role == "monitor" and args.watch_file:
        tasks.append(asyncio.create_task(watch_for_newcomer(swarm, args.run_id, Path(args.watch_file), stop)))
    if args.first_reads_s > 0:
        tasks.append(asyncio.create_task(first_reads(work, role_actions(args.role, model), epoch, args.first_reads_s,
                                                     random.Random(f"{args.seed}:{args.name}:first"))))
    for action in role_actions(args.role, model):
        period = dilation.real_s(action.period_s)
        tasks.append(asyncio.create_task(run_action(action, work[action.name], period,
                                                    first_due_s(period, rng), tally)))
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await peer.close()
        log.flush()
        summary = {**{name: dict(counts) for name, counts in tally.items()}, "polls": peer.polls}
        Path(f"{args.calls}.summary.json").write_text(json.dumps(summary))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m agora.bench.dht_peer", description=__doc__.splitlines()[0])
    parser.add_argument("--role", required=True, choices=("worker", "trainer", "bootstrap", "monitor"))
    parser.add_argument("--name", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--state-dir", required=True, help="the peer's credential directory")
    parser.add_argument("--host", required=True, help="the address it listens on and announces")
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--go-file", required=True)
    parser.add_argument("--calls", required=True, help="where its requests are written")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--trainers", type=int, default=1)
    parser.add_argument("--trainer-index", type=int, default=0)
    parser.add_argument("--dilation", type=float, default=1.0)
    parser.add_argument("--first-reads-s", type=float, default=0.0,
                        help="seconds after the go word when it makes each of its reads once (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ca-dir", default=None, help="the bootstrap's: the run's authority, to sign the ban list")
    parser.add_argument("--watch-file", default=None,
                        help="the monitor's: where the harness names the newcomer's stage")
    return parser


def start_swarm(args: argparse.Namespace, *, client_mode: bool = False) -> tuple[SwarmDHT, CallLog]:
    """This peer's admitted `SwarmDHT`, joined through `--initial-peers`, its requests logged for the
    harness (`--calls`) and its ban list's accepted age dilated like the rest of its timers."""
    swarm = SwarmDHT.start(initial_peers=args.initial_peers, host_maddrs=host_maddrs(args.host, 0),
                           client_mode=client_mode, security=DHTSecurity.from_state_dir(args.state_dir))
    log = CallLog(Path(args.calls))
    swarm.timings = log
    swarm.ban_refresh_s = Dilation(args.dilation).real_s(BAN_REFRESH_S)
    return swarm, log


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    swarm, log = start_swarm(args, client_mode=args.role in ("trainer", "monitor"))
    try:
        write_ready_file(args.ready_file, swarm.visible_maddrs())
        asyncio.run(play(swarm, args, log))
    finally:
        swarm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
