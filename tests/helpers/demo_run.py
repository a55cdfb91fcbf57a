"""`agora-node demo` as a subprocess that a system test follows by its files while it runs: the ready
files and logs in its workdir, each node's metrics page, and the summary it writes when it ends.

Readiness is a file or a log line appearing, polled with a deadline (the demo is checked alive on
every poll, so a failed run ends the wait with its output's tail, not a timeout). The demo dies with
the test's process and its children with it (node/demo/supervision.py), so a test killed by its
timeout leaves nothing behind; `close()` stops it with Ctrl-C first, so they leave cleanly, and
kills it if it does not stop.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Callable, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from agora.node.demo.supervision import PARENT_PID_ENV

T = TypeVar("T")

_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.MULTILINE)


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def log_lines_after(text: str, since: float, pattern: str) -> list[str]:
    """Lines of a node's log matching `pattern` and stamped after `since` (time.time())."""
    after = []
    for line in text.splitlines():
        stamp = _LOG_TIME.match(line)
        if stamp and re.search(pattern, line):
            if datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() > since:
                after.append(line)
    return after


def scrape(endpoint: str) -> dict[str, dict[tuple, float]]:
    """A node's /metrics page: samples by name, each keyed by its sorted label pairs."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as page:
            text = page.read().decode()
    except OSError as error:
        raise AssertionError(f"cannot read the metrics at {endpoint}: {error}") from None
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def by_label(samples: dict[str, dict[tuple, float]], name: str, label: str) -> dict[str, float]:
    """One metric's values by one label's value (the others summed)."""
    values: dict[str, float] = {}
    for labels, value in samples.get(name, {}).items():
        key = dict(labels).get(label, "")
        values[key] = values.get(key, 0.0) + value
    return values


class DemoRun:
    """One `agora-node demo --workdir BASE/work --summary-json BASE/summary.json FLAGS...`."""

    def __init__(self, base: Path, *flags: str):
        self.work, self.summary_path = base / "work", base / "summary.json"
        self.output_path = base / "demo.out"
        self._output = open(self.output_path, "w")  # a file, not a pipe: nobody reads it while it runs
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agora.node", "demo", "--workdir", str(self.work),
             "--summary-json", str(self.summary_path), *flags],
            stdout=self._output, stderr=subprocess.STDOUT, env={**os.environ, PARENT_PID_ENV: str(os.getpid())})

    def tail(self) -> str:
        return read_text(self.output_path)[-4000:]

    def text(self, name: str) -> str:
        """A file of the workdir ("" while it does not exist)."""
        return read_text(self.work / name)

    def wait_for(self, predicate: Callable[[], T], *, what: str, timeout_s: float) -> T:
        """The predicate's first true value, polled every 0.1 s while the demo runs."""
        deadline = time.monotonic() + timeout_s
        while not (result := predicate()):
            assert self.process.poll() is None, f"the demo ended while waiting for {what}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"no {what} after {timeout_s:g} s:\n{self.tail()}"
            time.sleep(0.1)  # polling files the demo's processes write
        return result

    def ready(self, name: str) -> list[str]:
        """The lines of `name`'s ready file, once written (atomically: never half a file)."""
        return self.wait_for(lambda: self.text(f"{name}.ready").split(), what=f"{name}'s ready file", timeout_s=120)

    def steps(self) -> int:
        """Global batches the run's trainers have logged so far."""
        return sum(read_text(path).count("\n") for path in self.work.glob("trainer-*.jsonl"))

    def metrics_endpoint(self, name: str) -> str:
        """Where a worker serves its metrics (the line its log has once serving)."""
        found = self.wait_for(lambda: re.search(r"metrics at http://(\S+)/metrics", self.text(f"{name}.log")),
                              what=f"{name}'s metrics endpoint", timeout_s=60)
        return found.group(1)

    def finish(self, timeout_s: float) -> tuple[int, dict]:
        """Wait for the demo to end by itself; its exit code and summary."""
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the demo did not end within {timeout_s:g} s:\n{self.tail()}") from None
        assert self.summary_path.exists(), self.tail()
        return code, json.loads(self.summary_path.read_text())

    def close(self) -> None:
        """Stop the demo if it still runs (Ctrl-C, then kill), and reap it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._output.close()
