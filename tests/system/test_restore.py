"""Exact restore: a synchronous demo killed with kill -9 after step 15 and
resumed from its step-12 checkpoints (`demo --resume --workdir W`) has, at step 18, every tensor
equal (torch.equal) to the uninterrupted run's, and the same loss trace.

Real processes throughout: the `agora-node demo` a user runs, killed as a whole (its children die
with it: node/cli.py's parent-death signal), then resumed from what it left on disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agora.pipeline.checkpoint import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, EVERY, KILL_AFTER, STAGES = 18, 6, 15, 2
DEMO = ["--log-level", "WARNING", "demo", "--sync", "--stages", str(STAGES), "--steps", str(STEPS),
        "--schedule-steps", str(STEPS), "--checkpoint-every", str(EVERY), "--no-monitor"]


def demo(workdir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agora.node", *DEMO, "--workdir", str(workdir), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def steps_logged(path: Path) -> list[dict]:
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


def stage_tensors(workdir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every stage's last (step-18) checkpoint: parameters, Adam moments, step counts."""
    tensors = {}
    for stage in range(STAGES):
        step, _, (state,), _ = load_checkpoint(workdir / f"worker-s{stage}-r0.state" / "checkpoints", step=STEPS)
        assert step == STEPS
        tensors.update({f"s{stage}.{name}": value for name, value in state.model.items()})
        for index, moments in state.optimizer["optimizer"]["state"].items():
            tensors.update({f"s{stage}.adam{index}.{key}": value for key, value in moments.items()})
        tensors[f"s{stage}.steps"] = torch.tensor(state.optimizer["steps"])
    return tensors


def test_a_run_killed_after_step_15_resumes_from_step_12_to_the_same_tensors_at_18(tmp_path):
    uninterrupted = demo(tmp_path / "a")  # side by side: the same run, once left alone, once killed
    killed = demo(tmp_path / "b")
    try:
        log = tmp_path / "b" / "trainer-0.jsonl"
        deadline = time.monotonic() + 300
        while not any(line["step"] >= KILL_AFTER for line in steps_logged(log)):
            assert killed.poll() is None, killed.stderr.read()
            assert time.monotonic() < deadline, f"the second run never reached step {KILL_AFTER}"
            time.sleep(0.05)  # the trainer's own log is the handshake: a line per global batch
        os.killpg(killed.pid, signal.SIGKILL)  # the whole demo at once; its children die with it
        killed.wait()
        assert uninterrupted.wait(400) == 0, uninterrupted.stderr.read()
    finally:
        for process in (uninterrupted, killed):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    left = steps_logged(log)
    assert KILL_AFTER <= left[-1]["step"] < STEPS  # killed mid-run, before the last checkpoint
    resumed = demo(tmp_path / "b", "--resume", "--summary-json", str(tmp_path / "b.json"))
    try:
        assert resumed.wait(400) == 0, resumed.stderr.read()
    finally:
        if resumed.poll() is None:
            os.killpg(resumed.pid, signal.SIGKILL)
            resumed.wait()
    assert json.loads((tmp_path / "b.json").read_text())["churn"]["resumed_from_step"] == STEPS - EVERY
    reference = [(line["step"], line["loss"]) for line in steps_logged(tmp_path / "a" / "trainer-0.jsonl")]
    trace = [(line["step"], line["loss"]) for line in steps_logged(log)]
    assert trace == reference and len(trace) == STEPS  # steps 1-12 from before the kill, 13-18 after
    a, b = stage_tensors(tmp_path / "a"), stage_tensors(tmp_path / "b")
    assert a.keys() == b.keys() and len(a) > 50
    unequal = [name for name in a if not torch.equal(a[name], b[name])]
    assert not unequal, unequal[:5]
