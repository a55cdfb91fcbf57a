"""`train-local`'s options are a schema section whose wire dtype is the trainer's declaration
(node/trainer/options.py): the flag, its choices and its bound come from there; its files and
--resume are fields of it too. Pure: the parser is built, nothing trains."""

from __future__ import annotations

import pytest

from agora.node.cli import build_parser, main
from agora.node.trainer.options import TrainerOptions, TrainLocalOptions
from agora.pipeline.option_flags import options_from_args
from agora.pipeline.schema import leaves


def options(*argv: str) -> TrainLocalOptions:
    return options_from_args(TrainLocalOptions, build_parser().parse_args(["train-local", *argv]), "train_local")


def test_the_wire_dtype_flag_sets_the_option():
    assert options().wire_dtype == "fp32"
    assert options("--wire-dtype", "int8").wire_dtype == "int8"


def test_its_choices_are_the_trainers():
    local = {item.path: item for item in leaves(TrainLocalOptions)}["wire_dtype"]
    trainer = {item.path: item for item in leaves(TrainerOptions)}
    assert local.short_flag == "--wire-dtype" and local.choices == trainer["wire_dtype"].choices


def test_an_unknown_dtype_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        options("--wire-dtype", "fp8")
    assert stopped.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err


def test_its_files_and_resume_keep_their_flags():
    assert (options().log_json, options().checkpoint_dir, options().resume) == (None, None, False)
    given = options("--log-json", "l.jsonl", "--checkpoint-dir", "ck", "--resume")
    assert (given.log_json, given.checkpoint_dir, given.resume) == ("l.jsonl", "ck", True)


def test_resume_without_a_checkpoint_folder_is_refused_before_anything_trains(capsys, tmp_path):
    log = tmp_path / "steps.jsonl"
    assert main(["train-local", "--resume", "--log-json", str(log)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "agora-node train-local: error: train_local.resume: --resume needs --checkpoint-dir"
    assert not log.exists()  # refused before its log was opened (and before the data and the model were built)
