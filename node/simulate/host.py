"""Processes sharing one host's cores, as an operating system shares them: processor sharing.

The emulation harness runs every node of a swarm on one machine. There a job does not wait for a
core and then run alone (a FIFO queue would starve a trainer's 1 ms of work behind every 30 ms
compute job); every runnable job advances at once, each at `cores / runnable` of a core when more
jobs than cores are runnable. `SharedCores.run(seconds)` is a simpy process that takes `seconds`
of CPU and ends when they are done at the rates of the moment.
"""

from __future__ import annotations

import simpy

__all__ = ["SharedCores"]

_DONE = 1e-12


class SharedCores:
    def __init__(self, env: simpy.Environment, cores: int):
        self.env, self.cores = env, cores
        self._jobs: dict[simpy.Event, float] = {}  # finished event -> CPU seconds left
        self._since = 0.0
        self._generation = 0
        self.cpu_s = 0.0  # every job's CPU seconds, summed as they are asked for: what the host burned

    def _rate(self) -> float:
        return min(1.0, self.cores / len(self._jobs)) if self._jobs else 1.0

    def _advance(self) -> None:
        elapsed, rate = self.env.now - self._since, self._rate()
        self._since = self.env.now
        for event in list(self._jobs):
            self._jobs[event] -= elapsed * rate
            if self._jobs[event] <= _DONE:
                del self._jobs[event]
                event.succeed()

    def _schedule(self) -> None:
        self._generation += 1
        if not self._jobs:
            return
        generation = self._generation
        wake = self.env.timeout(min(self._jobs.values()) / self._rate())
        wake.callbacks.append(lambda _: self._wake(generation))

    def _wake(self, generation: int) -> None:
        if generation == self._generation:  # no job came or went since this wake-up was planned
            self._advance()
            self._schedule()

    def run(self, seconds: float):
        if seconds <= 0:
            return
        self.cpu_s += seconds
        self._advance()
        done = self.env.event()
        self._jobs[done] = seconds
        self._schedule()
        yield done
