"""What a supervised `agora-node` child and its supervisor agree on: the variable naming the pid
the child dies with.

A supervisor (node/demo/processes.py's ProcessGroup: the demo, tests, the WAN bench) puts its own
pid there for every child it starts, and the child arms Linux's parent-death signal against it
(`die_with_parent`, the first thing node/cli.py's main does), so a supervisor killed with kill -9
leaves no role behind holding ports and state folders. A launched child's parent is the launcher's
server (node/demo/launcher.py), which exits with the supervisor, so there the server's pid replaces
the supervisor's.

A module of its own because both sides read it: the console script without importing the demo,
the launcher without importing the console script.
"""

import os
import sys

__all__ = ["PARENT_PID_ENV", "die_with_parent"]

PARENT_PID_ENV = "AGORA_NODE_PARENT_PID"


def die_with_parent() -> None:
    """A supervised child is killed when its supervisor dies, even by kill -9 (Linux's parent-death
    signal), so a killed demo leaves no workers behind holding ports and state directories. Its own
    helper processes (hivemind's) follow it: they exit when their owner is gone."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # it died before the signal was set up
        os._exit(1)
