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
  (drawn: replicas start at different times), a read of the ban list, then its record's store.
"""

from __future__ import annotations

from agora.dht.round_board import announcers
from agora.node.averaging.probes import ProbeSchedule, probe_intervals
from agora.node.simulate.workers import SimWorker

__all__ = ["probing", "heartbeat"]

_DUE_NOW_S = 0.001  # loop.py's _TIMER_RESOLUTION_S


def probing(swarm, worker: SimWorker):
    """A simpy process: the replica's probes and round closes, as long as it lives."""
    env = swarm.env
    schedule = ProbeSchedule(*probe_intervals(swarm.scenario.averaging.matchmaking_s))
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


def heartbeat(swarm, worker: SimWorker, interval_s: float, phase_s: float):
    """A simpy process: the worker's beats, the first `phase_s` in, then every `interval_s`."""
    env = swarm.env
    next_beat = env.now + phase_s
    while worker.alive:
        yield env.timeout(max(0.0, next_beat - env.now))
        yield from swarm.dht_op("get")  # the ban list, read when a beat has passed since the last read
        yield from swarm.dht_op("store")
        next_beat = max(next_beat + interval_s, env.now)
