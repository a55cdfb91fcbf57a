"""The demo's stall report (node/demo/stall.py): when it fires, and what it shows, on real processes."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from agora.node.demo.processes import ChildProcess
from agora.node.demo.stall import StallWatch, report_stall, stage_left_empty


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_stall_is_reported_once_per_stall_and_never_while_batches_complete():
    clock = Clock()
    watch = StallWatch(floor_s=100.0, clock=clock)
    assert not watch.stalled(0)
    clock.now = 99.0
    assert not watch.stalled(0)
    clock.now = 101.0
    assert watch.stalled(0)
    clock.now = 150.0
    assert not watch.stalled(0)  # reported already: the next one after as long again
    clock.now = 202.0
    assert watch.stalled(0)
    clock.now = 203.0
    assert not watch.stalled(1)  # a batch: the clock starts over
    clock.now = 302.0
    assert not watch.stalled(1)
    clock.now = 304.0
    assert watch.stalled(1)


def test_a_run_of_slow_batches_waits_ten_of_its_longest_gaps():
    clock = Clock()
    watch = StallWatch(floor_s=100.0, clock=clock)
    watch.stalled(0)
    for batch, at in ((1, 500.0), (2, 530.0), (3, 590.0)):  # the first gap (the start) does not count
        clock.now = at
        assert not watch.stalled(batch)
    assert watch.after_s == 600.0
    clock.now = 590.0 + 599.0
    assert not watch.stalled(3)
    clock.now = 590.0 + 601.0
    assert watch.stalled(3)


def test_the_report_shows_each_live_childs_log_tail_and_asks_it_for_its_stacks(tmp_path):
    log = tmp_path / "trainer-0.log"
    log.write_text("".join(f"line {index}\n" for index in range(40)))
    # A child that answers SIGUSR1 as agora-node does: its stacks into its log.
    script = ("import faulthandler, signal, sys, time\n"
              f"out = open({str(log)!r}, 'a')\n"
              "faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        child = ChildProcess("trainer-0", process, log)
        out = io.StringIO()
        report_stall([child], 7, 120.0, out=out)
        text = out.getvalue()
        assert f"no global batch for 120 s; the last lines of {log}" in text
        assert "line 39" in text and "most recent call first" in log.read_text()
        assert process.poll() is None  # asked for its stacks, not stopped
    finally:
        process.kill()
        process.wait()


def test_a_stage_whose_every_worker_exited_ends_the_run_with_why(tmp_path):
    def child(name: str, code: str) -> ChildProcess:
        log = tmp_path / f"{name}.log"
        log.write_text(f"{name} started\n{name}: banned by the run's operator\n")
        return ChildProcess(name, subprocess.Popen([sys.executable, "-c", code]), log)

    sleeping = "import time; time.sleep(60)"
    head, body, tail = child("worker-s0-r0", "raise SystemExit(3)"), child("worker-s1-r0", sleeping), \
        child("worker-s1-r1", "raise SystemExit(0)")
    try:
        head.process.wait(), tail.process.wait()
        assert stage_left_empty([(1, body), (1, tail)]) is None  # stage 1 still has a worker
        why = stage_left_empty([(0, head), (1, body), (1, tail)])
        assert why.startswith("stage 0 has no worker left") and "worker-s0-r0 exited with 3" in why
        assert "banned by the run's operator" in why and "worker-s1" not in why
    finally:
        body.process.kill()
        body.process.wait()
