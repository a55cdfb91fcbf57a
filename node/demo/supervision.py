"""What a supervised `agora-node` child and its supervisor agree on: the variable naming the pid
the child dies with.

A supervisor (node/demo/processes.py's ProcessGroup: the demo, tests, the WAN bench) puts its own
pid there for every child it starts, and the child arms Linux's parent-death signal against it
(node/cli.py), so a supervisor killed with kill -9 leaves no role behind holding ports and state
folders. A launched child's parent is the launcher's server (node/demo/launcher.py), which exits
with the supervisor, so there the server's pid replaces the supervisor's.

A module of its own because both sides read it: the console script without importing the demo,
the launcher without importing the console script.
"""

__all__ = ["PARENT_PID_ENV"]

PARENT_PID_ENV = "AGORA_NODE_PARENT_PID"
