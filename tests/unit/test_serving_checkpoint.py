"""What a serve-only worker loads, and the user's mistakes with the inference commands (one line, exit 2).

- A checkpoint's weights land on the stage by their global names, also re-split into another number
  of stages than the one it was trained with; a checkpoint lacking the stage's tensors is refused
  naming them, one of another model naming that.
- `--config` takes a checkpoint folder (the run config it was trained with).
- Bad flag combinations are refused before anything starts.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from agora.node.cli import main
from agora.node.inference.serving import load_serving_weights
from agora.node.replica.compute import StageCompute
from agora.node.replica.stash import ForwardStash
from agora.pipeline.checkpoint import CheckpointError, StageState, save_checkpoint
from agora.pipeline.codec import WireCodec
from agora.pipeline.config import PRESETS, load_config
from agora.pipeline.model import SubspaceTransformer
from agora.pipeline.stages import stages_of

CONFIG = PRESETS["tiny"].with_stages(2)


def _compute(config, index: int) -> StageCompute:
    return StageCompute(config, index, run_id="r", codec=WireCodec(), stash=ForwardStash(4, 60.0), synchronous=False)


@pytest.fixture()
def checkpoint(tmp_path):
    model = SubspaceTransformer(CONFIG.model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # away from the initialisation every worker starts with
    states = [StageState(stage.index, stage.state_dict()) for stage in stages_of(model)]
    return save_checkpoint(tmp_path / "ckpt", 12, CONFIG, states), model


def test_weights_load_by_global_names_also_into_another_split(checkpoint):
    path, model = checkpoint
    assert load_config(str(path.parent)) == CONFIG  # a checkpoint folder (or its parent with `latest`)
    three = CONFIG.with_stages(3)
    for index in range(3):
        compute = _compute(three, index)
        assert load_serving_weights(compute, path) == 12
        for name, tensor in compute.stage.state_dict().items():
            torch.testing.assert_close(tensor, model.state_dict()[name], rtol=0, atol=0)


def test_a_checkpoint_without_the_stage_or_of_another_model_is_refused(tmp_path, checkpoint):
    path, model = checkpoint
    head_only = save_checkpoint(tmp_path / "head", 3, CONFIG, [StageState(0, stages_of(model)[0].state_dict())])
    missing = r"lacks stage 1's \['final_norm.weight', 'layers.3.*and 26 more \(it holds stages \[0\]"
    with pytest.raises(CheckpointError, match=missing):
        load_serving_weights(_compute(CONFIG, 1), head_only)
    other = replace(CONFIG, model=replace(CONFIG.model, d_ff=256))
    with pytest.raises(CheckpointError, match="another model"):
        load_serving_weights(_compute(other, 0), path)


@pytest.mark.parametrize("argv, needle", [
    (["join", "--serve-only", "--stage", "0", "--insecure"], "--serve-only: needs --checkpoint C"),
    (["join", "--stage", "0", "--insecure", "--checkpoint", "x"], "--checkpoint: only with --serve-only"),
    (["join", "--serve-only", "--checkpoint", "x", "--checkpoint-dir", "y", "--stage", "0", "--insecure"],
     "a serving worker never trains"),
    (["generate", "--checkpoint", "x", "--config", "tiny", "--prompt", "a", "--insecure"], "give one"),
    (["generate", "--config", "/nonexistent", "--prompt", "a", "--insecure"], "config: '/nonexistent'"),
    (["demo", "--serve", "--insecure"], "demo.serve: --serve needs --checkpoint C"),
    (["demo", "--checkpoint", "x", "--insecure"], "demo.checkpoint: --checkpoint only with --serve"),
])
def test_bad_inference_flags_are_one_line_and_exit_2(argv, needle, capsys, tmp_path):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert needle in err, err
