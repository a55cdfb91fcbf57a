"""Atomic, complete checkpoints of one or more stages.

Layout: `<dir>/step-00000100/` holding `meta.json` (config, step, basis checksum, extra state)
and `stage-<i>.pt` per stage (parameters, optimizer, RNG). A checkpoint is written into a
temporary sibling folder and renamed into place, then `<dir>/latest` is replaced atomically, so
a crash mid-write never leaves a checkpoint that looks complete. A worker saves just its own
stage; the centralized trainer saves all of them in one folder; export assembles them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agora.pipeline.config import RunConfig, config_from_dict, config_to_dict
from agora.pipeline.files import atomic_write

__all__ = ["CheckpointError", "StageState", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "read_meta"]

_STEP_PREFIX = "step-"


class CheckpointError(RuntimeError):
    pass


@dataclass
class StageState:
    index: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    averaging: dict[str, Any] | None = None  # a worker's averaging loop (round, diloco anchor/momentum)


def save_checkpoint(directory: str | Path, step: int, config: RunConfig, stages: list[StageState],
                    extra: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Write a complete checkpoint for `step`; keeps the newest `keep` checkpoints."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{_STEP_PREFIX}{step:08d}"
    staging = Path(tempfile.mkdtemp(dir=directory, prefix=f".{final.name}."))
    try:
        meta = {"step": step, "config": config_to_dict(config), "stages": [s.index for s in stages],
                "extra": extra or {}}
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        for state in stages:
            torch.save({"model": state.model, "optimizer": state.optimizer, "averaging": state.averaging,
                        "rng": torch.get_rng_state()}, staging / f"stage-{state.index}.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    atomic_write(directory / "latest", (final.name + "\n").encode())
    checkpoints = sorted(p for p in directory.glob(f"{_STEP_PREFIX}*") if p.is_dir())
    for old in checkpoints[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(directory: str | Path) -> Path | None:
    directory = Path(directory)
    pointer = directory / "latest"
    if not pointer.exists():
        return None
    path = directory / pointer.read_text().strip()
    if not (path / "meta.json").exists():
        raise CheckpointError(f"{pointer} names {path.name}, which is missing or incomplete")
    return path


def _resolve(path: Path) -> Path:
    """A checkpoint folder itself, or the one a folder's `latest` names."""
    if (path / "meta.json").exists():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path}: no checkpoint here (no meta.json and no 'latest')")
    return latest


def read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's meta.json (step, config, stages, extra) without loading any tensor."""
    path = _resolve(Path(path))
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable meta.json: {error}") from error


def load_checkpoint(path: str | Path) -> tuple[int, RunConfig, list[StageState], dict[str, Any]]:
    """(step, config, stage states, extra) from a checkpoint folder or a folder holding `latest`."""
    path = _resolve(Path(path))
    try:
        meta = json.loads((path / "meta.json").read_text())
        config = config_from_dict(meta["config"])
        stages = []
        for index in meta["stages"]:
            blob = torch.load(path / f"stage-{index}.pt", map_location="cpu", weights_only=False)
            stages.append(StageState(index=index, model=blob["model"], optimizer=blob["optimizer"],
                                     averaging=blob.get("averaging")))
    except (OSError, KeyError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{path}: unreadable checkpoint: {error}") from error
    return int(meta["step"]), config, stages, meta.get("extra", {})
