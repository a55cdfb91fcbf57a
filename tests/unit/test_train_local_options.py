"""`train-local`'s options are a schema section whose wire dtype is the trainer's declaration
(node/trainer/options.py): the flag, its choices and its bound come from there. Pure: the parser
is built, nothing trains."""

from __future__ import annotations

import pytest

from agora.node.cli import build_parser
from agora.node.run_flags import options_from_args
from agora.node.trainer.options import TrainerOptions, TrainLocalOptions
from agora.pipeline.schema import leaves


def options(*argv: str) -> TrainLocalOptions:
    return options_from_args(TrainLocalOptions, build_parser().parse_args(["train-local", *argv]), "train_local")


def test_the_wire_dtype_flag_sets_the_option():
    assert options().wire_dtype == "fp32"
    assert options("--wire-dtype", "int8").wire_dtype == "int8"


def test_its_choices_are_the_trainers():
    (local,), trainer = leaves(TrainLocalOptions), {item.path: item for item in leaves(TrainerOptions)}
    assert local.short_flag == "--wire-dtype" and local.choices == trainer["wire_dtype"].choices


def test_an_unknown_dtype_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        options("--wire-dtype", "fp8")
    assert stopped.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err
