"""Start `agora-node <role>` children as forks of a server that has imported agora-node once.

Exec'ing `python -m agora.node <role>` costs each child about 3 s of CPU for imports (torch,
hivemind, grpc, and torch._dynamo, which torch.optim imports on first use). A 3-stage demo
starts 6 to 10 children at once, so on a 2-core machine most of its start went to imports. Here
one server process (`python -m agora.node.demo.launcher`, started by the supervisor) imports
PRELOAD, and each child is a fork of it that runs `python -m agora.node` on its argv (runpy, as
the interpreter does for -m): the same main, and no import of it here. A supervisor may name
another module to run so (bench/dht_scale.py's DHT peers: programs that need what agora-node
imports, and are many).

Why a server and not a fork of the supervisor: the supervisor (the demo, a test, the WAN bench)
has threads and event loops of its own, and a fork of a threaded process can inherit a held lock.
The server is single-threaded and has done nothing but import. Why not multiprocessing's fork
server, which is the same idea: it runs the supervisor's main module again in every child, so a
script without an `if __name__ == "__main__"` guard starts a demo inside each child, and one read
from stdin has no module to run.

The protocol is two pipes: the supervisor writes one JSON request per child; the server forks,
answers with the child's pid, and later with its exit code (it reaps its children). The server
exits at once when the request pipe closes, i.e. when the supervisor is gone, even by kill -9.

A child gets what an exec'd child got: its own session (a terminal's Ctrl-C reaches only the
supervisor), stdin from /dev/null, stdout and stderr into its log, its working folder, the
environment it was given (replacing the server's whole), sys.argv, torch's intra-op threads from
OMP_NUM_THREADS (libgomp read that variable when the server loaded torch), and optionally a
network namespace (the WAN harness's, entered with setns(2) where `ip netns exec` would have done
it). It has its own copies of hivemind's per-process multiprocessing locks, which the server's
import created and a fork would share with every sibling. Its process name (`ps -o comm`) is its
role's name. It leaves as the interpreter would (its threads joined, atexit handlers run, output
flushed) but without the interpreter's teardown, which would walk every object the server imported
and copy each page it touches: 0.35 s of CPU for a child that did nothing, about 1 s for a worker at
load, paid by every role at once when a swarm stops. It dies with its supervisor: its parent-death signal (node/cli.py) is
armed against the server, which exits when the supervisor does. A child that exec's itself (a
worker moving stage) keeps all of it.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import NoReturn

from agora.node.demo.supervision import PARENT_PID_ENV

__all__ = ["launch", "leave", "warm_up", "LaunchedProcess", "LauncherError", "PRELOAD"]

# What every role imports (node/cli.py's handlers import their modules lazily); a module that
# fails to import here is only imported later, in the child that needs it, which then says why.
# Not agora.node.__main__: runpy runs it afresh in each child, and warns when it is imported already.
PRELOAD = ["agora.node.cli", "agora.node.worker.join", "agora.node.worker.worker",
           "agora.node.membership.rebalance", "agora.node.trainer.command", "agora.node.trainer.trainer",
           "agora.node.trainer.announce", "agora.node.admission", "agora.node.plan", "agora.node.rpc.server",
           "agora.node.inference.commands", "agora.node.authorizer", "agora.node.export", "agora.dht.bootstrap",
           "agora.dht.swarm", "agora.monitor.service", "agora.auth.service", "agora.pipeline.runtime",
           "agora.pipeline.checkpoint", "agora.pipeline.data", "agora.pipeline.memory", "torch._dynamo"]

# What a child runs, as `python -m` would: agora-node's console script (node/__main__.py).
AGORA_NODE_MODULE = "agora.node"
START_TIMEOUT_S = 300.0  # the server's imports, on a loaded machine
_CLONE_NEWNET = 0x40000000
_PR_SET_NAME = 15
_UNKNOWN_EXIT = 255  # the server died before it could say how a child ended
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


class LauncherError(RuntimeError):
    pass


class LaunchedProcess:
    """A launched child, read like a `subprocess.Popen`: pid, args (the equivalent command line),
    returncode (negative: the signal that killed it), poll() and wait(timeout)."""

    def __init__(self, args: list[str]):
        self.args = args
        self.pid: int | None = None
        self.returncode: int | None = None
        self._started = threading.Event()
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()


class _Server:
    """The supervisor's end of one server: its process, the request pipe, and a thread that reads
    its replies (pids, then exit codes) into the LaunchedProcess they belong to."""

    def __init__(self):
        requests_r, self._requests = os.pipe()
        self._replies, replies_w = os.pipe()
        # Without the thread-count variables: torch reads them when the server imports it, and each
        # child sets its own from the environment it is given.
        env = {key: value for key, value in os.environ.items() if key not in _THREAD_VARIABLES}
        self.process = subprocess.Popen([sys.executable, "-m", "agora.node.demo.launcher", str(requests_r),
                                         str(replies_w)], pass_fds=(requests_r, replies_w), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, env=env)
        os.close(requests_r)
        os.close(replies_w)
        self._lock = threading.Lock()
        self._pending: dict[int, LaunchedProcess] = {}
        self._running: dict[int, LaunchedProcess] = {}
        self._next = 0
        self.alive = True
        threading.Thread(target=self._read, name="launcher-replies", daemon=True).start()

    def launch(self, request: dict, handle: LaunchedProcess) -> None:
        with self._lock:
            if not self.alive:
                raise LauncherError("the launcher's server is gone")
            self._next += 1
            self._pending[self._next] = handle
            try:
                _write_all(self._requests, (json.dumps({"id": self._next, **request}) + "\n").encode())
            except OSError as error:
                raise LauncherError(f"the launcher's server is gone: {error}") from None
        if not handle._started.wait(START_TIMEOUT_S) or handle.pid is None:
            raise LauncherError(f"the launcher's server did not start {request['name']} within "
                                f"{START_TIMEOUT_S:.0f} s (exit code {self.process.poll()})")

    def _read(self) -> None:
        buffer = b""
        while True:
            chunk = os.read(self._replies, 65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                reply = json.loads(line)
                with self._lock:
                    if "launched" in reply:
                        handle = self._pending.pop(reply["launched"])
                        handle.pid = reply["pid"]
                        self._running[handle.pid] = handle
                        handle._started.set()
                    elif (handle := self._running.pop(reply["exited"], None)) is not None:
                        handle._exit(reply["code"])
        with self._lock:  # the server died: its children die with it (their parent-death signal)
            self.alive = False
            for handle in [*self._pending.values(), *self._running.values()]:
                handle._started.set()
                handle._exit(_UNKNOWN_EXIT)
            self._pending.clear()
            self._running.clear()
        os.close(self._replies)
        self.process.wait()  # reaped here, not left a zombie for the rest of the supervisor's life


_server: _Server | None = None
_server_lock = threading.Lock()


def _current_server() -> _Server:
    global _server
    with _server_lock:
        if _server is None or not _server.alive:
            _server = _Server()
        return _server


def warm_up() -> None:
    """Start the server now, so that its imports overlap what the supervisor does before its
    first child (the demo mints the operator's credential meanwhile). Idempotent."""
    _current_server()


def launch(argv: list[str], *, env: dict[str, str], log_path: Path, cwd: Path, name: str,
           namespace: str | None = None, module: str = AGORA_NODE_MODULE) -> LaunchedProcess:
    """Start `python -m <module> *argv` (`agora-node *argv` by default) as a fork of the server; its
    output goes to `log_path`, which must exist (the supervisor creates it, so that a child that dies
    at once still has a log)."""
    handle = LaunchedProcess([sys.executable, "-m", module, *argv])
    request = {"argv": list(argv), "env": dict(env), "log": str(log_path), "cwd": str(cwd), "name": name,
               "namespace": namespace, "module": module}
    _current_server().launch(request, handle)
    return handle


# ----------------------------------------------------------------------------- the server's side


def _serve(requests: int, replies: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the supervisor's to handle
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    # What the imports made lives as long as any child: freezing it keeps each child's collections,
    # and its teardown at exit, from walking it (and copying every page they touch). A launched
    # bootstrap left in 0.3 s after SIGTERM with this, 1.1 s without it, an exec'd one in 0.7 s.
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    own = (requests, replies, wake_r, wake_w)
    buffer = b""
    while True:
        readable, _, _ = select.select([requests, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap(replies)
        if requests in readable:
            chunk = os.read(requests, 1 << 20)
            if not chunk:
                os._exit(0)  # the supervisor is gone; the children's parent-death signal fires now
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _become(request, own)  # never returns: it exits through the interpreter
                _reply(replies, {"launched": request["id"], "pid": pid})


def _reap(replies: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply(replies, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _reply(replies: int, message: dict) -> None:
    try:
        _write_all(replies, (json.dumps(message) + "\n").encode())
    except BrokenPipeError:  # the supervisor is gone (stopped while a child was starting): as on EOF
        os._exit(0)


def _become(request: dict, own: tuple[int, ...]) -> None:
    """The child's side: become what an exec'd `python -m <module>` would be, then run it."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in own:
        os.close(fd)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NAME, request["name"].encode()[:15], 0, 0, 0)
    if request["namespace"] is not None:
        _enter_network_namespace(libc, request["namespace"])
    os.chdir(request["cwd"])
    _own_process_locks()
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    if PARENT_PID_ENV in env:
        os.environ[PARENT_PID_ENV] = str(os.getppid())  # the server, which dies with the supervisor
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    # What the interpreter does for `-m`: the package's __main__ runs as __main__, sys.argv[0] its
    # path. agora-node takes over SIGTERM first, so a role stopped while starting exits 0 there.
    module = request.get("module", AGORA_NODE_MODULE)
    sys.argv = [module, *request["argv"]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        leave(exit.code)
    leave(0)  # it returned without exiting, as a script that ends does


def leave(code: int | str | None) -> NoReturn:
    """Exit with `code` as SystemExit would, after what the interpreter's exit does first (join the
    threads that are not daemons, run the atexit handlers, which stop the role's helper processes and
    flush its logs), and without its teardown (module docstring; agora-node's own exit too)."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): the message on stderr, status 1
        print(code, file=sys.stderr)
        status = 1
    threading._shutdown()  # what Py_Finalize does first: waits for the threads that are not daemons
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status & 0xFF)


def _own_process_locks() -> None:
    """Give this child its own copies of the multiprocessing locks hivemind keeps per process.

    hivemind creates them as class attributes when it is imported, so here they were made by the
    server. Each is a POSIX semaphore in memory that a fork shares, so every launched role would
    share one lock with every sibling. Two things follow. Live roles contend with one another:
    SharedBytes holds its lock while it starts torch's shared-memory manager, 0.1 to 0.4 s. And
    a role killed -9 while holding a lock leaves it held, which blocked every role started after
    it (a chaos newcomer hung in MPFuture's first shared byte). An exec'd role made its own, and
    so does a launched one now. Its own DHT and averager processes then share its locks, as
    hivemind intends."""
    import multiprocessing

    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()  # new _initialization_lock, _update_lock, SharedBytes._lock
    wrapper = getattr(sys.modules.get("hivemind.utils.asyncio"), "_AsyncContextWrapper", None)
    if wrapper is not None:
        wrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def _enter_network_namespace(libc: ctypes.CDLL, namespace: str) -> None:
    """What `ip netns exec NAME` does for the network: join the namespace `ip netns add` pinned."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into network namespace {namespace!r}: {os.strerror(error)}")
    finally:
        os.close(fd)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
