"""The flags a section generates (pipeline/option_flags.py): a setting without a default is a flag
the command must be given, a number or a word (`--metrics-port 9100`, `--metrics-port auto`), a
list taking one or more values and repeatable, a Literal's choices, a destination of its own; and a
bad value is one line naming the field, whichever alternative of a union it missed."""

from __future__ import annotations

import argparse
from typing import Annotated, Literal

import pytest
from pydantic import Field, StrictInt, StrictStr
from pydantic.dataclasses import dataclass

from agora.pipeline.option_flags import add_option_flags, options_from_args
from agora.pipeline.schema import SECTION, ConfigError, checked, leaves, setting

pytestmark = pytest.mark.timeout(30)


@dataclass(frozen=True, config=SECTION)
class Toy:
    out: StrictStr = setting(help="where it writes", flag="--out", metavar="DIR", min_length=1)
    port: Annotated[StrictInt, Field(ge=0, le=65535)] | Literal["auto"] = setting(0, "a port, or auto",
                                                                                  flag="--port")
    peers: tuple[StrictStr, ...] = setting((), "peers", flag="--peer", metavar="MADDR")
    fmt: Literal["text", "json"] = setting("text", "how it prints", flag="--format")
    seed: StrictInt = setting(0, "a seed of its own", flag="--seed", dest="toy_seed", ge=0)


class Refused(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own refusals, as an exception to look at
        raise Refused(message)


def parse(*argv: str) -> Toy:
    parser = Parser()
    parser.add_argument("--run-seed", dest="seed", type=int, default=None)  # the toy's --seed goes elsewhere
    add_option_flags(parser, Toy)
    return options_from_args(Toy, parser.parse_args(list(argv)), "toy")


def test_a_setting_without_a_default_is_a_flag_the_command_must_be_given():
    assert leaves(Toy)[0].required and not leaves(Toy)[1].required
    with pytest.raises(Refused, match="the following arguments are required: --out"):
        parse()
    assert parse("--out", "d") == Toy(out="d")


def test_a_number_or_a_word():
    assert parse("--out", "d", "--port", "9100").port == 9100
    assert parse("--out", "d", "--port", "AUTO").port == "auto"
    with pytest.raises(Refused, match=r"--port: expected a whole number or 'auto', got 'fast'"):
        parse("--out", "d", "--port", "fast")
    with pytest.raises(ConfigError, match=r"^toy.port: must be <= 65535, got 70000$"):
        parse("--out", "d", "--port", "70000")


def test_the_union_error_names_the_field_not_the_alternative():
    with pytest.raises(ConfigError, match=r"^toy.port: expected an integer or 'auto', got 'fast'$"):
        checked(Toy, "toy", out="d", port="fast")
    with pytest.raises(ConfigError, match=r"^toy.port: must be >= 0, got -1$"):
        options_from_args(Toy, argparse.Namespace(out="d", port=-1), "toy")


def test_a_list_takes_one_or_more_values_and_repeats():
    assert parse("--out", "d", "--peer", "a", "b", "--peer", "c").peers == ("a", "b", "c")


def test_choices_and_a_destination_of_its_own():
    with pytest.raises(Refused, match="invalid choice: 'yaml'"):
        parse("--out", "d", "--format", "yaml")
    parser = Parser()
    parser.add_argument("--run-seed", dest="seed", type=int, default=None)
    add_option_flags(parser, Toy)
    args = parser.parse_args(["--out", "d", "--seed", "7", "--run-seed", "3"])
    assert (args.toy_seed, args.seed) == (7, 3)
    with pytest.raises(ConfigError, match=r"^toy.seed: must be >= 0, got -1$"):
        parse("--out", "d", "--seed", "-1")
