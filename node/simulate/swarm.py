"""The simulated swarm: a scenario's nodes built, run for its seconds, and what came of it.

`simulate(scenario)` builds the workers (replicas per stage, each on a link drawn by share, its
speed within the spread), the trainers, the lease board and the averaging, starts the churn
(Poisson arrivals, exponential lifetimes, the scenario's kills) and the rebalancing check, runs
simpy to `run.seconds`, and returns a `SimulationResult`. Every random draw comes from one
`random.Random(run.seed)`, so a scenario and its seed give the same result.

Membership, with the project's rules (node/membership/): a newcomer is admitted and joins the DHT,
starts where `entry_phase` says, downloads its stage's state from the donor `plan_donors` names
over their links, then syncs (workers.py) until `next_phase` makes it a member. An arrival joins the
stage `stage_coverage` (rebalance.py) finds least covered. Every `interval_s` each member asks
`plan_move` once nothing has changed for `settle_intervals` checks (its throughputs are noiseless,
so the settle period only delays moves, as it does in the real swarm); a plan that holds for
`confirmations` checks in a row moves it (one at a time in the swarm): it leaves and joins the
target stage as a newcomer. A leaving worker finishes the calls it holds (a clean leave, as on
SIGTERM); the simulator does not model a kill's lost calls.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Callable, Optional

import simpy

from agora.dht.records import Phase
from agora.node.membership.phases import SyncPolicy, entry_phase
from agora.node.membership.rebalance import RebalancePolicy, plan_move, stage_coverage
from agora.node.membership.state_download import plan_donors
from agora.node.replica.epoch import DEFAULT_REPORT_AHEAD
from agora.dht.round_board import announcers
from agora.node.simulate.background import background, heartbeat, host_background, probing
from agora.node.simulate.host import SharedCores
from agora.node.simulate.network import NodeLink, at_size, dht_cpu_s, dht_op_s, first_holder_s, path_rtt_s, transmit
from agora.node.simulate.results import SimulationResult, summarize
from agora.node.simulate.scenario import Scenario
from agora.node.simulate.trainer import CallCosts, SimTrainer
from agora.node.simulate.units import SimLeaseBoard
from agora.node.simulate.workers import SimWorker, StageRounds
from agora.node.trainer.inflight import adaptive_depth, in_flight_limit
from agora.node.trainer.options import TrainerOptions
from agora.node.worker.flow import FlowControl
from agora.pipeline.config import SyncConfig

__all__ = ["SimSwarm", "simulate"]

_LEASE_S = 30.0
_UNITS = 10_000_000  # the schedule is longer than any simulation runs
_RETRY_S = 5.0  # a weight sync with no member to download from asks again this often (phases.py's retry_s)


class SimSwarm:
    def __init__(self, scenario: Scenario):
        self.scenario = s = scenario
        self.env = simpy.Environment()
        self.rng = random.Random(s.run.seed)
        self.version = 0
        self.workers: dict[str, SimWorker] = {}
        self.joins: list[SimWorker] = []  # newcomers, in order of arrival
        self.departures = 0
        self.moves = 0
        self._moving: Optional[str] = None
        self._plans: dict[str, tuple[int, int]] = {}  # peer -> (target, checks in a row)
        self._serial = 0
        self.cores = SharedCores(self.env, s.compute.shared_cores) if s.compute.shared_cores else None
        sync = SyncConfig(method=s.averaging.method, every_steps=s.averaging.every_steps,
                          fraction=s.averaging.fraction)
        self.n_slices = sync.n_slices if s.averaging.method != "none" else 0
        self.policy = SyncPolicy(optimizer_sync_steps=s.averaging.optimizer_sync_steps)
        self.rebalance = RebalancePolicy()
        self.rounds = StageRounds(self.env, every_steps=s.averaging.every_steps, n_slices=max(1, self.n_slices),
                                  vector_bytes=s.averaging.vector_bytes, window_s=s.averaging.matchmaking_s,
                                  matchmaking=self._matchmaking, live=self._live_replicas,
                                  policy=self.policy, enabled=s.averaging.method != "none",
                                  cpu=lambda seconds: self.compute(seconds, since=self.env.now),
                                  allreduce_cpu=(s.averaging.allreduce_cpu_ms_per_peer / 1000.0,
                                                 s.averaging.allreduce_cpu_ns_per_byte / 1e9),
                                  start_offset=self._start_offset())
        self.board = SimLeaseBoard(self.env, total=_UNITS, lease_s=_LEASE_S, dht_op=self.dht_op)
        self.trainer_count = s.trainers.count if s.run.batch_s is None else 0
        self.batches: list[tuple[float, int]] = []  # the batch clock's global batches
        options = TrainerOptions(run_id="simulated", max_staleness=s.trainers.max_staleness,
                                 max_in_flight=s.trainers.max_in_flight)
        costs = CallCosts(tokens=s.run.tokens_per_microbatch,
                          forward_bytes=s.wire.forward_bytes_per_token * s.run.tokens_per_microbatch,
                          backward_bytes=s.wire.backward_bytes_per_token * s.run.tokens_per_microbatch,
                          overhead_s=s.compute.call_overhead_ms / 1000.0)
        trainer_link = s.link(s.trainers.link)
        self.trainers = [SimTrainer(self.env, f"trainer-{i}", i, NodeLink.on(self.env, trainer_link, s.run.warmup_s), self,
                                    s.run.stages, s.run.microbatches, in_flight_limit(options, s.run.microbatches),
                                    adaptive_depth(options), s.trainers.cpu_ms / 1000.0, costs, s.workers.credits)
                         for i in range(self.trainer_count)]
        for stage in range(s.run.stages):
            for replica in range(s.workers.replicas):
                slowdown = s.workers.slowdown[replica % len(s.workers.slowdown)]
                self._add_worker(stage, self._speed() * slowdown, self._draw_link(), Phase.MEMBER)
        for worker in list(self.workers.values()):
            self._between_rounds(worker)
        if s.compute.background_cpu_ms_per_s and self.cores is not None:
            self.env.process(host_background(self, s.compute.background_cpu_ms_per_s / 1000.0))

    def _start_offset(self) -> Optional[Callable[[], float]]:
        """Draws of the measured start offsets (their own random stream: the rest of the run draws the
        same with or without them), or None where none are given."""
        offsets = self.scenario.averaging.start_offsets_s
        if not offsets:
            return None
        draws = random.Random(self.scenario.run.seed + 1)
        return lambda: draws.choice(offsets)

    def _between_rounds(self, worker: SimWorker) -> None:
        """The worker's traffic between rounds, where the scenario simulates it (background.py)."""
        s = self.scenario
        if s.averaging.between_rounds and s.averaging.method != "none":
            self.env.process(probing(self, worker))
        if s.workers.heartbeat_s > 0:
            phase = self.rng.uniform(0.0, s.workers.heartbeat_s)
            self.env.process(heartbeat(self, worker, s.workers.heartbeat_s, phase, s.workers.heartbeat_reads_bans))
        if s.workers.background_cpu_ms_per_s_at and self.cores is not None:
            self.env.process(background(self, worker, at_size(s.workers.background_cpu_ms_per_s_at, self.nodes())
                                        / 1000.0))

    # ------------------------------------------------------------------ nodes
    def nodes(self) -> int:
        return len(self.trainers) + sum(1 for w in self.workers.values() if w.alive)

    def dht_op_s(self, kind: str = "get") -> float:
        return dht_op_s(self.scenario.dht, self.nodes(), kind)

    def dht_op(self, kind: str = "get"):
        """A simpy process: one DHT operation, its CPU on the host's cores (where the scenario gives
        one: a loaded host's operations wait for a core) and then its latency."""
        cpu = dht_cpu_s(self.scenario.dht, self.nodes())
        if cpu > 0:
            yield from self.compute(cpu, since=self.env.now)
        yield self.env.timeout(self.dht_op_s(kind))

    def _matchmaking(self, worker: SimWorker):
        """A simpy process: a replica's DHT operations before it joins a round's group. Where the loop's
        traffic between rounds is simulated, first what node/averaging/loop.py's `run_round` does: the
        round's announcers store their announcement beside the round (not waited for), and the live
        replicas are read first when the probes' schedule says the count is due. Then
        `matchmaking_dht_ops`, a store with a read at a time (workers.py's `StageRounds` says which),
        then, where measured, the rest of its matchmaking's CPU at the stage's live replicas and one
        read's latency."""
        averaging = self.scenario.averaging
        if averaging.between_rounds and worker.probes is not None:
            peers = [w.peer_id for w in self.workers.values() if w.alive and w.stage == worker.stage]
            if worker.peer_id in announcers(worker.last_round, peers):
                self.env.process(self.dht_op("store"))
            if worker.probes.replicas_due(self.env.now):
                yield from self.dht_op("get")
                worker.probes.replicas_read(self.env.now, self._live_replicas(worker.stage))
        count = averaging.matchmaking_dht_ops
        for first in range(0, count, 2):
            pair = ("store", "get")[:min(2, count - first)]
            yield self.env.all_of([self.env.process(self.dht_op(kind)) for kind in pair])
        if averaging.matchmaking_cpu_ms_at:
            yield from self.compute(at_size(averaging.matchmaking_cpu_ms_at, self._live_replicas(worker.stage))
                                    / 1000.0, since=self.env.now)
            yield self.env.timeout(self.dht_op_s("get"))

    def _live_replicas(self, stage: int) -> int:
        """The round board's count (dht/round_board.py's `replicas`): the stage's live workers."""
        return sum(1 for w in self.workers.values() if w.alive and w.stage == stage)

    def _draw_link(self):
        kinds = [link for link in self.scenario.links if link.share > 0]
        return self.rng.choices(kinds, weights=[k.share for k in kinds])[0]

    def _speed(self) -> float:
        spread = self.scenario.workers.speed_spread
        return 1.0 + self.rng.uniform(-spread, spread) if spread else 1.0

    def _job_s(self, stage: int, speed: float) -> tuple[float, float]:
        total = self.scenario.compute.ms[stage] / 1000.0 * speed
        if stage == self.scenario.run.stages - 1:
            return total, 0.0
        forward = total * self.scenario.compute.forward_share
        return forward, total - forward

    def _add_worker(self, stage: int, speed: float, link, phase: str) -> SimWorker:
        self._serial += 1
        worker = SimWorker(f"worker-{self._serial:05d}", stage, NodeLink.on(self.env, link), self._job_s(stage, speed),
                           simpy.Resource(self.env, capacity=1), phase=phase, started_at=self.env.now,
                           flow=FlowControl(1, None, clock=lambda: self.env.now))
        worker.speed = speed
        worker.history.append((phase, 0.0))
        self.workers[worker.peer_id] = worker
        self.version += 1
        return worker

    def compute(self, seconds: float, since: float):
        """A simpy process: `seconds` of compute, on the host's shared cores when the scenario shares
        them; its value is the time waited since `since` before it began."""
        waited = self.env.now - since
        if self.cores is None:
            yield self.env.timeout(seconds)
        else:
            yield from self.cores.run(seconds)
        return waited

    def call_cpu(self, stage: int):
        """A simpy process: a call's CPU at `stage`'s worker besides its job (`compute.call_cpu_ms`)."""
        cpu = self.scenario.compute.call_cpu_ms
        if cpu and cpu[stage] > 0:
            yield from self.compute(cpu[stage] / 1000.0, since=self.env.now)

    def step_s(self, worker: SimWorker) -> float:
        """A replica's optimizer step on its executor (its speed applies)."""
        steps = self.scenario.compute.step_ms
        return steps[worker.stage] / 1000.0 * worker.speed if steps else 0.0

    def measured(self, seconds: float) -> float:
        """Busy time that counts toward utilization (none during the warm-up)."""
        return seconds if self.env.now >= self.scenario.run.warmup_s else 0.0

    # ------------------------------------------------------------------ membership
    def leave(self, worker: SimWorker) -> None:
        if worker.alive:
            worker.alive = False
            worker.left_at = self.env.now
            self.departures += 1
            self.version += 1

    def newcomer(self, stage: int, link, speed: float):
        """A simpy process: one replica's start and admission, its first reads (every stage's records,
        node/membership/state_download.py's `plan_donors` naming a donor), its entry, its first
        announcement (a store: then others see it) beside its download, and its sync."""
        s = self.scenario.churn
        began = self.env.now
        yield self.env.timeout(s.admission_s)
        for _ in range(s.join_dht_ops):  # a fresh node's reads open their connections first
            yield self.env.timeout(s.dial_rtts * link.rtt_ms / 1000.0)
            yield from self.dht_op()
        plan = self._donor_plan(stage)
        run_step = max((w.steps for w in self.workers.values() if w.alive and w.phase == Phase.MEMBER), default=None)
        phase = entry_phase(own_step=0, resumed_phase=None, donor_steps=[d.step for d in plan.donors],
                            policy=self.policy, run_step=run_step)
        worker = self._add_worker(stage, speed, link, Phase.WEIGHT_SYNC)
        self._between_rounds(worker)
        worker.started_at = began
        worker.history = []
        worker.enter(phase, self.env.now)
        self.joins.append(worker)
        self.env.process(self._announce(worker))
        if plan.donors:
            worker.donor_at = self.env.now - began
        if phase == Phase.MEMBER:
            worker.state_at = self.env.now - began
            return
        empty_since = self.env.now
        while not plan.donors:  # SyncPhases.download: ask again, and after empty_stage_wait_s be the stage's state
            if self.env.now - empty_since >= self.policy.empty_stage_wait_s:
                worker.enter(Phase.MEMBER, self.env.now)
                worker.state_at = self.env.now - began
                return
            yield self.env.timeout(_RETRY_S)
            plan = self._donor_plan(stage)
        if worker.donor_at is None:
            worker.donor_at = self.env.now - began
        donor = self.workers[plan.donors[0].peer_id]
        yield from transmit(self.env, donor.link, worker.link, s.state_bytes)
        yield self.env.timeout(s.state_load_s)
        worker.downloaded = True
        worker.steps, worker.last_round = donor.steps, donor.last_round
        worker.state_at = self.env.now - began
        worker.advance(self.policy, max(1, self.n_slices), self.env.now)
        self.version += 1

    def _donor_plan(self, stage: int):
        """`plan_donors` over what the workers' records say (their queues are not simulated: ties at random)."""
        by_stage: dict = {}
        for w in self.workers.values():
            if w.alive:
                by_stage.setdefault(w.stage, []).append(
                    SimpleNamespace(peer_id=w.peer_id, endpoint="", step=w.steps, queue_depth=0, phase=w.phase))
        return plan_donors(by_stage, stage, "", self.rng, max_gap=DEFAULT_REPORT_AHEAD)

    def _announce(self, worker: SimWorker):
        """A newcomer's first record: a store, readable once its first holder has it
        (network.py's `first_holder_s`); nothing waits for the store's return."""
        cpu = dht_cpu_s(self.scenario.dht, self.nodes())
        if cpu > 0:
            yield from self.compute(cpu, since=self.env.now)
        yield self.env.timeout(first_holder_s(self.scenario.dht, self.nodes(), path_rtt_s(worker.link, worker.link)))
        worker.visible_at = self.env.now - worker.started_at

    def _least_covered(self) -> int:
        coverage = stage_coverage(self._records(), self.scenario.run.stages)
        return min(coverage, key=lambda stage: (coverage[stage], stage))

    def _records(self) -> dict:
        """What the workers' DHT records say: the fields rebalancing reads."""
        by_stage: dict = {}
        for w in self.workers.values():
            if w.alive:
                jobs = 1 if w.stage == self.scenario.run.stages - 1 else 2
                rate = self.scenario.run.tokens_per_microbatch * jobs / sum(w.job_s)
                by_stage.setdefault(w.stage, []).append(
                    SimpleNamespace(peer_id=w.peer_id, stage=w.stage, phase=str(w.phase), throughput=rate))
        return by_stage

    def _lifetime(self, worker: SimWorker):
        hours = self.scenario.churn.mean_lifetime_h
        yield self.env.timeout(self.rng.expovariate(1.0 / (hours * 3600.0)))
        self.leave(worker)

    def _arrivals(self):
        rate = self.scenario.churn.arrivals_per_hour / 3600.0
        while True:
            yield self.env.timeout(self.rng.expovariate(rate))
            self.env.process(self._arrive(self._least_covered()))

    def _arrive(self, stage: int):
        yield from self.newcomer(stage, self._draw_link(), self._speed())
        if self.scenario.churn.mean_lifetime_h > 0:
            self.env.process(self._lifetime(self.joins[-1]))

    def _kill(self, at: float, turn: int):
        yield self.env.timeout(at)
        stage = turn % self.scenario.run.stages
        victims = sorted((w for w in self.workers.values() if w.alive and w.stage == stage),
                         key=lambda w: (w.started_at, w.peer_id))
        if victims:
            self.leave(victims[0])
            yield from self.newcomer(stage, victims[0].link.kind, victims[0].speed)

    def _join(self, at: float):
        yield self.env.timeout(at)
        yield from self._arrive(self._least_covered())

    def _rebalancing(self):
        checked, seen, quiet = -1, -1, 0
        while True:
            yield self.env.timeout(self.rebalance.interval_s)
            if self._moving is not None or seen != self.version:
                seen, quiet = self.version, 0  # a change: the swarm settles again first (rebalance.py's Settling)
                self._plans.clear()
            quiet += 1
            if quiet < self.rebalance.settle_intervals or (checked == self.version and not self._plans):
                continue  # nothing changed since a check that planned nothing: it would plan nothing again
            checked = self.version
            records = self._records()
            for w in list(self.workers.values()):
                if not w.alive:
                    continue
                move = plan_move(records, self.scenario.run.stages, w.peer_id, str(w.phase), self.rebalance)
                if move is None:
                    self._plans.pop(w.peer_id, None)
                    continue
                target, count = self._plans.get(w.peer_id, (move.target, 0))
                count = count + 1 if target == move.target else 1
                self._plans[w.peer_id] = (move.target, count)
                if count >= self.rebalance.confirmations:
                    self._plans.clear()
                    self.env.process(self._move(w, move.target))
                    break

    def _move(self, worker: SimWorker, target: int):
        self._moving = worker.peer_id
        self.moves += 1
        self.leave(worker)
        self.departures -= 1  # a move is not a departure
        yield from self.newcomer(target, worker.link.kind, worker.speed)
        self._moving = None

    # ------------------------------------------------------------------ the run
    def _batch_clock(self, batch_s: float):
        """Global batches at a stated pace instead of simulated microbatches (days of churn): every
        routable replica got a share of each, and every replica is told of it."""
        tokens = self.scenario.run.tokens_per_microbatch * self.scenario.run.microbatches
        while True:
            yield self.env.timeout(batch_s)
            told = [w for w in self.workers.values() if w.alive]
            for worker in told:
                worker.got_microbatches += int(worker.routable)
                self.rounds.stepped(worker, tokens)
            self.batches.append((self.env.now, tokens))

    def _start_trainer(self, trainer: SimTrainer, at_s: float):
        if at_s > 0:
            yield self.env.timeout(at_s)
        yield from trainer.run()

    def run(self) -> SimulationResult:
        s = self.scenario
        if s.run.batch_s is not None:
            self.env.process(self._batch_clock(s.run.batch_s))
        for index, trainer in enumerate(self.trainers):
            self.env.process(self._start_trainer(trainer, index * s.trainers.start_every_s))
        if s.churn.arrivals_per_hour > 0:
            self.env.process(self._arrivals())
        if s.churn.mean_lifetime_h > 0:
            for worker in list(self.workers.values()):
                self.env.process(self._lifetime(worker))
        for turn, at in enumerate(s.churn.kill_at_s):
            self.env.process(self._kill(at, turn))
        for at in s.churn.join_at_s:
            self.env.process(self._join(at))
        if s.run.stages > 1:
            self.env.process(self._rebalancing())
        self.env.run(until=s.run.seconds)
        return summarize(self)


def simulate(scenario: Scenario) -> SimulationResult:
    """Run one scenario (see the module docstring)."""
    return SimSwarm(scenario).run()
