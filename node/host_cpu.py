"""CPU seconds of a process and its descendants, read from /proc (Linux).

A node is several processes: the role's own, its libp2p daemon, hivemind's forked DHT and averager
processes. What one costs a host is the sum over its tree, split by part to show where it goes. A
descendant that ended and was reaped counts in its parent's reaped time (cutime, cstime), so a tree's
sum holds every process that ran in it, the short-lived ones too. `CpuWindow` reads named trees and
the whole host's busy time over a window: what the demo's children cost beside what the host did.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["TREE_PARTS", "CpuWindow", "host_busy_s", "process_parents", "tree_cpu_by_part", "tree_usage"]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_parents() -> dict[int, int]:
    """Every living process's parent, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return parents


def _tree(root_pid: int, parents: dict[int, int] | None = None) -> set[int]:
    """`root_pid` and every descendant living now."""
    parents = process_parents() if parents is None else parents
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid and child not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree


def _cpu_s(pid: int) -> tuple[str, float, float]:
    """A process's command name, its CPU seconds (user and system) so far, and its reaped children's,
    from /proc/PID/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / CLOCK_TICKS,
            (int(fields[13]) + int(fields[14])) / CLOCK_TICKS)


def tree_usage(root_pid: int, parents: dict[int, int] | None = None, memory: bool = True) -> tuple[float, float]:
    """(CPU seconds, proportional set size in MiB, 0 unless `memory`) of `root_pid` and every descendant.
    `parents`: a reading of `process_parents()` to share between trees read together."""
    cpu = pss = 0.0
    for pid in _tree(root_pid, parents):
        try:
            _, own, reaped = _cpu_s(pid)
            cpu += own + reaped
            if memory:
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) / 1024
        except (OSError, ValueError, IndexError):
            continue
    return cpu, pss


TREE_PARTS = ("main", "p2pd", "children")


def tree_cpu_by_part(root_pid: int, parents: dict[int, int] | None = None) -> dict[str, float]:
    """The CPU seconds of `root_pid`'s tree split three ways: the process itself ("main"), its libp2p
    daemons ("p2pd": every request to or from a peer passes through two), and its other descendants
    ("children": hivemind's forked DHT and averager processes, torch's helpers, and every reaped one).
    `parents`: a reading of `process_parents()` to share between trees read together."""
    parts = dict.fromkeys(TREE_PARTS, 0.0)
    for pid in _tree(root_pid, parents):
        try:
            name, own, reaped = _cpu_s(pid)
        except (OSError, ValueError, IndexError):
            continue
        parts["main" if pid == root_pid else "p2pd" if name == "p2pd" else "children"] += own
        parts["children"] += reaped
    return parts


def host_busy_s() -> float:
    """The host's busy CPU seconds since boot over every core (user, nice, system, irq, softirq and
    steal: all but idle and iowait), from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


class CpuWindow:
    """Named process trees' CPU and the host's busy time from its creation to `end`.

    A tree whose root is gone at the end (killed, or exited) is left out: what it burned since the
    start can no longer be read."""

    def __init__(self, pids: dict[str, int]):
        self._pids = dict(pids)
        self._started = time.monotonic()
        self._host = host_busy_s()
        parents = process_parents()
        self._first = {name: tree_cpu_by_part(pid, parents) for name, pid in self._pids.items() if pid in parents}

    def end(self) -> dict:
        """{"window_s", "host_busy_s", "cores", "by_process": {name: {part: CPU s}}} over the window."""
        parents, host = process_parents(), host_busy_s()
        by_process = {}
        for name, first in self._first.items():
            if self._pids[name] in parents:
                last = tree_cpu_by_part(self._pids[name], parents)
                by_process[name] = {part: round(max(0.0, last[part] - first[part]), 3) for part in TREE_PARTS}
        return {"window_s": round(time.monotonic() - self._started, 3), "host_busy_s": round(host - self._host, 3),
                "cores": os.cpu_count(), "by_process": by_process}
