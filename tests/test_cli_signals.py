"""SIGTERM while a role is still starting: a clean exit 0, not death by signal (a demo or a
supervisor that stops a newcomer mid-import must not read it as a crash)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agora.node.__main__ import GLOBAL_OPTIONS_WITH_VALUES, SERVICES, _stop_while_starting

pytestmark = pytest.mark.timeout(120)


def _catches_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def test_a_swarm_role_stops_cleanly_and_a_job_stops_as_interrupted(monkeypatch):
    assert {"join", "trainer", "bootstrap"} <= SERVICES
    monkeypatch.setattr(sys, "argv", ["agora-node", "join"])
    with pytest.raises(SystemExit) as stopped:
        _stop_while_starting(signal.SIGTERM, None)
    assert stopped.value.code == 0
    monkeypatch.setattr(sys, "argv", ["agora-node", "--log-level", "INFO", "--threads", "1", "join"])
    with pytest.raises(SystemExit) as stopped:  # global options first, as the demo starts its children
        _stop_while_starting(signal.SIGTERM, None)
    assert stopped.value.code == 0
    monkeypatch.setattr(sys, "argv", ["agora-node", "train-local"])
    with pytest.raises(KeyboardInterrupt):
        _stop_while_starting(signal.SIGTERM, None)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_joiner_told_to_stop_before_it_serves_exits_0():
    # An initial peer nobody listens on: the joiner cannot get past joining the DHT, so the
    # SIGTERM (sent once the process catches it, read from /proc) lands before it serves.
    child = subprocess.Popen([sys.executable, "-m", "agora.node", "join", "--insecure", "--stage", "0",
                              "--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/QmNoBodyListensHereNoBodyListensHereNoBody1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _catches_sigterm(child.pid):
            assert child.poll() is None and time.monotonic() < deadline, "the joiner never installed its handler"
            time.sleep(0.01)
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0, err
    assert "stopped (SIGTERM) before it was serving" in err


def test_the_early_handler_knows_every_global_option_that_takes_a_value():
    from agora.node.cli import build_parser

    parser = build_parser()
    taking = {option for action in parser._actions if action.option_strings and action.nargs != 0
              and action.dest not in ("help", "command") for option in action.option_strings}
    assert taking == set(GLOBAL_OPTIONS_WITH_VALUES)
