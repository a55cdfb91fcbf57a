"""Start `agora-node <role>` children as forks of a process that has imported agora-node once.

Exec'ing `python -m agora.node <role>` costs each child about 3 s of CPU for imports (torch,
hivemind, grpc, and torch._dynamo, which torch.optim imports on first use). A 3-stage demo
starts 6 to 10 children at once, so on a 2-core machine most of its start went to imports. Here
the standard library's fork server (multiprocessing's "forkserver" start method) imports PRELOAD
once, and each child is a fork of it that runs the console script's entry point on its argv.

Why the fork server and not a plain fork of the supervisor: the supervisor (the demo, a test, the
WAN bench) has threads and event loops of its own, and a fork of a threaded process can inherit
a held lock. The fork server is a fresh single-threaded interpreter that has done nothing but import.

A child gets what an exec'd child got: its own session (a terminal's Ctrl-C reaches only the
supervisor), stdin from /dev/null, stdout and stderr into its log, the group's working folder, the
environment it was given (replacing the server's whole), sys.argv, torch's intra-op threads from
OMP_NUM_THREADS (libgomp read that variable when the server loaded torch), the start method the
supervisor uses (the fork server's children default to "forkserver", which hivemind's averager
must not inherit), and optionally a network namespace (the WAN harness's, entered with setns(2)
where `ip netns exec` would have done it). Its process name (`ps -o comm`) is its role's name.

It still dies with its supervisor, even after a kill -9 there. Its parent is the fork server, so
`node/cli.py`'s parent-death signal is armed against the server. The server exits when the last
holder of its "alive" pipe is gone, and each child closes the copy it inherited at once, so the
supervisor is the only holder left. A child that exec's itself (a worker moving stage) keeps all of it.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["launch", "can_launch", "warm_up", "LaunchedProcess", "PRELOAD"]

# What every role imports (node/cli.py's handlers import their modules lazily); a module that
# fails to import here is only imported later, in the child that needs it.
PRELOAD = ["agora.node.__main__", "agora.node.cli", "agora.node.demo.launcher", "agora.node.worker.join",
           "agora.node.worker.worker", "agora.node.worker.rebalance", "agora.node.trainer.command",
           "agora.node.trainer.trainer", "agora.node.admission", "agora.node.plan", "agora.node.rpc.server",
           "agora.node.inference.commands", "agora.node.authorizer", "agora.dht.bootstrap", "agora.dht.swarm",
           "agora.monitor.service", "agora.auth.service", "agora.pipeline.runtime", "agora.pipeline.checkpoint",
           "agora.pipeline.data", "agora.pipeline.memory", "agora.node.trainer.announce", "agora.node.export",
           "torch._dynamo"]

_CLONE_NEWNET = 0x40000000
_PR_SET_NAME = 15


class LaunchedProcess:
    """A launched child, read like a `subprocess.Popen`: pid, args (the equivalent command line),
    returncode (negative: the signal that killed it), poll() and wait(timeout)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]):
        self._process = process
        self.args = args

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode


def _context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def can_launch() -> bool:
    """Whether this process can fork its children from the fork server. multiprocessing runs the
    supervisor's main module again in each child (as `__mp_main__`), which needs it to be a module or
    a file that still exists, and it passes the working folder, which must exist too. A supervisor
    read from stdin (`python -`) or started from a deleted folder execs its children instead."""
    try:
        os.getcwd()
    except OSError:
        return False
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return True
    path = getattr(main, "__file__", None)
    return path is None or os.path.isfile(path)


def warm_up() -> None:
    """Start the fork server now, so that its imports overlap what the supervisor does before its
    first child (the demo mints the operator's credential meanwhile). Idempotent."""
    if not can_launch():
        return
    _context()
    from multiprocessing import forkserver

    forkserver.ensure_running()


def launch(argv: list[str], *, env: dict[str, str], log_path: Path, cwd: Path, name: str,
           namespace: str | None = None) -> LaunchedProcess:
    """Start `agora-node *argv` as a fork of the fork server; its output goes to `log_path`, which
    must exist (the supervisor creates it, so that a child that dies at once still has a log)."""
    method = multiprocessing.get_start_method(allow_none=True)
    process = _context().Process(target=_child, name=name, daemon=False,
                              args=(list(argv), dict(env), str(log_path), str(cwd), name, namespace, method))
    process.start()
    # Reaped by its supervisor (ProcessGroup), never by multiprocessing's exit hook, which would
    # otherwise wait on a child that outlived a failed shutdown.
    multiprocessing.process._children.discard(process)
    return LaunchedProcess(process, [sys.executable, "-m", "agora.node", *argv])


def _child(argv: list[str], env: dict[str, str], log_path: str, cwd: str, name: str, namespace: str | None,
           method: str | None) -> None:
    """The child's side: become what an exec'd `agora-node` would be, then run its main."""
    from multiprocessing import forkserver

    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    if namespace is not None:
        _enter_network_namespace(libc, namespace)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    from agora.node.__main__ import main
    from agora.node.cli import PARENT_PID_ENV

    if PARENT_PID_ENV in env:
        os.environ[PARENT_PID_ENV] = str(os.getppid())
    multiprocessing.set_start_method(method, force=True)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    sys.argv = ["agora-node", *argv]
    try:
        code = main()  # the console script's entry point: SIGTERM while starting exits 0 there
    finally:
        # The fork server's children leave through os._exit: run what an interpreter runs at exit.
        atexit._run_exitfuncs()
    sys.exit(code)


def _enter_network_namespace(libc: ctypes.CDLL, namespace: str) -> None:
    """What `ip netns exec NAME` does for the network: join the namespace `ip netns add` pinned."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into network namespace {namespace!r}: {os.strerror(error)}")
    finally:
        os.close(fd)
