"""A demo whose trainers stopped completing global batches says so, with where each process stands.

A run that hangs (a child stuck in a call, a DHT peer that never answers) otherwise shows only the
same progress line until someone kills it, and a test's timeout then reports the supervisor's own
stack: the children's logs, where the cause is, go with the test's folder. So when the trainers are
alive but no global batch completed for `STALL_S` (or ten times the longest wait between two batches
so far, for a model whose batches take minutes), the demo asks every live child for its threads'
stacks (SIGUSR1: agora-node writes them to its log from C, node/__main__.py) and prints the last
lines of each child's log to its own stderr, once per stall: a further report only after as long
again without a batch. Nothing is stopped: a slow machine's run goes on.

One hang is certain and ends the run at once: every worker the demo started for a stage has exited
(banned, crashed) and none will come, the demo starting no other (churn drills start the newcomer
as they kill), so its trainers would wait for a worker of that stage for ever (`stage_left_empty`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Callable, Iterable, Sequence, TextIO

from agora.node.demo.processes import ChildProcess

__all__ = ["STALL_S", "StallWatch", "report_stall", "stage_left_empty"]

logger = logging.getLogger("agora.node.demo")

# Seconds without a completed global batch before a stall is reported (a tiny run completes several a
# second; the slowest honest wait, a joiner's sync on a loaded machine, stays well under this).
STALL_S = 120.0
# What of each child's log is shown: a trainer's (whose batches stopped) and every other's.
TRAINER_LINES, OTHER_LINES = 25, 8
_STACKS_WAIT_S = 1.0


class StallWatch:
    """Whether the run has completed no global batch for `after_s` (module docstring), once per stall."""

    def __init__(self, floor_s: float = STALL_S, clock: Callable[[], float] = time.monotonic):
        self.floor_s, self.clock = floor_s, clock
        self._batches, self._since, self._longest = -1, clock(), 0.0

    @property
    def after_s(self) -> float:
        return max(self.floor_s, 10 * self._longest)

    def stalled(self, batches: int) -> bool:
        now = self.clock()
        if batches != self._batches:
            if self._batches > 0:  # the wait for the first batch includes the trainers' start
                self._longest = max(self._longest, now - self._since)
            self._batches, self._since = batches, now
            return False
        if now - self._since < self.after_s:
            return False
        self._since = now  # the next report, if any, after as long again
        return True


def report_stall(children: Iterable[ChildProcess], batches: int, after_s: float, out: TextIO = sys.stderr) -> None:
    """Every live child's stacks into its log, then the tail of each log to `out`."""
    alive = [child for child in children if child.alive()]
    logger.warning("no global batch for %.0f s (%d so far): the stacks of every live process go to its log", after_s,
                   batches, extra={"milestone": "run_stalled", "fields": {"batches": batches, "seconds": after_s}})
    for child in alive:
        try:
            os.kill(child.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(_STACKS_WAIT_S)  # faulthandler writes from C at once; a moment for the files to take it
    for child in alive:
        lines = TRAINER_LINES if child.name.startswith("trainer") else OTHER_LINES
        print(f"demo: no global batch for {after_s:.0f} s; the last lines of {child.log_path}:\n{child.log_tail(lines)}",
              file=out, flush=True)


def stage_left_empty(workers: Sequence[tuple[int, ChildProcess]]) -> str | None:
    """Why the run cannot go on, if every worker started for some stage has exited (module
    docstring): each one's exit code and last log lines; None while every stage has one alive."""
    stages = sorted({stage for stage, _ in workers})
    for stage in stages:
        gone = [worker for s, worker in workers if s == stage]
        if not any(worker.alive() for worker in gone):
            reasons = "\n".join(f"{worker.name} exited with {worker.process.returncode}; the last lines of "
                                 f"{worker.log_path}:\n{worker.log_tail(OTHER_LINES)}" for worker in gone)
            return f"stage {stage} has no worker left, so the run cannot go on:\n{reasons}"
    return None
