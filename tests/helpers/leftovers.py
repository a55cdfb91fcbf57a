"""What a stopped demo may leave running: nothing but torch's shared-memory managers, briefly."""

from __future__ import annotations

import os
import select
from pathlib import Path


def processes_of(workdir: Path) -> dict[int, str]:
    """pid -> name of every process working in `workdir` (the launched roles, their DHT daemons) or
    naming it on its command line (anything exec'd)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(workdir) or \
                    str(workdir).encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                found[int(pid)] = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            pass
    return found


def assert_nothing_left(workdir: Path) -> None:
    """torch's shared-memory manager, which each role's helpers start in a session of its own, exits
    by itself about a second after its last client: each one still running gets 10 s, waited on
    through a pidfd. Anything else still running is a leak."""
    leftovers = processes_of(workdir)
    assert set(leftovers.values()) <= {"torch_shm_manag"}, leftovers
    for pid in leftovers:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            assert select.select([fd], [], [], 10)[0], f"torch_shm_manager {pid} still running 10 s after the demo"
        finally:
            os.close(fd)
