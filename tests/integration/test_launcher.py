"""A launched `agora-node <role>` (node/demo/launcher.py) is what an exec'd one was: its own session,
stdin from /dev/null, output in its log, the group's folder, its role's process name, the console
script's exit codes and SIGTERM rule, and it dies with its supervisor even after a kill -9 there."""

from __future__ import annotations

import os
import platform
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agora.node.demo.launcher import LaunchedProcess
from agora.node.demo.processes import ProcessGroup, agora_node_command

pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

READY_S = 120


def _bootstrap(group: ProcessGroup, ready: Path):
    return group.spawn("bootstrap", agora_node_command("--threads", "1", "bootstrap", "--insecure", "--host",
                                                       "127.0.0.1", "--ready-file", str(ready)), ready)


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def test_a_launched_role_has_its_own_session_log_folder_and_name_and_stops_on_sigterm(tmp_path):
    group = ProcessGroup(tmp_path, env={"OMP_NUM_THREADS": "1"})
    try:
        boot = _bootstrap(group, tmp_path / "boot.ready")
        maddrs = group.wait_ready([boot], READY_S)["bootstrap"]
        assert maddrs and maddrs[0].startswith("/ip4/127.0.0.1/")
        pid = boot.pid
        assert int(_stat(pid)[3]) == pid  # a session of its own, so a terminal's Ctrl-C misses it
        assert Path(f"/proc/{pid}/comm").read_text().strip() == "bootstrap"
        assert Path(os.readlink(f"/proc/{pid}/cwd")) == tmp_path
        assert os.readlink(f"/proc/{pid}/fd/0") == os.devnull
        assert Path(os.readlink(f"/proc/{pid}/fd/1")) == Path(os.readlink(f"/proc/{pid}/fd/2")) == boot.log_path
        assert boot.process.args[:3] == agora_node_command()
        codes = group.stop([boot])
    finally:
        group.shutdown()
    assert codes == {"bootstrap": 0}
    assert "bootstrap" in boot.log_path.read_text()


def test_a_launched_role_reports_a_user_error_in_its_log_with_exit_2_and_a_kill_as_minus_9(tmp_path):
    group = ProcessGroup(tmp_path)
    try:
        wrong = group.spawn("wrong", agora_node_command("join", "--stage", "0", "--insecure", "--config", "nonesuch"))
        assert wrong.process.wait(READY_S) == 2
        assert "error:" in wrong.log_tail() and "nonesuch" in wrong.log_tail()
        boot = _bootstrap(group, tmp_path / "boot.ready")
        group.wait_ready([boot], READY_S)
        group.kill(boot)
        assert boot.process.returncode == -signal.SIGKILL
    finally:
        group.shutdown()


def test_a_group_launches_the_other_modules_it_lists_and_execs_any_other(tmp_path):
    group = ProcessGroup(tmp_path, launched_modules=("agora.node", "platform"))
    try:
        launched = group.spawn("platform", [sys.executable, "-m", "platform", "--terse"])
        execd = group.spawn("calendar", [sys.executable, "-m", "calendar", "2026", "1"])  # not listed
        assert launched.process.wait(READY_S) == 0 and execd.process.wait(READY_S) == 0
    finally:
        group.shutdown()
    assert isinstance(launched.process, LaunchedProcess) and isinstance(execd.process, subprocess.Popen)
    assert launched.process.args[:3] == [sys.executable, "-m", "platform"]
    assert platform.platform(terse=True) in launched.log_path.read_text()
    assert "January 2026" in execd.log_path.read_text()


# A supervisor without a main guard: `hold` prints the launched bootstrap's pid and waits to be
# killed; `stop` prints whether it was launched and its exit code.
SUPERVISOR = textwrap.dedent("""
    import sys
    from pathlib import Path
    from agora.node.demo.launcher import LaunchedProcess
    from agora.node.demo.processes import ProcessGroup, agora_node_command
    work = Path(sys.argv[1])
    group = ProcessGroup(work)
    ready = work / "boot.ready"
    boot = group.spawn("bootstrap", agora_node_command("--threads", "1", "bootstrap", "--insecure", "--host",
                                                       "127.0.0.1", "--ready-file", str(ready)), ready)
    try:
        group.wait_ready([boot], 120)
        if sys.argv[2] == "hold":
            print(boot.pid, flush=True)
            sys.stdin.read()  # until the test kills this process
        print(isinstance(boot.process, LaunchedProcess), group.stop([boot]), flush=True)
    finally:
        group.shutdown()
""")


def _in_folder(folder: Path) -> list[int]:
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(os.readlink(f"/proc/{entry}/cwd")) == folder and _stat(int(entry))[0] != "Z":
                pids.append(int(entry))
        except OSError:
            pass
    return pids


def test_a_launched_role_and_its_helpers_die_with_a_supervisor_killed_with_sigkill(tmp_path):
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path), "hold"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watched: list[int] = []
    try:
        line = supervisor.stdout.readline()  # the handshake: the bootstrap is serving
        assert line.strip().isdigit(), supervisor.stderr.read()
        role = int(line)
        family = _in_folder(tmp_path)  # the role, its DHT process, their p2pd
        assert role in family and len(family) >= 2
        watched = [os.pidfd_open(pid) for pid in family]
        supervisor.kill()
        supervisor.wait()
        pending = list(watched)
        while pending:  # a pidfd becomes readable when its process exits
            readable, _, _ = select.select(pending, [], [], 60)
            assert readable, f"still running 60 s after the supervisor was killed: {_in_folder(tmp_path)}"
            pending = [fd for fd in pending if fd not in readable]
    finally:
        for fd in watched:
            os.close(fd)
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
        for pid in _in_folder(tmp_path):
            os.kill(pid, signal.SIGKILL)


def test_a_supervisor_script_without_a_main_guard_read_from_stdin_launches_its_children(tmp_path):
    # multiprocessing's fork server would run this script again in each child (no guard: a second
    # group, a second bootstrap), and read from stdin it has no file to run.
    supervisor = subprocess.run([sys.executable, "-", str(tmp_path), "stop"], input=SUPERVISOR, capture_output=True,
                                text=True, timeout=150)
    assert supervisor.returncode == 0, supervisor.stderr
    assert supervisor.stdout.split() == ["True", "{'bootstrap':", "0}"]


def test_a_launched_role_killed_holding_hiveminds_locks_blocks_no_sibling():
    """hivemind's per-process multiprocessing locks are made when it is imported, i.e. in the
    server, and a fork shares them: a role killed -9 inside one (a chaos kill while MPFuture made its
    first shared byte) hung every role launched after it. Here a fork of this process takes the
    role's side (`_own_process_locks`, as a launched child does), takes every one of those locks and
    dies holding them; this process, a sibling's stand-in, must still get each at once."""
    from hivemind.utils import asyncio as hivemind_asyncio
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    from agora.node.demo.launcher import _own_process_locks

    def locks():
        return [MPFuture._initialization_lock, MPFuture._update_lock, SharedBytes._lock,
                hivemind_asyncio._AsyncContextWrapper.EXECUTOR_LOCK]

    ours = locks()
    taken_r, taken_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the launched role
        try:
            _own_process_locks()
            mine = locks()
            for lock in mine:
                lock.acquire()
            os.write(taken_w, b"1" if not any(a is b for a, b in zip(mine, ours)) else b"0")
        finally:
            os._exit(0)  # dies without releasing anything
    os.close(taken_w)
    try:
        assert os.read(taken_r, 1) == b"1"
    finally:
        os.close(taken_r)
        os.waitpid(pid, 0)
    for lock in ours:
        assert lock.acquire(timeout=5), lock
        lock.release()

