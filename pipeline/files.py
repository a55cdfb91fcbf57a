"""Atomic file writes, and one process per state folder.

Atomic writes: a reader sees the old file or the whole new one, never a part.

Write a temporary file in the same folder, fsync it, rename it over the target (atomic on POSIX),
fsync the folder (so the rename itself survives a power cut), and remove the temporary on any
failure. Checkpoints, ready files, credentials and keys all go
through here. The file's mode is set before anything is written, so a key is never readable by
others, not even for a moment; the default is mkstemp's 0600.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from filelock import FileLock, Timeout

from agora.pipeline.config import ConfigError

__all__ = ["atomic_write", "fsync_directory", "FolderInUse", "hold_folder"]


def atomic_write(path: str | Path, data: bytes, *, mode: int = 0o600) -> None:
    path = Path(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(path: str | Path) -> None:
    """Make the entries of a folder (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FolderInUse(ConfigError):
    """Another process holds the folder (its message names it and that process): a user's setup
    mistake like a bad flag, so every command reports it in one line and exits 2."""


def hold_folder(path: str | Path, what: str) -> FileLock:
    """Hold `path` (created if absent) for this process until it exits, or raise FolderInUse.

    A second daemon on one state directory would share its key, credential and checkpoints
    (seed 003's overlapping launches on one machine exhausted its GPU memory). The lock is the
    kernel's (flock on `<path>/.lock`), so a process killed with -9 leaves nothing to clean up;
    the holder's pid is written beside it for the message. Keep the returned lock referenced.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder / ".lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            holder = (folder / ".lock.pid").read_text().strip()
        except OSError:
            holder = "unknown"
        raise FolderInUse(f"{what} {folder} is in use by another agora-node process (pid {holder}); "
                          "stop it first, or give this one a folder of its own") from None
    (folder / ".lock.pid").write_text(f"{os.getpid()}\n")
    return lock
