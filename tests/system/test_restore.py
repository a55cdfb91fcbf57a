"""Exact restore: a synchronous demo killed with kill -9 after step 9 and
resumed from its step-8 checkpoints (`demo --resume --workdir W`) has, at step 12, every tensor
equal (torch.equal) to the uninterrupted run's, and the same loss trace. Three checkpoints, and
three steps after the kill's trigger for the kill to land before the run's end.

The killed run is the `agora-node demo` a user runs, a process of its own killed as a whole (its
children die with it: node/cli.py's parent-death signal). The uninterrupted run and the resume are
the same command's main here, side by side with it: their roles start from this process's fork
server (node/demo/launcher.py), imported once for the session rather than once per run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from agora.node.cli import main
from agora.pipeline.checkpoint import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, EVERY, KILL_AFTER, STAGES = 12, 4, 9, 2
DEMO = ["--log-level", "WARNING", "demo", "--sync", "--stages", str(STAGES), "--steps", str(STEPS),
        "--schedule-steps", str(STEPS), "--checkpoint-every", str(EVERY), "--no-monitor"]


def demo(workdir: Path, *extra: str) -> subprocess.Popen:
    """The demo in its own process group; its stderr goes to a file beside its workdir (a pipe nobody
    reads while it runs would stop it once a loaded machine's warnings fill the pipe's buffer)."""
    with open(workdir.with_name(workdir.name + ".stderr"), "w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "agora.node", *DEMO, "--workdir", str(workdir), *extra],
                                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)


def stderr_of(workdir: Path) -> str:
    return workdir.with_name(workdir.name + ".stderr").read_text()[-3000:]


def steps_logged(path: Path) -> list[dict]:
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


def stage_tensors(workdir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every stage's last (step-12) checkpoint: parameters, Adam moments, step counts."""
    tensors = {}
    for stage in range(STAGES):
        step, _, (state,), _ = load_checkpoint(workdir / f"worker-s{stage}-r0.state" / "checkpoints", step=STEPS)
        assert step == STEPS
        tensors.update({f"s{stage}.{name}": value for name, value in state.model.items()})
        for index, moments in state.optimizer["optimizer"]["state"].items():
            tensors.update({f"s{stage}.adam{index}.{key}": value for key, value in moments.items()})
        tensors[f"s{stage}.steps"] = torch.tensor(state.optimizer["steps"])
    return tensors


def kill_after(process: subprocess.Popen, log: Path, failures: list[str], stop: threading.Event) -> None:
    """Kill the demo's whole process group once its trainer logged step KILL_AFTER, or at `stop`
    (a thread: this test's main thread runs the other demo meanwhile)."""
    deadline = time.monotonic() + 300
    while not stop.is_set() and not any(line["step"] >= KILL_AFTER for line in steps_logged(log)):
        if process.poll() is not None:
            failures.append(f"the second run exited with {process.returncode}: {stderr_of(log.parent)}")
            return
        if time.monotonic() > deadline:
            failures.append(f"the second run never reached step {KILL_AFTER}: {stderr_of(log.parent)}")
            break
        time.sleep(0.05)  # the trainer's own log is the handshake: a line per global batch
    os.killpg(process.pid, signal.SIGKILL)  # the whole demo at once; its children die with it
    process.wait()


def test_a_run_killed_after_step_9_resumes_from_step_8_to_the_same_tensors_at_12(tmp_path):
    killed = demo(tmp_path / "b")  # side by side: the same run, once killed, once left alone
    log = tmp_path / "b" / "trainer-0.jsonl"
    failures: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=kill_after, args=(killed, log, failures, stop), daemon=True)
    watcher.start()
    try:
        assert main([*DEMO, "--workdir", str(tmp_path / "a")]) == 0
    except BaseException:
        stop.set()
        raise
    finally:
        watcher.join(330)
        if killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
            killed.wait()
    assert not failures, failures
    left = steps_logged(log)
    assert KILL_AFTER <= left[-1]["step"] < STEPS  # killed mid-run, before the last checkpoint
    assert main([*DEMO, "--workdir", str(tmp_path / "b"), "--resume", "--summary-json", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["churn"]["resumed_from_step"] == STEPS - EVERY
    reference = [(line["step"], line["loss"]) for line in steps_logged(tmp_path / "a" / "trainer-0.jsonl")]
    trace = [(line["step"], line["loss"]) for line in steps_logged(log)]
    assert trace == reference and len(trace) == STEPS  # steps 1-8 from before the kill, 9-12 after
    a, b = stage_tensors(tmp_path / "a"), stage_tensors(tmp_path / "b")
    assert a.keys() == b.keys() and len(a) > 50
    unequal = [name for name in a if not torch.equal(a[name], b[name])]
    assert not unequal, unequal[:5]
