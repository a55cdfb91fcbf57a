"""Simulated stage replicas: compute, steps, averaging rounds and the sync phases of a joiner.

A `SimWorker` computes one job at a time (its executor thread); with `shared_cores` every job also
holds one of the host's cores (the emulation harness ran every process on one machine). What it
does between jobs is the project's own decisions, called with what it has observed:

- Steps: a completed-batch report steps every replica of the stage (as node/replica/epoch.py counts
  a unit once). After each, `next_round` (node/averaging/sparta.py) says whether a round is due;
  the stage's first replica to reach a round announces it, so the others start it too (the fastest
  sets the pace), and a round that comes due while one runs is skipped.
- Rounds (`StageRounds`): a replica that counts itself alone on the stage (the round board's live
  replicas, node/averaging/loop.py) is `alone` at once. Otherwise it makes its matchmaking's DHT
  operations (swarm.py's `_matchmaking`: where the loop's traffic is simulated, the loop's own by
  its rules; then the scenario's, two at a time, such as hivemind's declaration with its read of
  the declared averagers; or, where the scenario gives hivemind's part as measured CPU, that CPU
  and one read's latency), and joins the round's leader:
  the replica that started the round first (hivemind's matchmaking follows the earliest declared
  expiration). The group forms when every live replica the leader expects has joined (dht/averaging.py
  makes that count the matchmaking target), or when the leader's window (`matchmaking_s`) closes
  with whoever joined; one that joins later is alone. Each member's formation is the group's forming
  less its own start, as `RoundResult.formation_s`. The all-reduce then takes each member's CPU
  (a cost per other member and per byte it sends, as bench/allreduce_cost.py measured them: its
  averager process and p2pd serializing, sending, reducing), all members at once on the shared
  cores where the scenario shares them, then dht/averaging.py's `estimated_bytes` per peer over the
  slowest member's link and two round trips. A group of one commits nothing. Its slice is
  `round_slice`.
- Phases: a newcomer's entry (`entry_phase`) and every move on (`next_phase`) are
  node/membership/phases.py's pure rules, fed the steps, updates, rounds and slices it observed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generator, Optional

import simpy

from agora.dht.averaging import estimated_bytes
from agora.dht.records import TRAINING_PHASES, Phase
from agora.node.averaging.sparta import next_round, round_slice
from agora.node.membership.phases import SyncPolicy, SyncProgress, next_phase
from agora.node.simulate.network import NodeLink, path_rtt_s
from agora.node.worker.flow import FlowControl

__all__ = ["SimWorker", "StageRounds", "RoundLog"]


@dataclass
class RoundLog:
    stage: int
    number: int
    started: float
    seconds: float
    group: int
    committed: bool
    formations: tuple = ()  # each member's start to the group's forming, s
    durations: tuple = ()  # each member's start to the round's end, s


@dataclass
class _Forming:
    """A round's group while it forms: the leader's expectation and window, who joined in time."""

    expected: int
    closes_at: float
    formed: simpy.Event
    joined: list = field(default_factory=list)  # (replica, its start), in order of joining


@dataclass(eq=False)
class SimWorker:
    peer_id: str
    stage: int
    link: NodeLink
    job_s: tuple[float, float]  # Forward, Backward (the tail: its one fused call, then 0)
    compute: simpy.Resource
    phase: str = Phase.MEMBER
    started_at: float = 0.0
    alive: bool = True
    steps: int = 0
    busy_s: float = 0.0
    samples_since_round: int = 0
    last_round: int = 0
    rounding: bool = False
    # what a syncing replica has observed since its phase began (SyncProgress's fields)
    downloaded: bool = False
    phase_steps: int = 0
    phase_updates: int = 0
    rounds: int = 0
    slices_averaged: set = field(default_factory=set)
    got_microbatches: int = 0  # in the global batch now running
    # a newcomer's times from its start: a donor named, its first record at a holder, its stage's state held
    donor_at: Optional[float] = None
    visible_at: Optional[float] = None
    state_at: Optional[float] = None
    history: list = field(default_factory=list)  # (phase, seconds since its start)
    woken: Optional[simpy.Event] = field(default=None, repr=False)  # a step counted or a round ended
    # Its callers as the worker counts them (node/worker/flow.py, on simulated time): a reply says how many.
    flow: Optional[FlowControl] = field(default=None, repr=False)  # on the simulation's clock (SimSwarm sets it)
    probes: Optional[object] = field(default=None, repr=False)  # its loop's ProbeSchedule, where between rounds is simulated

    def wait_wake(self, env: simpy.Environment) -> simpy.Event:
        """An event that fires at the replica's next step or round end (its loop's wake-ups)."""
        if self.woken is None or self.woken.triggered:
            self.woken = env.event()
        return self.woken

    def wake(self) -> None:
        if self.woken is not None and not self.woken.triggered:
            self.woken.succeed()

    @property
    def routable(self) -> bool:
        return self.alive and self.phase in TRAINING_PHASES

    @property
    def per_job_s(self) -> float:
        jobs = [s for s in self.job_s if s > 0]
        return sum(jobs) / len(jobs)

    def enter(self, phase: str, now: float) -> None:
        self.phase = phase
        self.phase_steps = self.phase_updates = 0
        self.history.append((phase, now - self.started_at))

    def progress(self, n_slices: int) -> SyncProgress:
        return SyncProgress(Phase(self.phase), self.downloaded, self.phase_steps, self.phase_updates, self.rounds,
                            frozenset(self.slices_averaged), n_slices)

    def advance(self, policy: SyncPolicy, n_slices: int, now: float) -> None:
        """Move on through the sync phases for as long as `next_phase` says so."""
        while self.phase in (Phase.WEIGHT_SYNC, Phase.OPTIMIZER_SYNC):
            move = next_phase(self.progress(n_slices), policy)
            if move is None:
                return
            self.enter(move[0], now)


class StageRounds:
    """The averaging rounds of every stage: groups, durations, and what each round did."""

    def __init__(self, env: simpy.Environment, *, every_steps: int, n_slices: int, vector_bytes: int,
                 window_s: float, matchmaking: Callable[[SimWorker], Generator], live: Callable[[int], int],
                 policy: SyncPolicy, enabled: bool, cpu: Callable[[float], Generator] = None,
                 allreduce_cpu: tuple[float, float] = (0.0, 0.0), start_offset: Callable[[], float] = None):
        self.env, self.every_steps, self.n_slices = env, every_steps, n_slices
        self.vector_bytes, self.window_s, self.policy, self.enabled = vector_bytes, window_s, policy, enabled
        self.matchmaking, self.live = matchmaking, live
        self.cpu = cpu  # a simpy process taking that many CPU seconds (on the shared cores, if any)
        self.allreduce_cpu = allreduce_cpu  # (s per other member, s per byte sent)
        self.start_offset = start_offset  # a replica's start of a round behind the round's first (s), drawn
        self.announced: dict[int, int] = {}  # stage -> highest round announced
        self._forming: dict[tuple[int, int], _Forming] = {}
        self.log: list[RoundLog] = []

    def stepped(self, worker: SimWorker, tokens: int) -> None:
        """A completed-batch report reached `worker`: count the step, maybe start a round."""
        worker.steps += 1
        worker.samples_since_round += tokens
        worker.phase_steps += 1
        worker.phase_updates += int(worker.got_microbatches > 0)
        worker.got_microbatches = 0
        worker.advance(self.policy, self.n_slices, self.env.now)
        if not self.enabled or worker.rounding:
            worker.wake()
            return
        decision = next_round(worker.steps, self.every_steps, worker.last_round, self.announced.get(worker.stage))
        if decision.round is None:
            worker.wake()
            return
        worker.last_round = decision.round
        self.announced[worker.stage] = max(self.announced.get(worker.stage, 0), decision.round)
        worker.rounding = True
        self.env.process(self._round(worker, decision.round))
        worker.wake()

    def _round(self, worker: SimWorker, number: int):
        worker.rounding = True
        if self.start_offset is not None:  # what sets the replicas' starts apart on a shared host
            yield self.env.timeout(self.start_offset())
        started, key = self.env.now, (worker.stage, number)
        if self.live(worker.stage) <= 1:
            self._ended([(worker, started)], number, started, formed_at=None)
            return
        forming = self._forming.get(key)
        if forming is None:  # this replica leads: the first to start the round
            forming = self._forming[key] = _Forming(self.live(worker.stage), started + self.window_s,
                                                    self.env.event())
            self.env.process(self._window(key, forming))
        yield from self.matchmaking(worker)
        if forming.formed.triggered:  # the leader formed the group without it
            self._ended([(worker, started)], number, started, formed_at=None)
            return
        forming.joined.append((worker, started))
        if len(forming.joined) >= forming.expected:
            self._form(key, forming)
        yield forming.formed
        if forming.joined[0][0] is not worker:
            return  # the first to join times the all-reduce for the whole group
        formed_at = self.env.now
        members = [w for w, _ in forming.joined if w.alive]
        cpu = self.allreduce_cpu_s(len(members))
        if cpu > 0 and self.cpu is not None:
            yield self.env.all_of([self.env.process(self.cpu(cpu)) for _ in members])
        slowest = max((estimated_bytes(self.vector_bytes, len(members)) * 8 /
                       min(w.link.kind.up_mbit, w.link.kind.down_mbit) / 1e6 for w in members), default=0.0)
        rtt = max((path_rtt_s(a.link, b.link) for a in members for b in members), default=0.0)
        yield self.env.timeout(slowest + (2 * rtt if len(members) > 1 else 0.0))
        self._ended([(w, at) for w, at in forming.joined if w.alive], number, started, formed_at)

    def allreduce_cpu_s(self, group: int) -> float:
        """One member's all-reduce CPU in a group of `group` (none alone)."""
        if group <= 1:
            return 0.0
        per_peer, per_byte = self.allreduce_cpu
        return per_peer * (group - 1) + per_byte * estimated_bytes(self.vector_bytes, group)

    def _window(self, key: tuple[int, int], forming: _Forming):
        yield self.env.timeout(max(0.0, forming.closes_at - self.env.now))
        if not forming.formed.triggered:
            self._form(key, forming)

    def _form(self, key: tuple[int, int], forming: _Forming) -> None:
        self._forming.pop(key, None)
        forming.formed.succeed()

    def _ended(self, members: list, number: int, started: float, formed_at: Optional[float]) -> None:
        """Log the round and release its members (a group of one commits nothing; of none, whose
        members all left meanwhile, there is nothing to log)."""
        if not members:
            return
        committed = len(members) > 1
        now = self.env.now
        self.log.append(RoundLog(members[0][0].stage, number, started, now - started, len(members), committed,
                                 tuple(formed_at - at for _, at in members) if formed_at is not None else (),
                                 tuple(now - at for _, at in members)))
        for member, _ in members:
            member.rounding = False
            member.samples_since_round = 0
            if member.downloaded:
                member.rounds += 1
                if committed:
                    member.slices_averaged.add(round_slice(number, self.n_slices))
            member.advance(self.policy, self.n_slices, self.env.now)
            member.wake()
