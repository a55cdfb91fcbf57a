"""Child processes of a local swarm: real `agora-node <role>` processes, always reaped.

Each child runs in its own session (so a terminal's Ctrl-C reaches only the parent, which then
stops the children in order), writes its output to `<workdir>/<name>.log`, and signals readiness
by atomically writing a ready file (never by a sleep). `shutdown` sends SIGTERM, waits, then
SIGKILLs whatever is left, so no process outlives the group.

A command that is `agora_node_command(...)` is not exec'd: it runs as a fork of a server that has
imported agora-node once (node/demo/launcher.py), the same main with the same argv, environment,
session and log, without the 3 s of imports per child. So does `python -m M ...` for any other
module M a group lists in `launched_modules` (a bench's peer program). Any other command is exec'd.

A `Placement` says where each child runs: on this machine's loopback by default; the WAN harness
(bench/wan/) gives each its own network namespace (entered by the launched child, or with `ip
netns exec NS` for an exec'd command) and the address it listens on and announces.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from agora.node.demo.launcher import AGORA_NODE_MODULE, LaunchedProcess, LauncherError, launch
from agora.node.demo.supervision import PARENT_PID_ENV

logger = logging.getLogger("agora.node.demo")

__all__ = ["ChildProcess", "ProcessGroup", "ChildFailed", "Placement", "LOOPBACK", "agora_node_command"]


class ChildFailed(RuntimeError):
    pass


def agora_node_command(*args: str) -> list[str]:
    """The `agora-node ...` command line, run by this interpreter (no PATH lookup needed)."""
    return [sys.executable, "-m", AGORA_NODE_MODULE, *args]


def _dump_stacks(child: ChildProcess) -> None:
    """A child that did not stop within its grace: its threads' stacks go to its log (SIGUSR1, which
    agora-node answers from C, node/__main__.py) before it is killed, so where it hung is known."""
    logger.warning("%s did not stop within its grace; its threads' stacks are in its log", child.name,
                   extra={"milestone": "stop_timeout", "fields": {"child": child.name}})
    try:
        os.kill(child.pid, signal.SIGUSR1)
        child.process.wait(timeout=1.0)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_child(pid: int) -> None:
    """SIGKILL the child and its group. The child itself too: a launched child that has not yet
    made its own session (its first instructions) is in no group of its own."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _kill_group(pid)


def _no_namespace(name: str) -> str | None:
    return None


def _loopback(name: str) -> str:
    return "127.0.0.1"


@dataclass(frozen=True)
class Placement:
    """Where the child called `name` runs: in network namespace `namespace(name)` (None: this
    machine's), listening on and announcing the address `host(name)`."""

    namespace: Callable[[str], str | None] = _no_namespace
    host: Callable[[str], str] = _loopback


LOOPBACK = Placement()


@dataclass
class ChildProcess:
    name: str
    process: subprocess.Popen | LaunchedProcess
    log_path: Path
    ready_path: Path | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class ProcessGroup:
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    children: list[ChildProcess] = field(default_factory=list)
    placement: Placement = LOOPBACK
    # Modules whose `python -m` commands run as forks of the launcher's server (module docstring).
    launched_modules: tuple[str, ...] = (AGORA_NODE_MODULE,)

    def host(self, name: str) -> str:
        """The address the child `name` listens on and announces."""
        return self.placement.host(name)

    def spawn(self, name: str, command: list[str], ready_path: Path | None = None) -> ChildProcess:
        if ready_path is not None and ready_path.exists():
            ready_path.unlink()
        log_path = self.workdir / f"{name}.log"
        # The child dies with this process, even by kill -9 (node/cli.py's parent-death signal).
        env = {**os.environ, **self.env, PARENT_PID_ENV: str(os.getpid())}
        namespace = self.placement.namespace(name)
        with open(log_path, "wb") as log:
            if command[:2] == [sys.executable, "-m"] and command[2:3] and command[2] in self.launched_modules:
                try:
                    process = launch(command[3:], env=env, log_path=log_path, cwd=self.workdir, name=name,
                                     namespace=namespace, module=command[2])
                except LauncherError as error:
                    raise ChildFailed(f"{name} could not be started: {error}") from None
            else:
                inside = [] if namespace is None else ["ip", "netns", "exec", namespace]
                process = subprocess.Popen([*inside, *command], stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=env, start_new_session=True, cwd=self.workdir)
        child = ChildProcess(name, process, log_path, ready_path)
        self.children.append(child)
        return child

    def wait_ready(self, children: list[ChildProcess], timeout_s: float,
                   on_wait: Callable[[], None] | None = None) -> dict[str, list[str]]:
        """Until every child has written its ready file; its lines by child name."""
        deadline = time.monotonic() + timeout_s
        pending = {c.name: c for c in children}
        ready: dict[str, list[str]] = {}
        pause = 0.02
        while pending:
            for name, child in list(pending.items()):
                if child.ready_path is not None and child.ready_path.exists():
                    ready[name] = child.ready_path.read_text().split()
                    del pending[name]
                elif not child.alive():
                    raise ChildFailed(f"{name} exited with code {child.process.returncode} before it was ready:\n"
                                      f"{child.log_tail()}")
            if not pending:
                break
            if time.monotonic() > deadline:
                raise ChildFailed(f"{', '.join(pending)} not ready within {timeout_s:.0f} s")
            if on_wait is not None:
                on_wait()
            time.sleep(pause)  # polling a file the child writes atomically; backs off to 0.25 s
            pause = min(pause * 2, 0.25)
        return ready

    def kill(self, child: ChildProcess) -> None:
        """kill -9 the child and everything it started: a machine that vanished."""
        _kill_child(child.pid)
        child.process.wait()

    def stop(self, children: list[ChildProcess], grace_s: float = 20.0) -> dict[str, int]:
        """SIGTERM, wait up to `grace_s`, then SIGKILL; exit codes by name.

        SIGTERM goes to the child alone, so it can leave cleanly (its own helper processes, such
        as hivemind's DHT, must outlive its goodbye); afterwards its whole process group is
        SIGKILLed, which reaps anything it left behind.
        """
        for child in children:
            if child.alive():
                try:
                    os.kill(child.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        codes = {}
        for child in children:
            try:
                codes[child.name] = child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _dump_stacks(child)
                _kill_child(child.pid)
                codes[child.name] = child.process.wait()
            _kill_group(child.pid)
        return codes

    def shutdown(self, grace_s: float = 20.0) -> dict[str, int]:
        """Stop every child, newest first (trainers, then workers, then the bootstrap)."""
        return self.stop(list(reversed(self.children)), grace_s)
