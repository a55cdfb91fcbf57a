"""A replica joining mid-run, a lopsided swarm rebalancing, and Ctrl-C ending it all, as real processes.

`agora-node demo --join-at` starts new contributors (own identity, empty state directory, admitted
by the run's authorizer) for stage 0 while the run trains. Each must go weight_sync ->
optimizer_sync -> member, downloading the stage's state from a live member over mutual TLS, and
the run's loss must not jump when they take traffic (a fresh replica routed at once would put its
initial weights on the route). Two joiners make the swarm lopsided on purpose: three replicas on
stage 0, one on the tail, which covers about what one head does per token. Exactly one replica of
stage 0 must move: leave, be admitted again with a credential for stage 1, sync there; then both
stages cover about the same and nobody moves again.

An operator's `agora-node export` of the same run goes on beside the joining (class Export).

The test follows the run by its logs (the readiness handshakes: each milestone line) and stops the
demo with Ctrl-C once everything it checks has happened, so a slow machine only makes it wait; every
role must then leave cleanly, the summary say "interrupted", and no process of the run be left.
"""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from leftovers import assert_nothing_left

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

JOINERS = ("worker-s0-r1", "worker-s0-r2")
# The joiners start after this many global batches: the loss check below compares the 10 batches
# before they arrive with the AFTER after, so they must not arrive before batch 10 (a joiner that starts
# quickly arrives a few batches after it is started).
JOIN_AT = 12
MOVED = "rebalancing: moving to stage 1"
# Batches after the first joiner arrived that the loss check reads: a fresh replica's initial weights
# on the route would show within a few batches (the mean of these 20 was 3.1 against the 10 before's
# 3.7 in one run at load 20: the check is not about the loss going down further).
AFTER = 20


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _loss_lines(work: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in _text(work / "trainer-0.jsonl").splitlines() if line.strip()]
    return {line["step"]: line["loss"] for line in lines}


def _arrival(log: str) -> int | None:
    found = re.search(r"stage 0: phase weight_sync \(the stage's members are at step (\d+)", log)
    return int(found.group(1)) if found else None


def _done(work: Path) -> bool:
    """Everything the test checks has happened: the joiners are members, one replica moved and is a
    member of stage 1 again, and AFTER global batches passed since the first joiner arrived."""
    logs = [_text(work / f"{joiner}.log") for joiner in JOINERS]
    arrivals = [_arrival(log) for log in logs]
    if None in arrivals or any("stage 0 worker: phase optimizer_sync -> member" not in log for log in logs):
        return False
    movers = [_text(path) for path in work.glob("worker-*.log") if MOVED in _text(path)]
    if len(movers) != 1 or "stage 1 worker: phase optimizer_sync -> member" not in movers[0].split(MOVED)[1]:
        return False
    return max(_loss_lines(work), default=0) >= min(arrivals) + AFTER


class LiveRun:
    """One demo, started once for this module and followed by its logs; `stop()` ends it with Ctrl-C
    (every role leaves cleanly, the summary is written) and returns the summary."""

    def __init__(self, work: Path):
        self.work, self.summary_path = work, work.parent / "summary.json"
        self.output = open(work.parent / "demo.out", "w")  # a file, not a pipe: nobody reads it while it runs
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agora.node", "demo", "--stages", "2", "--replicas", "1", "--steps", "5000",
             "--seed", "1", "--join-at", str(JOIN_AT), "--join-at", str(JOIN_AT), "--averaging-every", "2",
             "--averaging-fraction", "0.5", "--optimizer-sync-steps", "8", "--rebalance-every", "2", "--no-monitor",
             "--workdir", str(work), "--summary-json", str(self.summary_path)],
            stdout=self.output, stderr=subprocess.STDOUT)
        self.summary: dict | None = None

    def tail(self) -> str:
        return _text(self.work.parent / "demo.out")[-4000:]

    def wait_until_done(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not _done(self.work) and self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert self.process.poll() is None, self.tail()
        assert _done(self.work), f"the run did not get there in {timeout_s:g} s"

    def stop(self) -> dict:
        if self.summary is None:
            self.process.send_signal(signal.SIGINT)  # Ctrl-C
            assert self.process.wait(180) == 0, self.tail()
            self.summary = json.loads(self.summary_path.read_text())
        return self.summary

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.output.close()


class Export:
    """`agora-node export` of the live run with an operator credential minted by the run's
    authorizer, started once the run has trained a few batches and left to run beside the joining:
    it downloads from members while others join and one moves (a donor that leaves is followed by
    the next), and the CPU it takes on a two-core machine delays the joining instead of running
    after it."""

    STEPS_FIRST = 3  # its stages must be past step 0 (the test checks the step it writes)

    def __init__(self, run: LiveRun, folder: Path):
        from agora.node.cli import main

        deadline = time.monotonic() + 300
        while len(_loss_lines(run.work)) < self.STEPS_FIRST:
            assert run.process.poll() is None and time.monotonic() < deadline, run.tail()
            time.sleep(0.5)
        self.folder, operator = folder, folder / "operator"
        assert main(["authorizer", "issue", "--state-dir", str(run.work / "authorizer"), "--role", "operator",
                     "--out", str(operator)]) == 0
        self.output = open(folder / "export.out", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agora.node", "--log-level", "WARNING", "export", "--state-dir", str(operator),
             "--out", str(folder / "export")], stdout=self.output, stderr=subprocess.STDOUT)

    def wait(self) -> tuple[int, str]:
        code = self.process.wait(300)
        return code, _text(self.folder / "export.out")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.output.close()


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    run = LiveRun(tmp_path_factory.mktemp("lopsided") / "work")
    export = None
    try:
        export = Export(run, tmp_path_factory.mktemp("export"))
        run.wait_until_done(720)
        yield run, export
    finally:
        if export is not None:
            export.kill()
        run.kill()


def test_an_operator_exports_the_live_swarm_and_nobody_else_may(live_run, tmp_path, capsys):
    """`agora-node export`: every stage's state from a member, with an operator credential minted by
    the run's authorizer, written as a checkpoint and a transformers model computing the same logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from agora.node.cli import main
    from agora.pipeline.checkpoint import load_checkpoint
    from agora.pipeline.stages import assemble_model

    run, export = live_run
    code, printed = export.wait()
    assert code == 0, printed[-3000:]
    assert re.search(r"export: 2 stages \(stage 0 step \d+, stage 1 step \d+\)", printed), printed[-3000:]
    step, config, states, extra = load_checkpoint(export.folder / "export" / "checkpoint")
    assert [state.index for state in states] == [0, 1] and step > 0
    assert all(state.optimizer["optimizer"]["state"] and state.optimizer["steps"] >= step for state in states)
    assert set(extra["exported_from"]) == {"0", "1"}
    ours = assemble_model(config.model, [state.model for state in states]).eval()
    exported = AutoModelForCausalLM.from_pretrained(export.folder / "export" / "hf").eval()
    tokens = torch.randint(0, config.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, ours(tokens), atol=1e-4, rtol=0)
    # A trainer's credential exports nothing: only the operator holds the whole model.
    trainer = tmp_path / "trainer"
    assert main(["authorizer", "issue", "--state-dir", str(run.work / "authorizer"), "--role", "trainer",
                 "--out", str(trainer)]) == 0
    capsys.readouterr()
    assert main(["export", "--state-dir", str(trainer), "--out", str(tmp_path / "refused")]) == 2
    refused = capsys.readouterr().err
    assert "not a operator" in refused, refused
    assert not (tmp_path / "refused").exists()


def test_joiners_sync_before_they_count_and_a_lopsided_swarm_moves_one_replica(live_run):
    run, _ = live_run
    work = run.work
    summary = run.stop()  # Ctrl-C: every role leaves cleanly, the summary is written
    assert summary["outcome"] == "interrupted" and set(summary["exit_codes"].values()) == {0}, summary["exit_codes"]
    assert_nothing_left(work)

    # Joining: the original replicas were members from the start; each joiner synced first.
    phases = summary["phases_by_worker"]
    assert [phase for phase, _ in phases["worker-s1-r0"]] == ["member"]
    arrivals = []
    for joiner in JOINERS:
        log = (work / f"{joiner}.log").read_text()
        arrived = _arrival(log)
        downloaded = re.search(r"stage 0: state downloaded from \S+ at step (\d+) \((\d+) bytes", log)
        # A trained state, near the stage's step: the donor (the most advanced one announced when the
        # download starts) may be a few steps behind the step the phase line names, because a replica
        # on a loaded machine applies its reports late (79 against 81 in one CI run, 77 against 83 at
        # load 17 here).
        assert downloaded and int(downloaded.group(1)) >= arrived - 10 and arrived >= JOIN_AT and int(downloaded.group(2)) > 0
        joined = log.split(MOVED)[0]  # (a joiner may be the one that moved on)
        assert "stage 0 worker: phase weight_sync -> optimizer_sync" in joined
        assert "stage 0 worker: phase optimizer_sync -> member" in joined
        # It averaged with weight 0 meanwhile: its group counted it as syncing (both joiners at once
        # in one group count 2).
        assert any(re.search(r"rejected=\S*syncing:\d", line) for line in joined.splitlines()
                   if "averaging round=" in line)
        arrivals.append(arrived)
    # Their donors said they served the downloads.
    assert sum(_text(path).count("state download of stage 0 ") for path in work.glob("worker-s0-*.log")) >= 2

    # The run's loss did not jump when the joiners started taking traffic.
    losses = _loss_lines(work)
    first = min(arrivals)
    before = [losses[s] for s in range(first - 10, first)]
    after = [losses[s] for s in range(first, first + AFTER)]
    assert sum(after) / AFTER < sum(before) / 10 * 1.05, (before, after)

    # Rebalancing: exactly one replica left stage 0 for stage 1, synced there, and nobody moved again.
    assert [move["to"] for move in summary["rebalanced"]] == [1], summary["rebalanced"]
    mover = summary["rebalanced"][0]["name"]
    after_move = (work / f"{mover}.log").read_text().split(MOVED)[1]
    for line in ("starting again as stage 1", "admitted as worker stage 1", "stage 1: phase weight_sync",
                 "stage 1: state downloaded from", "stage 1 worker: phase optimizer_sync -> member"):
        assert line in after_move, (mover, line)
    assert [phase for phase, _ in phases[mover]] == ["weight_sync", "optimizer_sync", "member"]
    assert summary["workers_per_stage"] == {"0": 2, "1": 2}
    assert "state download of stage 1 " in _text(work / "worker-s1-r0.log")
