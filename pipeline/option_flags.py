"""A section's fields as a command's flags (pipeline/schema.py): a role's options, and any
command's settings that are not the run config's.

The fields of a section that declare a flag (`setting(..., flag="--max-queue")`) are that command's
options (`add_option_flags`), each with the schema's type, choices, default and help; they are read
back into the section with `options_from_args`, whose error is one line naming `section.field` and
the value. Here, beside the schema, so that every package that declares a section (dht/'s
bootstrap, auth/, monitor/, node/) can mount its flags; argparse only, nothing heavy.
"""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import TypeAdapter, ValidationError

from agora.pipeline.schema import Setting, explain, leaves, nested

__all__ = ["add_option_flags", "options_from_args", "value_parser", "shown_default"]

_NONE = ("none", "null")


def value_parser(item: Setting):
    """What turns one command-line value into the setting's type (argparse's `type=`)."""
    scalar = item.scalar
    words = {str(word).lower(): word for word in item.words}  # `auto` beside a number; a choice in any case

    def parse(text: str) -> Any:
        if item.optional and text.lower() in _NONE:
            return None
        if text.lower() in words:
            return words[text.lower()]
        if scalar is bool:
            if text.lower() in ("true", "yes", "1", "on"):
                return True
            if text.lower() in ("false", "no", "0", "off"):
                return False
            raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
        try:
            return scalar(text)
        except ValueError:
            kind = {int: "a whole number", float: "a number"}.get(scalar, "a string")
            kind = " or ".join([kind, *map(repr, item.words)])
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
    parse.__name__ = item.path  # argparse names the type in its error line
    return parse


def shown_default(default: Any) -> str:
    """A default as `--help` shows it."""
    return "none" if default is None else (",".join(map(str, default)) if isinstance(default, tuple) else str(default))


def _option_dest(item: Setting) -> str:
    """The flag's own name as its destination (`--max-queue` -> max_queue), which code beside the
    options reads too (`args.sync`); or the one the setting names, where the flag's own would be
    another flag's (`generate --seed`, the sampling seed, beside the run's seed)."""
    return item.extra.get("dest") or item.short_flag.removeprefix("--").removeprefix("no-").replace("-", "_")


def _help(item: Setting) -> str:
    if item.required:
        return f"{item.help} (required)".replace("%", "%%")
    shown = item.extra.get("unset") if item.default is None and "unset" in item.extra else shown_default(item.default)
    return (item.help if "default" in item.help else f"{item.help} (default: {shown})").replace("%", "%%")


def _flagged(cls: type) -> list[Setting]:
    return [item for item in leaves(cls) if item.short_flag]


def add_option_flags(parser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """A flag for each field of `cls` that declares one (`--no-X` for a field that is true unless
    turned off), its default the schema's; one the command must be given for a field without a
    default; a repeatable one taking one or more values for a list."""
    for item in _flagged(cls):
        if item.short_flag in skip:
            continue
        if item.scalar is bool and not item.is_tuple:
            parser.add_argument(item.short_flag, dest=_option_dest(item), default=item.default,
                                action="store_false" if item.short_flag.startswith("--no-") else "store_true",
                                help=item.help.replace("%", "%%"))
            continue
        default = {} if item.required else {"default": None if item.is_tuple else item.default}
        parser.add_argument(item.short_flag, dest=_option_dest(item), type=value_parser(item), required=item.required,
                            choices=item.choices, **default,
                            **({"nargs": "+", "action": "extend"} if item.is_tuple else {}),  # repeatable
                            metavar=None if item.choices and "metavar" not in item.extra else item.metavar,
                            help=_help(item))  # (no metavar: --help lists the choices)


def options_from_args(cls: type, args: argparse.Namespace, section: str, **given: Any) -> Any:
    """`cls` from the flags `add_option_flags` gave the command (those of a parser that has them),
    over `given`; a ConfigError names `section.field` and the value."""
    flagged = {}
    for item in _flagged(cls):
        value = getattr(args, _option_dest(item), None)
        if hasattr(args, _option_dest(item)) and not (item.is_tuple and value is None):  # unset: the schema's
            flagged[item.path] = value
    values = {**given, **nested(flagged)}
    try:
        return TypeAdapter(cls).validate_python(values)
    except ValidationError as error:
        raise explain(error, cls, section) from None
