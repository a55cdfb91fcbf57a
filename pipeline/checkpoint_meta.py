"""A checkpoint's meta.json (step, config, stages, extra), read without torch.

Apart from pipeline/checkpoint.py, which writes and loads the tensors: that module imports
pipeline/config.py for the config's plain form, and `load_config` (pipeline/config.py) reads the
config a checkpoint folder was trained with, so the reading side lives here, importing neither.
pipeline/checkpoint.py re-exports all of it; the layout is described in its docstring.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["CheckpointError", "latest_checkpoint", "read_meta"]


class CheckpointError(RuntimeError):
    pass


def latest_checkpoint(directory: str | Path) -> Path | None:
    directory = Path(directory)
    pointer = directory / "latest"
    if not pointer.exists():
        return None
    path = directory / pointer.read_text().strip()
    if not (path / "meta.json").exists():
        raise CheckpointError(f"{pointer} names {path.name}, which is missing or incomplete")
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's meta.json (step, config, stages, extra) without loading any tensor."""
    path = _resolve(Path(path))
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable meta.json: {error}") from error


def _resolve(path: Path) -> Path:
    """A checkpoint folder itself, or the one a folder's `latest` names."""
    if (path / "meta.json").exists():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path}: no checkpoint here (no meta.json and no 'latest')")
    return latest
