"""What a serve-only worker (`agora-node join --serve-only --checkpoint C --stage I`) loads.

Design choices:
- The run config comes from the checkpoint (`--config C` reads a checkpoint folder's meta.json;
  join --serve-only defaults to it), so the workers and the clients of a serving run agree on it
  by naming the same checkpoint, and the run fingerprint every call carries holds them to it.
- Stage states have global parameter names (pipeline/stages.py), so the serving split need not be
  the trained one: the checkpoint's stages are merged and this stage takes its own names from them
  (`--stages` re-splits). A checkpoint missing any of them (a worker's single-stage checkpoint of
  another stage) is refused naming what is missing. Only weights are read: an inference worker
  never steps, so optimizer state and averaging state are left on disk.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from agora.node.replica.compute import StageCompute
from agora.pipeline.checkpoint import CheckpointError, load_checkpoint

__all__ = ["load_serving_weights"]


def load_serving_weights(compute: StageCompute, checkpoint: str | Path) -> int:
    """Load this stage's weights from `checkpoint` (call on the compute thread); the checkpoint's step."""
    step, saved, states, _ = load_checkpoint(checkpoint)
    if replace(saved.model, layer_split=compute.config.model.layer_split) != compute.config.model:
        raise CheckpointError(f"--checkpoint: {checkpoint} holds another model than this run's (model config differs)")
    merged = {}
    for state in states:
        merged.update(state.model)
    wanted = compute.stage.state_dict()
    missing = sorted(name for name in wanted if name not in merged)
    if missing:
        raise CheckpointError(f"--checkpoint: {checkpoint} lacks stage {compute.index}'s {missing[:3]}"
                              + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                              + f" (it holds stages {[s.index for s in states]} of its run)")
    compute.stage.load_state_dict({name: merged[name] for name in wanted}, strict=True)
    return step
