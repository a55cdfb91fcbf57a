"""Admission end to end: real `agora-node` processes (authorizer, bootstrap, workers, trainers,
the demo) driven through the CLI, as an operator and a contributor would run them.

Each test starts only what its case needs: the refusals at the door need an authorizer alone
(admission runs before a node starts its DHT or its gRPC server), the ban and the cap need an
authorizer and one or two workers, the insecure case is a whole `demo` (renewals across a whole
run are checked on test_attacks.py's demo). Readiness is the ready
files the processes write; every child is reaped by a ProcessGroup (node/demo/processes.py) or
by the demo itself. The same cases run in-process, with fakes for time, in test_authorizer.py;
here they are what a user sees: exit codes, the one line on stderr, the logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agora.auth.admission import hardware_report
from agora.auth.node_state import NodeCredentials
from agora.node.authorizer import LOCAL_RUN_FLAGS
from agora.node.cli import main
from agora.node.demo.processes import ChildProcess, ProcessGroup, agora_node_command
from agora.node.worker.join import EXIT_REVOKED

pytestmark = pytest.mark.slow

READY_TIMEOUT_S = 90.0
# Floors a loopback node on this machine passes; a small preflight keeps admission fast.
LOW_FLOORS = ("--min-upload-mbit", "0", "--min-download-mbit", "0", "--max-rtt-ms", "inf",
              "--min-accelerator-gb", "0", "--min-ram-gb", "0", "--preflight-bytes", str(256 << 10))
# One torch thread per child (2 cores); INFO puts admission and renewal milestones in the logs.
NODE_FLAGS = ("--threads", "1", "--log-level", "INFO")


@pytest.fixture
def group(tmp_path):
    processes = ProcessGroup(tmp_path, env={"OMP_NUM_THREADS": "1"})
    yield processes
    processes.shutdown(grace_s=15.0)


def _serve(group: ProcessGroup, state: Path, *flags: str, name: str = "authorizer") -> tuple[str, str]:
    """`authorizer serve` on a fresh state dir; (address, root fingerprint) from its ready file."""
    ready = group.workdir / f"{name}.ready"
    child = group.spawn(name, agora_node_command(*NODE_FLAGS, "authorizer", "serve", "--state-dir", str(state),
                                                 "--ready-file", str(ready), *LOCAL_RUN_FLAGS, *flags), ready)
    address, fingerprint = group.wait_ready([child], READY_TIMEOUT_S)[name]
    return address, fingerprint


def _join(group: ProcessGroup, name: str, join_file: Path, *flags: str) -> ChildProcess:
    ready = group.workdir / f"{name}.ready"
    return group.spawn(name, agora_node_command(*NODE_FLAGS, "join", "--stage", "0", "--stages", "1",
                                                "--join-file", str(join_file),
                                                "--state-dir", str(group.workdir / f"{name}.state"),
                                                "--heartbeat", "1", "--ready-file", str(ready), *flags), ready)


def _listing(state: Path, capsys) -> dict:
    capsys.readouterr()
    assert main(["authorizer", "list", "--json", "--state-dir", str(state)]) == 0
    return json.loads(capsys.readouterr().out)


def _wait_for_text(child: ChildProcess, text: str, timeout_s: float) -> None:
    """Until the child's log holds ``text`` (a line it prints once, e.g. its queue position)."""
    deadline = time.monotonic() + timeout_s
    while text not in child.log_path.read_text(errors="replace"):
        assert child.alive(), f"{child.name} exited with {child.process.returncode}:\n{child.log_tail()}"
        assert time.monotonic() < deadline, f"{child.name} never printed {text!r}:\n{child.log_tail()}"
        time.sleep(0.1)  # polling a log file the child appends to


def _demo(tmp_path: Path, *flags: str) -> tuple[int, dict, Path]:
    workdir, summary = tmp_path / "work", tmp_path / "summary.json"
    code = main(["demo", "--workdir", str(workdir), "--summary-json", str(summary), *flags])
    return code, json.loads(summary.read_text()), workdir


# ---- the demo's explicit way without admission (renewals under load: test_attacks.py's demo)

@pytest.mark.timeout(120)
def test_insecure_demo_runs_without_an_authorizer_and_every_node_says_so(tmp_path):
    code, summary, workdir = _demo(tmp_path, "--insecure", "--steps", "5", "--stages", "2")
    assert code == 0 and summary["outcome"] == "completed" and summary["steps"] == 5
    assert summary["security"] == "insecure"
    assert summary["credential_renewals"] == {"trainers": 0, "workers": 0}
    assert "authorizer" not in summary["exit_codes"] and set(summary["exit_codes"].values()) == {0}
    assert not (workdir / "authorizer").exists() and not list(workdir.glob("*.state"))
    for name in ("worker-s0-r0", "worker-s1-r0", "trainer-0"):
        first = (workdir / f"{name}.log").read_text().splitlines()[0]
        role = "trainer" if name.startswith("trainer") else "worker"
        assert first.startswith(f"agora-node {role}: WARNING: --insecure: no admission, no TLS"), first
    assert "serves WITHOUT TLS or credentials" in (workdir / "worker-s0-r0.log").read_text()
    assert "--insecure: this DHT peer admits anyone" in (workdir / "bootstrap.log").read_text()


# ---- a banned worker is cut off within a heartbeat and leaves within one lifetime

@pytest.mark.timeout(150)
def test_a_banned_worker_leaves_within_one_credential_lifetime(group, tmp_path, capsys):
    # Short, and still longer than a worker's start beside the suite's other demos (renewed before its
    # DHT peer starts, 12 s from there to serving was measured: its renewer starts only then).
    lifetime = 20.0
    state, boot_state = tmp_path / "authorizer", tmp_path / "bootstrap.state"
    # The operator credentials its own bootstrap peer offline (this creates the run's CA) ...
    issue = group.spawn("issue", agora_node_command(*NODE_FLAGS, "authorizer", "issue", "--role", "operator", "--out",
                                                    str(boot_state), "--run-id", "ban-run", "--state-dir", str(state)))
    assert issue.process.wait(READY_TIMEOUT_S) == 0, issue.log_tail()
    boot_ready = tmp_path / "bootstrap.ready"
    boot = group.spawn("bootstrap", agora_node_command(*NODE_FLAGS, "bootstrap", "--state-dir", str(boot_state),
                                                       "--ready-file", str(boot_ready)), boot_ready)
    maddrs = group.wait_ready([boot], READY_TIMEOUT_S)["bootstrap"]
    # ... and serves admission with its address to hand out.
    _serve(group, state, "--credential-lifetime", str(lifetime), "--stages", "1", *LOW_FLOORS,
           "--initial-peers", *maddrs)
    # The worker's watchdog would leave as soon as its own DHT holds the ban list (exit 3 as well),
    # racing the renewal this test is about: here only the refused renewal makes it leave.
    worker = _join(group, "worker", state / "join.json", "--no-watchdog-ban-leave")
    _, peer_id = group.wait_ready([worker], READY_TIMEOUT_S)["worker"]

    capsys.readouterr()
    assert main(["authorizer", "ban", peer_id, "--reason", "test", "--state-dir", str(state)]) == 0
    banned_at = time.monotonic()
    # The serving authorizer publishes the signed list in the DHT; the bootstrap reads it within a
    # heartbeat and from then answers none of the banned worker's DHT requests.
    while "ban list" not in boot.log_path.read_text() or "1 peers banned" not in boot.log_path.read_text():
        assert time.monotonic() - banned_at < lifetime + 10, f"the bootstrap never read the ban list:\n{boot.log_tail()}"
        time.sleep(0.1)
    with capsys.disabled():
        print(f"authorizer ban -> the bootstrap holds the list: {time.monotonic() - banned_at:.2f} s")
    try:
        code = worker.process.wait(timeout=lifetime + 10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the banned worker still runs {lifetime + 10:g} s after the ban:\n{worker.log_tail()}")
    left_after = time.monotonic() - banned_at
    assert code == EXIT_REVOKED == 3, worker.log_tail()
    assert left_after < lifetime + 10
    log = worker.log_path.read_text()
    assert "credential revoked: banned: test" in log, worker.log_tail()
    assert "leaving the run: the credential was revoked (banned: test)" in log
    assert "leaving: withdrawing the record" in log  # a clean leave, not a crash

    listing = _listing(state, capsys)
    assert [(ban["peer_id"], ban["reason"]) for ban in listing["bans"]] == [(peer_id, "test")]
    assert peer_id not in [node["peer_id"] for node in listing["admitted"]]
    # It cannot come back: joining again with its key is refused at the door.
    again = group.spawn("rejoin", worker.process.args, worker.ready_path)
    assert again.process.wait(READY_TIMEOUT_S) == 2, again.log_tail()
    assert again.log_tail(1) == "agora-node join: error: admission refused: banned: test", again.log_tail()
    assert not worker.ready_path.exists()
    assert group.stop([boot]) == {"bootstrap": 0}  # the swarm's other peer is unharmed


# ---- refused at the door: one line, exit 2, nothing served

@pytest.fixture(scope="module")
def strict_authorizer(tmp_path_factory):
    """One authorizer for the refusals: seed 0 (the default), a RAM floor no machine meets."""
    workdir = tmp_path_factory.mktemp("strict-authorizer")
    processes = ProcessGroup(workdir, env={"OMP_NUM_THREADS": "1"})
    state = workdir / "state"
    try:
        address, fingerprint = _serve(processes, state, "--run-id", "strict", "--stages", "1", *LOW_FLOORS,
                                      "--min-ram-gb", "10000")  # the last one given counts
        yield state, address, fingerprint
    finally:
        processes.shutdown(grace_s=15.0)


def _refused(tmp_path: Path, *command: str) -> tuple[str, Path]:
    """Run a node that must be refused before it serves anything; its one stderr line."""
    node_state = tmp_path / "node.state"
    # Its own session, killed whole afterwards: a node wrongly admitted would leave a DHT process.
    process = subprocess.Popen(agora_node_command("--threads", "1", *command, "--state-dir", str(node_state)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                               start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, err = process.communicate(timeout=READY_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    lines = err.strip().splitlines()
    assert process.returncode == 2, (process.returncode, err)
    assert len(lines) == 1 and out == "", (out, err)
    return lines[0], node_state


def _assert_nothing_served(node_state: Path, ready: Path, state: Path, capsys) -> None:
    assert not ready.exists(), "a refused worker wrote its ready file"
    assert not (node_state / "credential.pem").exists()
    peer_id = NodeCredentials(node_state, clock=time.time).peer_id
    assert peer_id not in [node["peer_id"] for node in _listing(state, capsys)["admitted"]]


@pytest.mark.timeout(120)
def test_a_worker_with_another_seed_is_refused_naming_seed(strict_authorizer, tmp_path, capsys):
    state, _, _ = strict_authorizer
    ready = tmp_path / "worker.ready"
    line, node_state = _refused(tmp_path, "join", "--stage", "0", "--seed", "1", "--join-file",
                                str(state / "join.json"), "--ready-file", str(ready))
    assert line == ("agora-node join: error: admission refused: run fingerprint mismatch in seed: "
                    "this run has seed=0, the peer has seed=1"), line
    _assert_nothing_served(node_state, ready, state, capsys)


@pytest.mark.timeout(120)
def test_a_worker_below_the_ram_floor_is_refused_naming_the_floor_and_its_ram(strict_authorizer, tmp_path, capsys):
    state, _, _ = strict_authorizer
    ready = tmp_path / "worker.ready"
    line, node_state = _refused(tmp_path, "join", "--stage", "0", "--join-file", str(state / "join.json"),
                                "--ready-file", str(ready))
    ram_gb = hardware_report().ram_bytes / 1e9
    assert line == (f"agora-node join: error: admission refused: RAM reported {ram_gb:.1f} GB, below the floor "
                    "min_ram_gb=10000 GB of this run (the operator sets it with --min-ram-gb)"), line
    _assert_nothing_served(node_state, ready, state, capsys)


@pytest.mark.timeout(120)
def test_a_trainer_pinning_another_ca_fingerprint_refuses_the_authorizer(strict_authorizer, tmp_path):
    state, address, fingerprint = strict_authorizer
    pinned = "ab" * 32
    line, node_state = _refused(tmp_path, "trainer", "--authorizer", address, "--ca-fingerprint", pinned)
    assert line.startswith("agora-node trainer: error: "), line
    assert f"the authorizer at {address} presented root CA {fingerprint[:16]}" in line, line
    assert f"not the pinned {pinned[:16]}" in line and "refusing it" in line, line
    # Nothing the untrusted authorizer said was kept.
    assert not (node_state / "credential.pem").exists() and not (node_state / "run.json").exists()


# ---- the cap: the next worker waits in line and is admitted when a slot frees

@pytest.mark.timeout(150)
def test_the_cap_queues_the_next_worker_and_admits_it_when_a_slot_frees(group, tmp_path, capsys):
    state = tmp_path / "authorizer"
    # No bootstrap: each worker starts a DHT of its own; the cap is the authorizer's alone.
    _serve(group, state, "--run-id", "cap-run", "--stages", "1", "--max-workers", "1", "--queue-retry-after", "1",
           *LOW_FLOORS)
    first = _join(group, "first", state / "join.json")
    _, first_peer = group.wait_ready([first], READY_TIMEOUT_S)["first"]

    second = _join(group, "second", state / "join.json")
    _wait_for_text(second, "the run is full; waiting in the authorizer's queue at position 1", READY_TIMEOUT_S)
    assert not second.ready_path.exists()
    assert [node["peer_id"] for node in _listing(state, capsys)["admitted"]] == [first_peer]

    # The first contributor leaves; the operator frees its slot at once (else it frees when the
    # credential it holds expires) and the queued worker is admitted on its next poll.
    assert group.stop([first]) == {"first": 0}
    assert not second.ready_path.exists()
    assert main(["authorizer", "ban", first_peer, "--reason", "left", "--state-dir", str(state)]) == 0
    _, second_peer = group.wait_ready([second], READY_TIMEOUT_S)["second"]
    assert second_peer != first_peer
    assert [node["peer_id"] for node in _listing(state, capsys)["admitted"]] == [second_peer]
    assert "admitted as worker stage 0" in second.log_path.read_text()
