"""`agora-node authorizer`: the operator's commands in-process, and one real `serve` process that
admits a node."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from agora.auth.admission import AdmissionRefused, JoinFile, admit
from agora.auth.authority import RunAuthority
from agora.auth.credentials import CredentialVerifier
from agora.auth.node_state import NodeCredentials
from agora.node.cli import main
from agora.node.rpc.server import run
from agora.pipeline.config import PRESETS, config_from_dict
from agora.pipeline.fingerprint import run_fingerprint

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("authorizer-state")
    RunAuthority(directory, run_id="cli-run")
    return directory


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_issue_writes_a_node_state_dir_whose_credential_verifies(state_dir, tmp_path, capsys):
    out = tmp_path / "ops-worker"
    assert main(["authorizer", "issue", "--role", "worker", "--stage", "1", "--out", str(out), "--lifetime", "600",
                 "--state-dir", str(state_dir)]) == 0
    assert "issued a worker stage 1" in capsys.readouterr().out
    node = NodeCredentials(out, clock=time.time)
    chain, identity = node.current()
    root = (state_dir / "root.pem").read_bytes()
    verified = CredentialVerifier(root, "cli-run", clock=time.time).verify(chain, roles=("worker",), stage=1,
                                                                           public_key=node.key.public_key())
    assert verified.peer_id == node.peer_id
    assert 500 < identity.remaining_s(time.time()) <= 600
    assert node.run_info().root_fingerprint == RunAuthority(state_dir).root_fingerprint
    assert oct((out / "node.key").stat().st_mode & 0o777) == "0o600"


def test_issue_can_create_the_run_authority_before_serve(tmp_path, capsys):
    """A DHT bootstrap peer needs a credential before `serve` can be told its address."""
    fresh = tmp_path / "fresh-state"
    assert main(["authorizer", "issue", "--role", "monitor", "--out", str(tmp_path / "boot"), "--run-id", "early",
                 "--state-dir", str(fresh)]) == 0
    authority = RunAuthority(fresh)
    minted = NodeCredentials(tmp_path / "boot", clock=time.time)
    assert authority.run_id == "early" and minted.identity().role == "monitor"
    assert minted.run_info().root_fingerprint == authority.root_fingerprint


def test_ban_unban_and_list(state_dir, capsys):
    peer = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    assert main(["authorizer", "ban", peer, "--reason", "poisoned gradients", "--state-dir", str(state_dir)]) == 0
    assert main(["authorizer", "list", "--json", "--state-dir", str(state_dir)]) == 0
    listing = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert listing["run_id"] == "cli-run"
    assert [(b["peer_id"], b["reason"]) for b in listing["bans"]] == [(peer, "poisoned gradients")]
    assert RunAuthority(state_dir).is_banned(peer) is not None
    assert main(["authorizer", "list", "--state-dir", str(state_dir)]) == 0
    assert "poisoned gradients" in capsys.readouterr().out
    assert main(["authorizer", "unban", peer, "--state-dir", str(state_dir)]) == 0
    assert main(["authorizer", "list", "--json", "--state-dir", str(state_dir)]) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1])["bans"] == []


def test_list_reads_the_admissions_of_an_older_state_dir_once_imported(tmp_path, capsys):
    """An authorizer state directory from before the admission log kept its nodes in admitted.json:
    `list` (like `serve`) imports it into admitted.sqlite once and shows them."""
    state = tmp_path / "older-state"
    RunAuthority(state, run_id="older-run")
    peer = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    entry = {"peer_id": peer, "role": "worker", "stage": 0, "address": "198.51.100.7:7000", "device": "cpu",
             "admitted_at": time.time(), "expires_at": time.time() + 600}
    (state / "admitted.json").write_text(json.dumps([entry]))
    for _ in range(2):
        assert main(["authorizer", "list", "--json", "--state-dir", str(state)]) == 0
        assert [node["peer_id"] for node in json.loads(capsys.readouterr().out)["admitted"]] == [peer]
    assert not (state / "admitted.json").exists() and (state / "admitted.json.imported").exists()
    assert (state / "admitted.sqlite").exists()


def test_help_and_the_ban_commands_start_without_torch_or_hivemind(state_dir):
    """An operator's quick commands (and `--help`) do not pay seconds for torch and hivemind, which
    only the commands that compute or join the DHT import."""
    peer = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    script = (
        "import contextlib, io, sys\n"
        "from agora.node.cli import build_parser, main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    build_parser().parse_args(['--help'])\n"
        f"assert main(['--threads', '1', 'authorizer', 'ban', {peer!r}, '--state-dir', {str(state_dir)!r}]) == 0\n"
        f"assert main(['authorizer', 'unban', {peer!r}, '--state-dir', {str(state_dir)!r}]) == 0\n"
        "print(sorted(name for name in ('torch', 'hivemind') if name in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", done.stdout


@pytest.mark.parametrize("argv, message", [
    (["ban", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "--state-dir", "{missing}"], "holds no authorizer"),
    (["ban", "not-a-peer-id!", "--state-dir", "{state}"], "PEER_ID: expected a base58"),
    (["issue", "--role", "worker", "--out", "{tmp}/w", "--state-dir", "{state}"], "--stage: a worker credential needs"),
    (["issue", "--role", "trainer", "--stage", "0", "--out", "{tmp}/t", "--state-dir", "{state}"],
     "--stage: a trainer credential takes no"),
    (["serve", "--state-dir", "{tmp}/new", "--run-id", "bad id!"], "authorizer.run_id: letters, digits"),
    (["serve", "--state-dir", "{tmp}/new2"], "give --run-id"),
    (["serve", "--state-dir", "{state}", "--min-ram-gb", "-1"], "authorizer.floors.min_ram_gb: must be >= 0, got -1"),
])
def test_mistakes_are_one_line_and_exit_2(state_dir, tmp_path, capsys, argv, message):
    values = {"state": str(state_dir), "tmp": str(tmp_path), "missing": str(tmp_path / "nothing")}
    assert main(["authorizer", *[a.format(**values) for a in argv]]) == 2
    line = _error_line(capsys)
    assert line.startswith("agora-node authorizer: error:") and message in line, line


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_served_authorizer_admits_a_node_and_stops_cleanly(tmp_path, capsys):
    state, ready = tmp_path / "state", tmp_path / "ready.txt"
    peers = "/ip4/203.0.113.5/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    command = [sys.executable, "-m", "agora.node.cli", "--threads", "1", "authorizer", "serve",
               "--state-dir", str(state), "--run-id", "mp-run", "--ready-file", str(ready), "--stages", "3",
               "--steps", "50", "--min-upload-mbit", "0", "--min-download-mbit", "0", "--max-rtt-ms", "inf",
               "--min-accelerator-gb", "0", "--min-ram-gb", "0", "--preflight-bytes", str(256 << 10),
               "--credential-lifetime", "120", "--local-network", "--metrics-port", "auto", "--metrics-file",
               str(tmp_path / "metrics.txt"), "--initial-peers", peers]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():  # the readiness handshake: written atomically once serving
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the authorizer did not become ready"
            time.sleep(0.05)
        address, fingerprint = ready.read_text().split()
        ticket = JoinFile.read(state / "join.json")
        assert (ticket.authorizer, ticket.root_fingerprint, ticket.run_id) == (address, fingerprint, "mp-run")

        node = NodeCredentials(tmp_path / "node", clock=time.time)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        joined = run(admit(ticket.authorizer, ticket.root_fingerprint, node, role="worker",
                           fingerprint=lambda config: run_fingerprint(config_from_dict(config)).text(),
                           announce=("127.0.0.1", port)))
        assert joined.stage == 0 and joined.initial_peers == (peers,)
        assert run_fingerprint(config_from_dict(joined.config)) == run_fingerprint(PRESETS["tiny"].with_stages(3))
        assert node.identity().role == "worker"
        other_seed = dataclasses.replace(run_fingerprint(PRESETS["tiny"].with_stages(3)), seed=1).text()
        with pytest.raises(AdmissionRefused, match="seed=1"):
            run(admit(ticket.authorizer, ticket.root_fingerprint, NodeCredentials(tmp_path / "other", clock=time.time),
                      role="monitor", fingerprint=other_seed))
        metrics = urllib.request.urlopen(f"http://{(tmp_path / 'metrics.txt').read_text().strip()}/metrics").read()
        assert b'agora_authorizer_refusals_total{field="fingerprint.seed"} 1.0' in metrics

        assert main(["authorizer", "list", "--json", "--state-dir", str(state)]) == 0
        listing = json.loads(capsys.readouterr().out)
        assert [entry["peer_id"] for entry in listing["admitted"]] == [node.peer_id]
        assert main(["authorizer", "issue", "--role", "trainer", "--out", str(tmp_path / "ops"),
                     "--state-dir", str(state)]) == 0
        minted = NodeCredentials(tmp_path / "ops", clock=time.time).run_info()
        assert minted.config == joined.config and minted.initial_peers == (peers,) and minted.authorizer == address
    finally:
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert f"serving at {address}" in out and fingerprint in out
    assert not ready.exists(), "the ready file is removed on a clean stop"


def test_stage_coverage_prefers_the_stage_with_least_announced_throughput():
    from agora.auth.policy import assign_stage
    from agora.auth.admitted import AdmittedNode
    from agora.dht.records import WorkerRecord
    from agora.node.authorizer import stage_coverage

    def record(stage: int, throughput: float, phase: str = "member") -> WorkerRecord:
        return WorkerRecord(peer_id=f"peer{stage}{throughput}", run_id="r", endpoint="127.0.0.1:1", stage=stage,
                            n_stages=3, throughput=throughput, queue_depth=0, step=0, phase=phase, version="1",
                            updated_at=0.0, fingerprint="f")

    def admitted(stage: int) -> AdmittedNode:
        return AdmittedNode(peer_id=f"p{stage}", role="worker", stage=stage, address="127.0.0.1:1", device="cpu",
                            admitted_at=0.0, expires_at=1.0)

    # Stage 1 has two workers but they are slow; stage 2's only worker is leaving.
    workers = {0: [record(0, 900.0)], 1: [record(1, 200.0), record(1, 250.0)], 2: [record(2, 800.0, "leaving")]}
    coverage = stage_coverage(3, workers, [admitted(0), admitted(1), admitted(1), admitted(2)])
    assert assign_stage(3, coverage, None) == 2
    workers[2] = [record(2, 800.0)]
    assert assign_stage(3, stage_coverage(3, workers, []), None) == 1
    # Nobody has measured yet: the stage with fewer admitted workers comes first, not always stage 0.
    fresh = stage_coverage(3, {}, [admitted(0), admitted(1)])
    assert assign_stage(3, fresh, None) == 2
    assert assign_stage(3, stage_coverage(3, {}, [admitted(0), admitted(2)]), None) == 1
