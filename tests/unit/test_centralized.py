"""The centralized reference trainer (`agora-node train-local`)."""

import json
from dataclasses import replace

import pytest
import torch

from agora.node.cli import main
from agora.pipeline.centralized import CentralizedTrainer
from agora.pipeline.config import PRESETS
from agora.pipeline.data import build_data


def _config(stages=3, **train):
    config = PRESETS["tiny"].with_stages(stages)
    config = replace(config, train=replace(config.train, batch_size=4, microbatches=2, seq_len=64,
                                           eval_every=0, **train))
    return config


@pytest.fixture(scope="module")
def data():
    return build_data(_config())


def test_train_local_lowers_the_loss_on_the_stdlib_corpus(tmp_path):
    log = tmp_path / "log.jsonl"
    code = main(["train-local", "--config", "tiny", "--stages", "3", "--steps", "40", "--seed", "1",
                 "--log-json", str(log)])
    assert code == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 41))
    assert {"step", "loss", "tokens", "lr"} <= lines[0].keys()
    assert lines[-1]["tokens"] == 40 * 8 * 128
    first = sum(line["loss"] for line in lines[:5]) / 5
    last = sum(line["loss"] for line in lines[-5:]) / 5
    assert first > 5.0          # ~ln(256) at initialisation
    assert last < first - 1.5   # a byte-level model learns the easy structure of Python quickly


def test_stage_count_does_not_change_the_math(data):
    # With clipping out of the way, 1 stage and 3 stages are the same computation through the codec.
    traces = []
    for stages in (1, 3):
        config = _config(stages)
        config = replace(config, optim=replace(config.optim, clip_norm=1e9))
        trainer = CentralizedTrainer(config, data)
        traces.append([r.loss for r in trainer.run(3)])
    assert traces[0] == pytest.approx(traces[1], abs=1e-4)


def test_resume_continues_bit_identically(tmp_path, data):
    config = _config()
    straight = CentralizedTrainer(config, data)
    expected = [r.loss for r in straight.run(4)]

    first = CentralizedTrainer(config, data, checkpoint_dir=tmp_path)
    first.run(2)
    second = CentralizedTrainer(config, data, checkpoint_dir=tmp_path)
    assert second.resume() and second.step == 2
    resumed = [r.loss for r in second.run(4)]
    assert resumed == expected[2:]
    for a, b in zip(straight.stages, second.stages):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(x, y), name


def test_int8_wire_trains_with_finite_values(data):
    trainer = CentralizedTrainer(_config(), data, wire_dtype="int8")
    records = trainer.run(3)
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in records)


def test_bad_config_is_one_line_and_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nrank = -1\n")
    assert main(["train-local", "--config", str(bad), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.rank" in err[0]


def test_export_hf_from_a_train_local_checkpoint(tmp_path):
    import transformers

    assert main(["train-local", "--config", "tiny", "--stages", "2", "--steps", "2",
                 "--checkpoint-dir", str(tmp_path / "ckpt")]) == 0
    assert main(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    from agora.pipeline.checkpoint import load_checkpoint
    from agora.pipeline.stages import assemble_model

    _, config, states, _ = load_checkpoint(tmp_path / "ckpt")
    ours = assemble_model(config.model, [s.model for s in states]).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)
