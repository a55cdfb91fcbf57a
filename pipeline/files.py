"""Atomic file writes: a reader sees the old file or the whole new one, never a part.

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

__all__ = ["atomic_write", "fsync_directory"]


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
