"""`agora-node doctor` as a child process (`python -m agora.node doctor`), awaited without blocking
the test's event loop, so an authorizer (and members) served in that loop answer it."""

from __future__ import annotations

import asyncio
import os
import sys

from agora.auth.admission import JoinFile

__all__ = ["run_doctor", "write_join_file"]


async def run_doctor(join_file, tmp_path, *flags: str) -> tuple[int, str, str]:
    """The doctor's exit code, stdout and stderr; its state and cache directories under ``tmp_path``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_STATE_HOME": str(tmp_path / "state"),
           "AGORA_CACHE_DIR": str(tmp_path / "cache")}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agora.node", "--threads", "1", "--log-level", "WARNING", "doctor",
        "--join-file", str(join_file), *flags, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env)
    try:
        out, err = await asyncio.wait_for(child.communicate(), 150)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    return child.returncode, out.decode(), err.decode()


def write_join_file(tmp_path, address: str, authority) -> str:
    """A join file for ``authority``'s run served at ``address``; returns its path."""
    path = tmp_path / "join.json"
    JoinFile(address, authority.root_fingerprint, authority.run_id).write(path)
    return str(path)
