"""CPU seconds of a process and its descendants, read from /proc (Linux).

A node is several processes: the role's own, its libp2p daemon, hivemind's forked DHT and averager
processes. What one costs a host is the sum over its tree, split by part to show where it goes.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["TREE_PARTS", "tree_cpu_by_part", "tree_usage"]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _tree(root_pid: int) -> set[int]:
    """`root_pid` and every descendant living now, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid and child not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree


def _cpu_s(pid: int) -> tuple[str, float]:
    """A process's command name and CPU seconds (user and system) so far, from /proc/PID/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def tree_usage(root_pid: int) -> tuple[float, float]:
    """(CPU seconds, proportional set size in MiB) of `root_pid` and every descendant, from /proc."""
    cpu = pss = 0.0
    for pid in _tree(root_pid):
        try:
            cpu += _cpu_s(pid)[1]
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1]) / 1024
        except (OSError, ValueError, IndexError):
            continue
    return cpu, pss


TREE_PARTS = ("main", "p2pd", "children")


def tree_cpu_by_part(root_pid: int) -> dict[str, float]:
    """The CPU seconds of `root_pid`'s tree split three ways: the process itself ("main"), its libp2p
    daemons ("p2pd": every request to or from a peer passes through two), and its other descendants
    ("children": hivemind's forked DHT and averager processes, torch's helpers)."""
    parts = dict.fromkeys(TREE_PARTS, 0.0)
    for pid in _tree(root_pid):
        try:
            name, cpu = _cpu_s(pid)
        except (OSError, ValueError, IndexError):
            continue
        parts["main" if pid == root_pid else "p2pd" if name == "p2pd" else "children"] += cpu
    return parts
