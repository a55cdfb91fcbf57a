"""`python -m agora.node ...` is `agora-node ...` (the console script's entry point too).

SIGTERM is taken over before anything heavy is imported. A swarm role (bootstrap, join, trainer,
monitor, authorizer) told to stop while it is still starting (importing torch, being admitted,
joining the DHT) stops there and exits 0: it has nothing to withdraw or save, and it installs its
own handler (a clean leave) once it serves. Any other command stops as if interrupted (exit 130).
"""

import atexit
import faulthandler
import os
import signal
import sys
import threading
from typing import NoReturn

from agora.node.demo.launcher import leave, warm_up  # the standard library alone: nothing heavy


SERVICES = {"bootstrap", "join", "trainer", "monitor", "authorizer"}
# agora-node's options before the subcommand that take a value (node/cli.py's build_parser; a test
# holds the two equal: the parser itself cannot be imported this early).
GLOBAL_OPTIONS_WITH_VALUES = ("--log-level", "--log-format", "--threads")
# How long a stop that did not end the start waits before it is delivered again.
REDELIVER_S = 1.0
# CUDA's caching allocator grows segments in place rather than caching fixed-size blocks that the
# next microbatch shape cannot reuse: on an H200 a pluralis-8b body stage at 5 x 4096 tokens peaked
# 7.7 GiB lower (bench/results/gpu.md). Read when torch first touches CUDA; a user's own setting wins.
CUDA_ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def _command(argv: list[str]) -> str | None:
    """The subcommand: the first argument that is not an option or an option's value. Global options
    come first (`agora-node --log-level INFO join ...`, as the demo starts its children)."""
    words = iter(argv)
    for word in words:
        if word in GLOBAL_OPTIONS_WITH_VALUES:
            next(words, None)  # its value
        elif not word.startswith("-"):
            return word
    return None


def _stop_while_starting(signum, frame) -> None:
    if _command(sys.argv[1:]) in SERVICES:
        os.write(2, b"agora-node: stopped (SIGTERM) before it was serving\n")
        _deliver_again_unless_leaving(signum)
        raise SystemExit(0)
    raise KeyboardInterrupt


def _deliver_again_unless_leaving(signum: int) -> None:
    """Python drops an exception raised inside a finalizer or an at-fork hook ("Exception ignored
    in ..."), and a role forks its helpers while it starts (hivemind's DHT and p2pd). Then the exit
    above never happens, and the role, once serving, would wait for a stop that was already sent
    until its supervisor kills it. So the signal comes again a moment later unless the process is
    leaving by then: to this handler if it is still starting, to the role's own (a clean leave) if
    it serves."""
    again = threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signum))
    again.daemon = True
    atexit.register(again.cancel)
    again.start()


def dump_stacks_on_sigusr1() -> None:
    """SIGUSR1 writes every thread's stack to stderr, from C: it works while the main thread is stuck
    where no Python signal handler runs (a supervisor sends it before it kills a role that did not
    stop; node/demo/processes.py)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def _warm_up_for_a_demo(argv: list[str]) -> None:
    """`agora-node demo` starts its children's fork server (node/demo/launcher.py) before its own
    imports: the server's 3+ s of imports are the demo's critical path to its first child, and
    they overlap the demo's own 1.5 s of imports here instead of following them."""
    if _command(argv) == "demo" and not {"-h", "--help"} & set(argv):
        warm_up()


def main() -> NoReturn:
    """The console script: runs the command, then exits without the interpreter's teardown of torch
    and the rest (node/demo/launcher.py's `leave`), half a second or more after every command."""
    signal.signal(signal.SIGTERM, _stop_while_starting)
    dump_stacks_on_sigusr1()
    os.environ.setdefault(*CUDA_ALLOCATOR_ENV)
    try:
        _warm_up_for_a_demo(sys.argv[1:])
        from agora.node.cli import main as cli_main

        code = cli_main()
    except SystemExit as exit:
        code = exit.code
    leave(code)


if __name__ == "__main__":
    main()
