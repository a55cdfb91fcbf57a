"""A replica's DHT traffic between its averaging rounds (`averaging.between_rounds`, `workers.heartbeat_s`).

On a host whose cores every node shares (the many-node harnesses), what the replicas do between
rounds takes the cores their rounds need. Each operation is the swarm's `dht_op` (its CPU on the
shared cores, then its latency):

- Probes of the round board (node/averaging/loop.py): on node/averaging/probes.py's schedule, with
  the intervals `probe_intervals` gives the matchmaking window; two reads (the announcements and the
  live replicas) while the replica's step count moves and its count is due (older than the
  schedule's `settled_s`, or `replicas_s` when it counted itself alone: the simulated count is the
  stage's live replicas, never wrong, so nothing else puts it in doubt), else one. The loop runs one thing at a
  time, so none while a round runs; the probe due at a round's step is the matchmaking's read of the
  live replicas (workers.py's `StageRounds`), counted there. After each round the loop stores that
  it left it (`RoundBoard.close`) beside its next wait, if it is one of the round's announcers
  (dht/round_board.py's `announcers` of the stage's live replicas).
- The worker's heartbeat (dht/heartbeat.py's `beat`): every `heartbeat_s` from a phase of its own
  (drawn: replicas start at different times), a read of the ban list (an admitted swarm's: an
  insecure one has none, `workers.heartbeat_reads_bans`), then its record's store.
- What a replica's processes burn besides (`workers.background_cpu_ms_per_s_at`, measured on idle
  replicas: hivemind's and p2pd's upkeep, the processes' polls): a share of it every half second.
- What the whole host burns besides the simulated jobs (`compute.background_cpu_ms_per_s`, measured
  over a run: every role's p2pd and DHT process, the supervisor, an emulated link's relay): the same,
  for as long as the simulation runs.
"""

from __future__ import annotations

from typing import Callable

from agora.dht.round_board import announcers
from agora.node.averaging.probes import ProbeSchedule, probe_intervals
from agora.node.simulate.workers import SimWorker

__all__ = ["background", "heartbeat", "host_background", "probing"]

_BACKGROUND_EVERY_S = 0.5

_DUE_NOW_S = 0.001  # loop.py's _TIMER_RESOLUTION_S


def probing(swarm, worker: SimWorker):
    """A simpy process: the replica's probes and round closes, as long as it lives."""
    env = swarm.env
    schedule = worker.probes = ProbeSchedule(*probe_intervals(swarm.scenario.averaging.matchmaking_s))
    while worker.alive:
        if worker.rounding:
            schedule.probed(env.now, worker.steps)  # the matchmaking's read stands for this probe
            while worker.rounding and worker.alive:
                yield worker.wait_wake(env)
            peers = [w.peer_id for w in swarm.workers.values() if w.alive and w.stage == worker.stage]
            if worker.peer_id in announcers(worker.last_round, peers):
                env.process(swarm.dht_op("store"))  # RoundBoard.close
            continue
        due = schedule.due_in(env.now, worker.steps)
        if due <= _DUE_NOW_S:
            steps = worker.steps
            replicas = schedule.reads_replicas(steps, env.now)
            yield env.all_of([env.process(swarm.dht_op("get")) for _ in range(2 if replicas else 1)])
            if replicas:
                schedule.replicas_read(env.now, swarm.rounds.live(worker.stage))
            schedule.probed(env.now, steps)
            continue
        yield env.any_of([env.timeout(due), worker.wait_wake(env)])


def heartbeat(swarm, worker: SimWorker, interval_s: float, phase_s: float, reads_bans: bool = True):
    """A simpy process: the worker's beats, the first `phase_s` in, then every `interval_s`."""
    env = swarm.env
    next_beat = env.now + phase_s
    while worker.alive:
        yield env.timeout(max(0.0, next_beat - env.now))
        if reads_bans:
            yield from swarm.dht_op("get")  # the ban list, read when a beat has passed since the last read
        yield from swarm.dht_op("store")
        next_beat = max(next_beat + interval_s, env.now)


def background(swarm, worker: SimWorker, cpu_s_per_s: float):
    """A simpy process: `cpu_s_per_s` of CPU a second on the host's cores, in half-second shares, while
    the worker lives."""
    yield from _burn(swarm, cpu_s_per_s, lambda: worker.alive)


def host_background(swarm, cpu_s_per_s: float):
    """A simpy process: `cpu_s_per_s` of CPU a second on the host's cores, in half-second shares, always."""
    yield from _burn(swarm, cpu_s_per_s, lambda: True)


def _burn(swarm, cpu_s_per_s: float, going: Callable[[], bool]):
    env = swarm.env
    while going():
        yield env.timeout(_BACKGROUND_EVERY_S)
        env.process(swarm.compute(cpu_s_per_s * _BACKGROUND_EVERY_S, since=env.now))  # the pace is the clock's
