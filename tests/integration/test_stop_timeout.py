"""A child that does not stop within its grace: its threads' stacks reach its log before it is killed
(node/demo/processes.py), so a hang at shutdown says where it was."""

from __future__ import annotations

import sys
import textwrap

import pytest

from agora.node.demo.processes import ProcessGroup

pytestmark = pytest.mark.timeout(60)

# A role stuck where SIGTERM is not answered: it ignores the signal and waits on a lock forever.
STUCK = textwrap.dedent("""
    import signal, sys, threading
    from agora.node.__main__ import dump_stacks_on_sigusr1
    dump_stacks_on_sigusr1()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    held = threading.Lock()
    held.acquire()
    open(sys.argv[1], "w").write("ready")
    held.acquire()
""")


def test_a_child_that_ignores_its_stop_leaves_its_stacks_in_its_log_and_is_killed(tmp_path):
    group = ProcessGroup(tmp_path)
    ready = tmp_path / "stuck.ready"
    child = group.spawn("stuck", [sys.executable, "-c", STUCK, str(ready)], ready)
    group.wait_ready([child], timeout_s=30)
    codes = group.stop([child], grace_s=0.5)
    assert codes == {"stuck": -9}
    log = child.log_path.read_text()
    assert "most recent call first" in log and "<module>" in log, log
