"""Atomic, complete checkpoints of one or more stages, with the previous one kept as a fallback.

Layout: `<dir>/step-00000100/` holding `meta.json` (config, step, stages, extra state) and
`stage-<i>.pt` per stage; `<dir>/latest` names the newest complete one. A worker saves its own
stage; the centralized trainer saves all of them in one folder; export assembles them.

Design choices:
- Durable before visible: every file is written and fsynced in a temporary sibling folder, the
  folder is fsynced, renamed into place, and its parent fsynced; only then is `latest` replaced
  (atomically, fsynced too). A crash or a kill -9 at any point leaves the previous checkpoint
  complete and `latest` naming one that is complete; the one exception is a step written twice,
  whose old folder is renamed aside just before the new one is renamed in (a kill between the
  two renames: `latest` names a missing folder, and loading falls back to the previous one). What
  a killed write left behind is removed by the next write.
- Complete: parameters, optimizer state (moments and the step count that drives the schedule),
  the averaging loop's state, the RNG states (torch's CPU generator and, where there is one, every
  CUDA device's), and `extra` (a worker's phase, a trainer's position). `restore_rng` puts the RNG
  back, so a resumed run draws what the uninterrupted one would have.
- `keep` (default 2) checkpoints stay: the newest and one to fall back to. `load_checkpoint` of a
  folder whose newest checkpoint is unreadable (a torn disk, a file deleted by hand) says so and
  loads the previous complete one; of one checkpoint folder, exactly that one.
- Loaded with `torch.load(weights_only=True)`: only tensors and plain containers, so a checkpoint
  from somewhere else cannot run code on load.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agora.pipeline.checkpoint_meta import CheckpointError, latest_checkpoint, read_meta
from agora.pipeline.config import RunConfig, config_from_dict, config_to_dict
from agora.pipeline.files import atomic_write, fsync_directory

__all__ = ["CheckpointError", "StageState", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "read_meta",
           "checkpoint_steps", "rng_state", "restore_rng"]

logger = logging.getLogger(__name__)

_STEP_PREFIX = "step-"


@dataclass
class StageState:
    index: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    averaging: dict[str, Any] | None = None  # a worker's averaging loop (round, diloco anchor/momentum)
    rng: dict[str, Any] | None = None  # `rng_state()` when it was saved (filled in by save_checkpoint)
    work: list[str] | None = None  # a worker's applied work keys whose gradient `model` holds (work_ledger.py)


def rng_state() -> dict[str, Any]:
    """This process's torch RNG states: CPU, and every CUDA device's where CUDA is up."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any] | None) -> None:
    """Put back what `rng_state` saved (a legacy checkpoint's bare CPU state is accepted too)."""
    if state is None:
        return
    if isinstance(state, torch.Tensor):
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: str | Path, step: int, config: RunConfig, stages: list[StageState],
                    extra: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Write a complete checkpoint for `step` (see the module docstring); keeps the newest `keep`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(directory)
    final = directory / f"{_STEP_PREFIX}{step:08d}"
    staging = Path(tempfile.mkdtemp(dir=directory, prefix=f".{final.name}."))
    rng = rng_state()
    try:
        meta = {"step": step, "config": config_to_dict(config), "stages": [s.index for s in stages],
                "extra": extra or {}}
        _write_synced(staging / "meta.json", json.dumps(meta, indent=1).encode())
        for state in stages:
            buffer = io.BytesIO()
            torch.save({"model": state.model, "optimizer": state.optimizer, "averaging": state.averaging,
                        "rng": state.rng if state.rng is not None else rng, "work": state.work}, buffer)
            _write_synced(staging / f"stage-{state.index}.pt", buffer.getbuffer())
        fsync_directory(staging)
        replaced = None
        if final.exists():  # the same step again (a worker's last checkpoint as it leaves): moved
            # aside, not deleted first, so that only two renames separate it from the new one (the
            # name is free: leftovers were removed above, and this process holds the folder)
            replaced = directory / f".{final.name}.replaced"
            os.replace(final, replaced)
        os.replace(staging, final)
        fsync_directory(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    atomic_write(directory / "latest", (final.name + "\n").encode())
    for old in _step_folders(directory)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _remove_leftovers(directory: Path) -> None:
    """Staging folders a killed writer left (a whole stage's weights and optimizer state each):
    one writer holds a checkpoint folder at a time, so any found before a write are dead."""
    for leftover in directory.glob(f".{_STEP_PREFIX}*"):
        if leftover.is_dir():
            logger.warning("removing %s, what a checkpoint write that did not finish left", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def checkpoint_steps(directory: str | Path) -> list[int]:
    """Steps of the complete-looking checkpoints in `directory`, oldest first."""
    return [int(path.name[len(_STEP_PREFIX):]) for path in _step_folders(Path(directory))
            if (path / "meta.json").exists()]


def load_checkpoint(path: str | Path, *, step: int | None = None
                    ) -> tuple[int, RunConfig, list[StageState], dict[str, Any]]:
    """(step, config, stage states, extra) from a checkpoint folder, or from a folder of them: its
    `step` one, else the newest, falling back to the previous complete one (module docstring)."""
    path = Path(path)
    if (path / "meta.json").exists():
        return _load_one(path)
    if step is not None:
        return _load_one(path / f"{_STEP_PREFIX}{step:08d}")
    try:
        newest = latest_checkpoint(path)
    except CheckpointError as error:
        logger.warning("%s", error)
        newest = None
    candidates = ([newest] if newest is not None else []) + [
        folder for folder in reversed(_step_folders(path)) if folder != newest]
    if not candidates:
        raise CheckpointError(f"{path}: no checkpoint here (no meta.json and no 'latest')")
    failures = []
    for candidate in candidates:
        try:
            loaded = _load_one(candidate)
        except CheckpointError as error:
            failures.append(str(error))
            continue
        if failures:
            logger.warning("checkpoint fallback: %s; loaded %s instead", "; ".join(failures), candidate.name)
        return loaded
    raise CheckpointError("; ".join(failures))


def _load_one(path: Path) -> tuple[int, RunConfig, list[StageState], dict[str, Any]]:
    try:
        meta = json.loads((path / "meta.json").read_text())
        config = config_from_dict(meta["config"])
        stages = []
        for index in meta["stages"]:
            blob = torch.load(path / f"stage-{index}.pt", map_location="cpu", weights_only=True)
            stages.append(StageState(index=index, model=blob["model"], optimizer=blob["optimizer"],
                                     averaging=blob.get("averaging"), rng=blob.get("rng"), work=blob.get("work")))
    except Exception as error:  # noqa: BLE001 - torch.load of a torn or foreign file raises anything
        raise CheckpointError(f"{path}: unreadable checkpoint: {type(error).__name__}: {error}") from error
    return int(meta["step"]), config, stages, meta.get("extra", {})


def _step_folders(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob(f"{_STEP_PREFIX}*") if p.is_dir() and p.name[len(_STEP_PREFIX):].isdigit())


def _write_synced(path: Path, data: bytes | memoryview) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
