"""A hostile newcomer against a live run with admission: `agora-node demo` (2 stages x 2 replicas,
one trainer, 20 s credentials, averaging on) trains while an attacker in this process mounts what
it can with what the run gives it, one attack after the other. The run shrugs them off when it
completes with every process exiting cleanly, trains every unit exactly once, keeps both stages'
real members and commits averaging rounds after the attacks began, keeps its replicas' step counts
at the run's (but for the bounded push below), and every node renews its credential through it
all; and when every attack is refused where the product refuses it, counted where the product
counts it (the nodes' metrics pages, stats files and logs, read from outside as an operator
would), and answered to the attacker with a status that says why.

The attacker holds two identities: a stranger the run's authorizer admitted by itself through the
join file, the way any newcomer joins, as a worker of stage 0 (strangers join as workers only: its
try as a trainer is refused), which keeps renewing its credential; and a trainer credential the
operator minted (`agora-node authorizer issue --role trainer`) and lost, a compromised trainer.
With them, while the run trains (each attack's detail has its integration test against real
components):

1. a `member` WorkerRecord in stage 1 under the stranger's stage-0 credential, stored at every
   worker's DHT peer: refused by each, counted (tests/integration/test_dht_auth.py);
2. averaging round 10**9 announced in its own stage: stored (its writer may announce rounds there),
   and refused once by each reader of the stage's schedule, named in its log
   (tests/integration/test_forged_records.py);
3. a lease hold: unit block entries claiming a unit the trainer is about to take, dated at the dawn
   of time, two hours back, five minutes back and an hour ahead, at every worker's DHT peer: refused
   by each, in its validator or at its door, counted (test_hostile_leases.py);
4. a work-key squat: training Forwards under a committed unit's and a future unit's work keys to
   both tail replicas: PERMISSION_DENIED naming the holder, nothing applied (test_unit_binding.py);
5. a schedule push to both tail replicas: a report of a unit it does not hold (PERMISSION_DENIED),
   of one it claims far ahead of a replica's count (OUT_OF_RANGE), and of units past the run's end
   it claims, which a trainer may do: counted, each moving a replica one step plus the credit it
   earned, so the tails end at most twice as many steps ahead as it sent the stage reports, the
   residual README's threat model states (node/replica/epoch.py; test_unit_binding.py);
6. a challenge flood from six addresses of the run's own network against the authorizer, mounted
   first: RESOURCE_EXHAUSTED at the network's share of the challenge book, which stays full for a
   minute, and every node renews through it meanwhile (test_authorizer_attacks.py);
7. a health Watch flood on one worker from both identities: each holds half the probe pool, the
   rest is refused, and the trainer completes global batches meanwhile (test_call_slots.py);
8. last, reports of flagged workers to the authorizer: the stranger reporting a real worker, refused
   (only trainers report); the compromised trainer reporting the stranger, which a trainer may do
   (the residual auth/reports.py states): the stranger is banned, the ban names the trainer, its
   renewal is refused and every worker's DHT peer holds the ban list from its next heartbeat
   (test_worker_reports.py; a verifier's own flag reported: test_reply_verification.py).

Readiness is the demo's files (the join file, ready files, the trainer's log, metrics pages),
polled with deadlines; the demo and the attacker's DHT peers are reaped on every path."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agora.auth.admission import AdmissionError, CredentialRenewer, JoinFile, admit
from agora.auth.node_state import NodeCredentials
from agora.dht.leases import LeaseBoard
from agora.dht.keys import rounds_key, trainer_key, units_key, worker_key
from agora.dht.records import RoundRecord, TrainerRecord, WorkerRecord
from agora.dht.security import DHTSecurity
from agora.dht.swarm import SwarmDHT
from agora.node.admission import free_port
from agora.node.cli import main as agora_node
from agora.node.replica.epoch import DEFAULT_REPORT_AHEAD
from agora.node.rpc.server import run as run_loop
from agora.node.rpc.tls import TlsChannels, worker_server_name
from agora.node.trainer.reports import send_report
from agora.node.trainer.stage_client import StageCallError, StageClient, UnitNotHeld
from agora.node.trainer.verification import Evidence
from agora.pipeline.config import config_from_dict
from agora.pipeline.fingerprint import run_fingerprint
from authorizer_world import challenges_until_refused, from_sources
from demo_run import DemoRun, by_label, log_lines_after, scrape
from hostile_dht import LEASE_ANSWERS, lease_holds, store_at

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = "demo"  # the demo's run id
STEPS = 90  # the attacks took 43 to 52 of them, alone and in the suite; the run goes on after
LIFETIME_S = 20
# `join`'s default beat. The demo's 1 s beat has the rebalancer judge the stages every 6 s, from the
# throughput the workers measured in their first seconds; on a loaded machine that once read stage 0
# at 2.5 times stage 1 and moved a head replica 12 s into the run, no attack's doing (and a test of
# members kept cannot tell). Every 30 s, it judges a run whose throughputs have settled.
HEARTBEAT_S = 5
WORKERS = {"worker-s0-r0": 0, "worker-s0-r1": 0, "worker-s1-r0": 1, "worker-s1-r1": 1}
TAILS = ("worker-s1-r0", "worker-s1-r1")
FAR_ROUND = 10**9
HELD = 4  # units past the run's end the compromised trainer claims and reports done to each tail
FLOOD_SOURCES = [f"127.0.0.{i}" for i in range(2, 8)]  # six addresses of the run's own network
CHALLENGE_SHARE = 32  # join challenges one network may hold outstanding (the authorizer's default)
# What a worker's DHT peer counts the fake member and the lease holds under (agora_dht_refused_total).
# What each worker's DHT peer refuses of the attacks, by reason: the forged member, and the hostile
# claims (two in its record validator, two at its door).
DHT_REFUSALS = {"workers": 1, "units.claims": 2, "units.updated_at": 2}
WATCH_TARGET = "worker-s0-r1"
REFUSAL_MEMORY_S = 1.0  # how long a worker refuses a refused caller from its cache (UnitHolders' default)
PROBE_POOL = 8  # the workers' max_probe_calls (default)


@dataclass(frozen=True)
class Worker:
    name: str
    stage: int
    address: str
    peer_id: str
    metrics: str


class Attacker:
    """The stranger and the compromised trainer against the live run `demo`, one attack after the
    other on one event loop; `record` is what each got, and the nodes' metrics before and after."""

    def __init__(self, demo: DemoRun, workers: dict[str, Worker], stranger: SwarmDHT, compromised: SwarmDHT,
                 stranger_dir: Path, compromised_dir: Path, config, join: JoinFile):
        self.demo, self.workers, self.config, self.join = demo, workers, config, join
        self.stranger, self.compromised = stranger, compromised
        self.stranger_dir, self.compromised_dir = stranger_dir, compromised_dir
        self.root_pem = NodeCredentials(compromised_dir, clock=time.time).root_pem()
        self.record: dict = {}

    def client(self, worker: Worker, directory: Path) -> StageClient:
        return StageClient(worker.address, run_id=RUN, stage=worker.stage, model=self.config.model,
                           fingerprint=run_fingerprint(self.config), peer_id=worker.peer_id,
                           channels=TlsChannels(NodeCredentials(directory, clock=time.time)), timeout_s=20)

    async def store_at_every_worker(self, sender: SwarmDHT, key: str, wire: dict) -> dict:
        return {name: await asyncio.to_thread(store_at, sender, worker.peer_id, key, wire)
                for name, worker in self.workers.items()}

    async def scrape_workers(self) -> dict:
        return {name: await asyncio.to_thread(scrape, worker.metrics) for name, worker in self.workers.items()}

    async def mount(self) -> dict:
        record = self.record
        record["began"], record["step_at_start"] = time.time(), self.demo.steps()
        record["before"] = await self.scrape_workers()
        renewer = CredentialRenewer(self.join.authorizer, NodeCredentials(self.stranger_dir, clock=time.time),
                                    on_revoked=lambda reason: record.setdefault("stranger_revoked", reason))
        renewer.start()  # the stranger keeps its 20 s credential, as any admitted node does
        try:
            record["flood"] = await self.challenge_flood()  # first: every node then renews through the full book
            record["member"] = await self.fake_member()
            record["round"] = await self.forged_round()
            record["watch"] = await self.watch_flood()
            record["leases"] = await self.lease_hold()
            record["squat"] = await self.work_key_squat()
            record["push"] = await self.schedule_push()
            record["flood"].update(await self.renewed_since(record["flood"].pop("renewals")))
            record["after"] = await self.refusals_counted()
            record["report"] = await self.report_and_ban()
            record["step_at_end"] = self.demo.steps()
        finally:
            await renewer.stop()
        return record

    async def fake_member(self) -> dict:
        """1: a member of stage 1 that no trainer can reach, written by a worker of stage 0."""
        fake = WorkerRecord(peer_id=self.stranger.peer_id, run_id=RUN, endpoint="127.0.0.1:9", stage=1, n_stages=2,
                            throughput=1e9, queue_depth=0, step=self.demo.steps(), phase="member", version="0.1.0",
                            updated_at=self.stranger.clock(), fingerprint=run_fingerprint(self.config).text())
        answers = await self.store_at_every_worker(self.stranger, worker_key(RUN, 1), fake.to_wire())
        members = await self.compromised.live_workers_async(RUN, 1)  # stage 1 as its readers see it
        return {"answers": answers, "members": sorted(member.peer_id for member in members)}

    async def forged_round(self) -> bool:
        """2: round 10**9 of its own stage, stored like any replica's announcement."""
        forged = RoundRecord(peer_id=self.stranger.peer_id, run_id=RUN, stage=0, round=FAR_ROUND,
                             started_at=self.stranger.clock())
        return await self.stranger.store_async(rounds_key(RUN, 0, self.config.sync.method), forged, 60.0,
                                               subkey=self.stranger.subkey_of(self.stranger.peer_id))

    async def watch_flood(self) -> dict:
        """7: six Watch streams from the stranger and five from the compromised trainer on one worker,
        held open while the trainer completes two more global batches."""
        worker = self.workers[WATCH_TARGET]
        target = worker_server_name(worker.stage, worker.peer_id)
        channels = [TlsChannels(NodeCredentials(directory, clock=time.time)).open(worker.address, target_name=target)
                    for directory in (self.stranger_dir, self.compromised_dir)]
        try:
            streams = {"stranger": [await _watch(channels[0]) for _ in range(6)],
                       "compromised": [await _watch(channels[1]) for _ in range(5)]}
            held_from, deadline = self.demo.steps(), time.monotonic() + 60
            while self.demo.steps() < held_from + 2 and time.monotonic() < deadline:  # the run trains on, or not
                assert self.demo.process.poll() is None, self.demo.tail()
                await asyncio.sleep(0.1)
            outcomes = {who: [outcome for _, outcome in opened] for who, opened in streams.items()}
            return {**outcomes, "steps": (held_from, self.demo.steps())}
        finally:
            for channel in channels:
                await channel.close()

    async def lease_hold(self) -> dict:
        """3: entries that would hold a unit the trainer is about to claim, at every worker."""
        unit = self.demo.steps() + 3
        answers = {}
        for name, wire in lease_holds(self.compromised, RUN, unit).items():
            answers[name] = await self.store_at_every_worker(self.compromised, units_key(RUN, 0), wire)
        return {"unit": unit, "answers": answers}

    async def work_key_squat(self) -> dict:
        """4: training Forwards under unit 0's work key (committed by the trainer) and a future unit's."""
        wire_dim, rows = self.config.model.wire_dim, self.config.train.microbatch_size
        tokens = torch.randint(0, self.config.model.vocab_size, (rows, 16), generator=torch.Generator().manual_seed(0))
        future = self.demo.steps() + 8
        answers = {}
        for name in TAILS:
            async with self.client(self.workers[name], self.compromised_dir) as tail:
                answers[name] = [await _refusal(tail.forward(f"squat-{unit}", tokens, torch.zeros(rows, 16, wire_dim),
                                                             tokens, work_key=f"u{unit}m0"))
                                 for unit in (0, future)]
        return {"future": future, "answers": answers}

    async def schedule_push(self) -> dict:
        """5: to both tails, reports of units past the run's end it claims, of one it claims far
        ahead of the replica's count, and of one it does not hold."""
        board = LeaseBoard(self.compromised, run_id=RUN, lease_s=120.0)
        held = [STEPS + i for i in range(HELD)]
        push: dict = {"claimed": [await _claim(board, unit) for unit in held]}
        micro = self.config.train.microbatches
        for name in TAILS:
            async with self.client(self.workers[name], self.compromised_dir) as tail:
                start = (await tail.info()).step
                far = max(STEPS + HELD, start + DEFAULT_REPORT_AHEAD + 64)  # beyond the replica's window
                push[name] = {"start": start, "held": [(await _report_held(tail, unit, micro)).step for unit in held],
                              "far claimed": await board.claim(far),
                              "far": await _refusal(tail.batch_done(far, micro, 2)),
                              # Last: for a second after refusing a caller, a worker refuses it from its
                              # cache without a read (node/worker/unit_holders.py), and it has not read
                              # the far claim's block yet.
                              "unheld": await _refusal(tail.batch_done(start + 16, micro, 2))}
        return push

    async def challenge_flood(self) -> dict:
        """6: join challenges from six addresses of 127.0.0.0/24 until each is refused (the challenges
        granted stay outstanding for a minute: the network's share of the book is full meanwhile)."""
        trainers = await self.compromised.owned_entries_async(trainer_key(RUN), TrainerRecord)
        nodes = {name: worker.metrics for name, worker in self.workers.items()}
        nodes.update({f"trainer {peer}": stored.record.metrics_endpoint for peer, stored in trainers.items()})
        renewals = {name: (endpoint, await asyncio.to_thread(_renewals, endpoint)) for name, endpoint in nodes.items()}
        async with from_sources(self.join.authorizer, FLOOD_SOURCES) as relays:
            outcomes = [await challenges_until_refused(relay, self.root_pem, role="worker", limit=10)
                        for relay in relays]
        return {"outcomes": [(granted, None if error is None else (error.code().name, error.details()))
                             for granted, error in outcomes], "renewals": renewals}

    async def report_and_ban(self) -> dict:
        """8: the stranger reports a real worker (refused); the compromised trainer reports the stranger
        (banned). Waits for the stranger's renewal to be refused and every worker to hold the ban list."""
        address = self.join.authorizer
        victim = self.workers["worker-s0-r0"].peer_id
        try:
            await send_report(address, NodeCredentials(self.stranger_dir, clock=time.time), _evidence(victim),
                              timeout_s=20)
            as_worker = ("OK", "")
        except grpc.aio.AioRpcError as error:
            as_worker = (error.code().name, error.details())
        receipt = await send_report(address, NodeCredentials(self.compromised_dir, clock=time.time),
                                    _evidence(self.stranger.peer_id), timeout_s=20)
        deadline, banned = time.monotonic() + 2 * LIFETIME_S, {}
        while time.monotonic() < deadline:
            scraped = await self.scrape_workers()
            banned = {name: samples["agora_dht_banned_peers"][()] for name, samples in scraped.items()}
            if "stranger_revoked" in self.record and min(banned.values()) >= 1:
                break
            await asyncio.sleep(0.5)
        authorizer = await asyncio.to_thread(scrape, self.demo.text("authorizer.metrics").strip())
        return {"as_worker": as_worker, "receipt": receipt, "banned_peers": banned,
                "outcomes": by_label(authorizer, "agora_authorizer_worker_reports_total", "outcome")}

    async def renewed_since(self, renewals: dict) -> dict:
        """Which nodes renewed since the flood (the step each was seen at), waiting up to two lifetimes;
        and the authorizer's metrics then (a status reaches its caller before the server counts it)."""
        renewed: dict = {}
        deadline = time.monotonic() + 2 * LIFETIME_S
        while len(renewed) < len(renewals) and time.monotonic() < deadline:
            for name, (endpoint, before) in renewals.items():
                if name not in renewed and await asyncio.to_thread(_renewals, endpoint) > before:
                    renewed[name] = self.demo.steps()
            await asyncio.sleep(0.5)
        authorizer = await asyncio.to_thread(scrape, self.demo.text("authorizer.metrics").strip())
        return {"nodes": sorted(renewals), "renewed": renewed, "authorizer": authorizer}

    async def refusals_counted(self) -> dict:
        """Every worker's metrics once all of its DHT peer's refusals of the member and the leases
        (read every heartbeat, so the two of a kind may land a beat apart) are in them."""
        deadline = time.monotonic() + 30
        while True:
            after = await self.scrape_workers()
            counted = [_dht_refused(after[name], reason) - _dht_refused(self.record["before"][name], reason) >= count
                       for name in after for reason, count in DHT_REFUSALS.items()]
            if all(counted) or time.monotonic() > deadline:
                return after
            await asyncio.sleep(0.2)


def _evidence(peer_id: str) -> Evidence:
    """What a trainer's verifier says of a worker it flags (here made up: a trainer may say anything)."""
    return Evidence(stage=0, kind="output", peer=peer_id, feature="log_rms", direction="high", cusum=31.5, value=2.3,
                    mean=2.1, centre=0.0, spread=0.1, replies=40)


def _dht_refused(samples: dict, reason: str) -> float:
    return by_label(samples, "agora_dht_refused_total", "reason").get(reason, 0.0)


def _renewals(endpoint: str) -> float:
    return scrape(endpoint)["agora_credential_renewals_total"][()]


def _counted(record: dict, name: str, metric: str) -> dict[str, float]:
    """What the attack added to a worker's counts of `metric` by reason."""
    before, after = (by_label(record[when][name], metric, "reason") for when in ("before", "after"))
    return {reason: value - before.get(reason, 0.0) for reason, value in after.items() if value > before.get(reason, 0.0)}


async def _refusal(call) -> tuple[str, str]:
    """(status code name, details) of a call the attacker expects refused ("OK" if it was not)."""
    try:
        await call
    except StageCallError as error:
        return error.code.name, error.details
    return "OK", ""


async def _watch(channel: grpc.aio.Channel):
    """A health Watch stream and its first answer: SERVING when admitted, the error otherwise."""
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    try:
        return stream, health_pb2.HealthCheckResponse.ServingStatus.Name((await stream.read()).status)
    except grpc.aio.AioRpcError as error:
        return stream, (error.code().name, error.details())


async def _admit_stranger(join: JoinFile, node: NodeCredentials):
    """The stranger's joins through the join file: as a trainer (refused), then as a worker of stage 0;
    (the refusal, the run it was admitted to)."""
    def fingerprint(served: dict) -> str:
        return run_fingerprint(config_from_dict(served)).text()

    try:
        await admit(join.authorizer, join.root_fingerprint, node, role="trainer", fingerprint=fingerprint)
        refused = None
    except AdmissionError as error:
        refused = str(error)
    info = await admit(join.authorizer, join.root_fingerprint, node, role="worker", stage=0,
                       announce=("127.0.0.1", free_port("127.0.0.1")), fingerprint=fingerprint)
    return refused, info


def _attack(demo: DemoRun, base: Path) -> dict:
    """Set the attacker up beside the starting run, mount every attack once the trainer has committed
    units, and return what it got."""
    join_path = demo.work / "authorizer" / "join.json"
    demo.wait_for(join_path.exists, what="the authorizer's join file", timeout_s=120)
    join = JoinFile.read(join_path)
    compromised_dir, stranger_dir = base / "compromised", base / "stranger"
    assert agora_node(["authorizer", "issue", "--state-dir", str(demo.work / "authorizer"), "--role", "trainer",
                       "--out", str(compromised_dir)]) == 0
    maddrs = demo.ready("bootstrap")
    with SwarmDHT.start(initial_peers=maddrs, client_mode=True,
                        security=DHTSecurity.from_state_dir(compromised_dir)) as compromised:
        workers = {name: Worker(name, stage, *demo.ready(name), demo.metrics_endpoint(name))
                   for name, stage in WORKERS.items()}
        demo.wait_for(lambda: demo.steps() >= 2, what="the trainer's first global batches", timeout_s=120)
        # Admitted now, the stranger's 20 s credential is fresh when the attacks begin (it renews after).
        refused_as_trainer, info = run_loop(_admit_stranger(join, NodeCredentials(stranger_dir, clock=time.time)))
        with SwarmDHT.start(initial_peers=maddrs, client_mode=True,
                            security=DHTSecurity.from_state_dir(stranger_dir)) as stranger:
            attacker = Attacker(demo, workers, stranger, compromised, stranger_dir, compromised_dir,
                                config_from_dict(info.config), join)
            record = run_loop(attacker.mount())
    record.update(refused_as_trainer=refused_as_trainer, admitted=info, workers=workers,
                  trainer=NodeCredentials(demo.work / "trainer-0.state", clock=time.time).peer_id,
                  compromised=NodeCredentials(compromised_dir, clock=time.time).peer_id,
                  admitted_peer=NodeCredentials(stranger_dir, clock=time.time).peer_id)
    return record


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    """The run, attacked, then left to finish: (demo, what the attacker got, exit code, summary)."""
    base = tmp_path_factory.mktemp("attacked")
    demo = DemoRun(base, "--stages", "2", "--replicas", "2", "--steps", str(STEPS), "--seed", "1",
                   "--credential-lifetime", str(LIFETIME_S), "--heartbeat", str(HEARTBEAT_S), "--no-monitor")
    try:
        record = _attack(demo, base)
        (base / "attacker.json").write_text(json.dumps(_plain(record), default=repr, indent=1))  # for a reader
        code, summary = demo.finish(240)
        yield demo, record, code, summary
    finally:
        demo.close()


async def _claim(board: LeaseBoard, unit: int, tries: int = 3) -> bool:
    """Claim `unit` as any trainer would: a claim whose store or read-back the loaded DHT missed
    (`claim` then says False and withdraws it) is tried again, like a trainer taking its next unit."""
    for _ in range(tries):
        if await board.claim(unit):
            return True
    return False


async def _report_held(tail: StageClient, unit: int, microbatches: int, tries: int = 3):
    """Report a unit the compromised trainer holds done, as a trainer would: refused as not its own (the
    worker's read of the queue missed the claim, or it refuses this caller from its one-second cache of
    refusals, node/worker/unit_holders.py), it is sent again once that second is over."""
    for attempt in range(tries):
        try:
            return await tail.batch_done(unit, microbatches, 2)
        except UnitNotHeld:
            if attempt == tries - 1:
                raise
            await asyncio.sleep(1.5 * REFUSAL_MEMORY_S)


def _plain(value):
    """`value` with every dictionary key a string (JSON's)."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    return [_plain(item) for item in value] if isinstance(value, (list, tuple)) else value


def _stats(demo: DemoRun) -> dict[str, dict]:
    return {name: json.loads(demo.text(f"{name}.stats.json")) for name in WORKERS}


def test_the_run_completes_and_trains_every_unit_exactly_once(attacked):
    demo, record, code, summary = attacked
    assert code == 0 and summary["outcome"] == "completed", demo.tail()
    assert set(summary["exit_codes"].values()) == {0} and summary["revoked"] == [], summary["exit_codes"]
    # The attacks came while it trained, and it trained on for a while after them.
    assert record["step_at_start"] >= 2 and record["step_at_end"] < STEPS - 10, record
    steps = [json.loads(line)["step"] for line in demo.text("trainer-0.jsonl").splitlines()]
    assert sorted(steps) == list(range(1, STEPS + 1))  # every unit once, none lost
    trainer = json.loads(demo.text("trainer-0.summary.json"))
    assert trainer["units"]["committed"] == STEPS and trainer["units"]["duplicate"] == 0, trainer["units"]
    assert trainer["units"]["conflict"] == 0 and trainer["revoked"] is None
    assert summary["repeats"] == 0  # no microbatch found a squatter's work applied in its place


def test_a_forged_member_and_a_forged_round_leave_the_stages_their_members_and_their_averaging(attacked):
    demo, record, _, summary = attacked
    # 1: every worker's DHT peer refused the stage-1 member of a stage-0 credential, and counted it.
    assert record["member"]["answers"] == {name: [False] for name in WORKERS}
    assert record["member"]["members"] == sorted(record["workers"][name].peer_id for name in TAILS)
    for name in WORKERS:
        assert _counted(record, name, "agora_dht_refused_total").get("workers") == 1, name
    assert summary["workers_per_stage"] == {"0": 2, "1": 2} and summary["rebalanced"] == []
    assert all([phase for phase, _ in history] == ["member"] for history in summary["phases_by_worker"].values())
    # 2: the round was stored (a stage-0 worker may announce its stage's rounds) and refused by both
    # readers of stage 0's schedule, once each, named in their logs.
    assert record["round"] is True
    stats = _stats(demo)
    for name, stage in WORKERS.items():
        assert stats[name]["refused_announcements"] == ({"past_schedule": 1} if stage == 0 else {}), name
        assert stats[name]["last_round"] < 20, name  # the schedule was kept: rounds of the run's own count
        assert (f"announcement of round {FAR_ROUND}" in demo.text(f"{name}.log")) == (stage == 0), name
        # Averaging went on committing after the attacks began.
        committed = log_lines_after(demo.text(f"{name}.log"), record["began"], r"averaging round=\d+ .*outcome=committed")
        assert len(committed) >= 2, (name, committed)


def test_leases_work_and_reports_are_taken_from_their_holders_and_bounded(attacked):
    demo, record, _, summary = attacked
    # 3: each hostile claim refused by every worker's DHT peer (two in its validator, two at its door).
    assert record["leases"]["answers"] == {hold: {name: answer for name in WORKERS}
                                           for hold, answer in LEASE_ANSWERS.items()}
    for name in WORKERS:
        counted = _counted(record, name, "agora_dht_refused_total")
        assert (counted.get("units.claims"), counted.get("units.updated_at")) == (2, 2), (name, counted)
    # 4: the squats were refused naming the unit's holder; nothing was applied (no repeats above).
    squat = record["squat"]
    for (committed, committed_says), (future, future_says) in squat["answers"].values():
        assert committed == "PERMISSION_DENIED", committed_says
        assert f"unit 0 is held by trainer {record['trainer']} (it committed it)" in committed_says
        assert future == "PERMISSION_DENIED", future_says  # nobody's yet, or the trainer's by now
        assert f"unit {squat['future']} is held by " in future_says
    # 5: reports of units it does not hold refused, one far ahead out of range; those it holds (a
    # trainer may report what it holds) counted, moving the tails by at most twice as many steps as
    # it sent the stage reports (one each, one of the credit each earned; a replica behind the other
    # catches up with it for free), and stage 0, which it sent none, not at all.
    push = record["push"]
    assert push["claimed"] == [True] * HELD
    for name in TAILS:
        tail = push[name]
        assert tail["far claimed"] and tail["far"][0] == "OUT_OF_RANGE" and "batches ahead" in tail["far"][1], tail
        assert tail["unheld"][0] == "PERMISSION_DENIED" and "held by no trainer" in tail["unheld"][1], tail
        refusals = _counted(record, name, "agora_worker_refusals_total")
        assert refusals.get("not_unit_holder", 0) >= 3 and refusals.get("report_outside_window", 0) >= 1, refusals
    steps = {name: stats["local_steps"] for name, stats in _stats(demo).items()}
    for name, stage in WORKERS.items():
        pushed = steps[name] - STEPS
        assert (0 < pushed <= 2 * HELD * len(TAILS)) if stage == 1 else (-2 <= pushed <= 0), steps


def test_the_authorizer_refuses_a_flood_from_one_network_while_every_node_renews(attacked):
    demo, record, _, summary = attacked
    assert "PERMISSION_DENIED: role: this run admits trainers with a credential from its operator only" in \
        record["refused_as_trainer"]
    assert record["admitted"].role == "worker" and record["admitted"].stage == 0
    flood = record["flood"]
    granted = [count for count, _ in flood["outcomes"]]
    refusals = [refusal for _, refusal in flood["outcomes"] if refusal is not None]
    assert sum(granted) <= CHALLENGE_SHARE and len(refusals) >= 3, flood["outcomes"]
    assert all(code == "RESOURCE_EXHAUSTED" and "network 127.0.0.0/24" in details for code, details in refusals)
    handled = flood["authorizer"]["agora_rpc_server_handled_total"]  # the authorizer counted them
    assert handled[(("code", "RESOURCE_EXHAUSTED"), ("method", "GetChallenge"))] >= len(refusals)
    # Every node renewed through it (4 workers and the trainer), none failed, none left.
    assert len(flood["nodes"]) == 5 and sorted(flood["renewed"]) == flood["nodes"], flood
    for name in [*WORKERS, "trainer-0"]:
        assert "credential renewal failed" not in demo.text(f"{name}.log"), name
    # The stranger renews like any node (admitted is admitted), until the compromised trainer's report.
    assert record["stranger_revoked"].startswith(f"banned: flagged by 1 trainer(s) ({record['compromised']})")


def test_only_a_trainer_reports_a_worker_and_its_report_bans_it_across_the_swarm(attacked):
    demo, record, _, summary = attacked
    report = record["report"]
    # 8: the stranger's worker credential may not report; the real worker it named is not banned.
    assert report["as_worker"] == ("PERMISSION_DENIED", "role: only a trainer reports workers; this is a worker "
                                                        "credential"), report
    # The compromised trainer's report banned the stranger (a trainer is trusted: the ban names it, for
    # the operator to audit and unban), through the signed ban list every worker holds.
    assert report["receipt"].banned and (report["receipt"].reporters, report["receipt"].needed) == (1, 1)
    assert report["banned_peers"] == {name: 1.0 for name in WORKERS}, report
    assert report["outcomes"] == {"permission_denied": 1.0, "banned": 1.0}, report
    bans = json.loads((demo.work / "authorizer" / "bans.json").read_text())
    assert [ban["peer_id"] for ban in bans] == [record["admitted_peer"]]
    assert record["compromised"] in bans[0]["reason"]


# Attack 5's residual (the module docstring): each report of a held unit steps a tail on what it has
# accumulated of the honest trainer's batch and moves its count, four in a second. In some runs a tail so
# stepped answered one Forward with an input gradient past the trainer's scale bound, refused and rerun
# (seen in three runs, each within a second of the reports landing). That is the reply check doing its
# job on a tail the attack moved, not a credential or a call failing; why the tail's gradient jumps is
# open (issue 30's note).
SCALE_REFUSAL = "times the median of stage 1's recent replies"


def test_every_node_renews_its_short_credential_across_the_run_without_a_failed_call(attacked):
    """20 s credentials renew every 8-10 s, so every process renews at least twice while calls are
    in flight (and the attacks are mounted): the trainer never fails a call or a report (but for
    attack 5's residual above), and each worker's TLS server presents its renewed certificate from
    then on."""
    demo, record, _, summary = attacked
    trainer = json.loads(demo.text("trainer-0.summary.json"))
    reroutes = [line for line in demo.text("trainer-0.log").splitlines() if "reroute microbatch" in line]
    residual = [line for line in reroutes if "DATA_LOSS" in line and SCALE_REFUSAL in line]
    failed = (summary["reroutes"], reroutes, trainer["failures_by_peer"], trainer.get("extreme_replies_by_peer"))
    assert summary["security"] == "admitted" and summary["revoked"] == []
    assert len(residual) <= 1 and summary["reroutes"] == len(residual), failed
    tails = {record["workers"][name].peer_id for name in TAILS}
    assert set(trainer["failures_by_peer"]) <= tails and sum(trainer["failures_by_peer"].values()) == len(residual), failed
    assert trainer["batch_reports_failed"] == 0 and sum(trainer["aborts"].values()) <= 2 * len(residual), trainer["aborts"]
    assert trainer["credential_renewals"] >= 2, trainer
    assert summary["credential_renewals"]["trainers"] == trainer["credential_renewals"]
    renewals = {}
    for name in WORKERS:
        text = demo.text(f"{name}.log")
        renewals[name] = text.count("renewed the credential")
        assert "serving the renewed credential" in text, name
        assert "credential renewal failed" not in text and "credential revoked" not in text, name
    assert min(renewals.values()) >= 2, renewals
    assert summary["credential_renewals"]["workers"] == sum(renewals.values())


def test_a_watch_flood_takes_the_probe_pool_and_none_of_the_trainers_calls(attacked):
    demo, record, _, summary = attacked
    watch = record["watch"]
    half = PROBE_POOL // 2
    assert watch["stranger"][:half] == ["SERVING"] * half and watch["compromised"][:half] == ["SERVING"] * half
    for code, details in watch["stranger"][half:]:
        assert code == "RESOURCE_EXHAUSTED" and f"at most {half} per caller" in details
    for code, details in watch["compromised"][half:]:
        assert code == "RESOURCE_EXHAUSTED" and f"serves at most {PROBE_POOL} health and reflection calls" in details
    refusals = _counted(record, WATCH_TARGET, "agora_worker_refusals_total")
    assert (refusals.get("probe_caller_limit"), refusals.get("probe_full")) == (2, 1), refusals
    # Meanwhile the trainer's calls were served: it completed global batches with the pool full.
    assert watch["steps"][1] >= watch["steps"][0] + 2
