"""Typed settings, declared once: what the run config (pipeline/config.py) and the roles' options
(node/worker/options.py, the trainer's, the demo's) are made of.

A section is a frozen pydantic dataclass whose fields are declared with `setting(...)`: type,
default, bounds (`gt`, `ge`, `lt`, `le`), help text, an optional short command-line name, and
whether it is machine-local. Rules across fields are the section's `model_validator`s, raising
`ValueError("field: what is wrong")`. From those declarations the command line's flags are
generated (the run flags: node/run_flags.py; a section's own: pipeline/option_flags.py) and
pydantic's report becomes one line naming the field, the rule and the value (`explain`), also for
a value no alternative of a union takes (`metrics.port: expected an integer or 'auto'`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass as _plain_dataclass
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, StrictFloat, StrictInt, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

__all__ = ["ConfigError", "SECTION", "NoneOr", "Positive", "Fraction", "setting", "like", "Setting", "leaves",
           "get", "nested", "explain", "checked"]


class ConfigError(ValueError):
    """A user's config or flag is wrong; the message names the field."""


# Every section refuses unknown fields (a typo is an error, not a silent default) and takes
# values of their own type only: TOML's 1 for a float is fine, "3" or true for an integer is not.
SECTION = ConfigDict(extra="forbid")


def _none(value: Any) -> Any:
    """TOML has no null: an optional setting also takes the string "none"."""
    return None if isinstance(value, str) and value.lower() == "none" else value


NoneOr = BeforeValidator(_none)
Positive = Annotated[StrictInt, Field(gt=0)]
Fraction = Annotated[StrictFloat, Field(ge=0, lt=1)]


def setting(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None, local: bool = False,
            metavar: str | None = None, dest: str | None = None, default_factory: Any = None, **bounds: Any) -> Any:
    """One setting's declaration (no default: required). `flag`: a short command-line name beside
    `--section.field`; `local`: this machine's choice (where it computes, caches, how long it warms
    up), left out of the run fingerprint so that processes differing in it still serve one run;
    `metavar`: what `--help` calls the flag's value (default: the field's name); `dest`: where
    argparse keeps the flag's value, when the flag's own name is taken (pipeline/option_flags.py)."""
    extra = {key: value for key, value in (("flag", flag), ("local", local), ("metavar", metavar), ("dest", dest))
             if value}
    if default_factory is not None:
        bounds["default_factory"] = default_factory
    elif default is not dataclasses.MISSING:  # (none: the field is required)
        bounds["default"] = default
    return Field(description=help, json_schema_extra=extra or None, **bounds)


@_plain_dataclass(frozen=True)
class Setting:
    """One leaf of a section, for the command line and `config show`."""

    path: str  # "sync.every_steps"
    annotation: Any
    info: FieldInfo
    default: Any

    @property
    def help(self) -> str:
        return self.info.description or ""

    @property
    def extra(self) -> dict:
        return self.info.json_schema_extra if isinstance(self.info.json_schema_extra, dict) else {}

    @property
    def flag(self) -> str:
        return "--" + self.path.replace("_", "-")

    @property
    def short_flag(self) -> str | None:
        return self.extra.get("flag")

    @property
    def local(self) -> bool:
        return bool(self.extra.get("local"))

    @property
    def metavar(self) -> str:
        return self.extra.get("metavar") or self.path.rpartition(".")[2].upper()

    @property
    def required(self) -> bool:
        """No default: the command line (or the code that builds the section) must give it."""
        return self.default is PydanticUndefined

    @property
    def words(self) -> tuple:
        """The values a Literal alternative allows (`Literal["text", "json"]`, or `"auto"` beside a port)."""
        literals = [a for a in _unwrap(self.annotation) if typing.get_origin(a) is Literal]
        return typing.get_args(literals[0]) if literals else ()

    @property
    def choices(self) -> tuple | None:
        """The only values allowed, when the setting is a Literal and nothing else (a word beside a
        number is not a choice: `--metrics-port 9100` and `--metrics-port auto`)."""
        return None if self._others() else self.words or None

    def _others(self) -> list:
        return [a for a in _unwrap(self.annotation) if typing.get_origin(a) is not Literal and a is not type(None)]

    @property
    def scalar(self) -> type:
        """The Python type one command-line value parses to (a tuple's items for a tuple); a
        Literal's words are strings unless a number stands beside them."""
        for candidate in self._others():
            if typing.get_origin(candidate) is tuple:
                return _scalar_of(typing.get_args(candidate)[0])
            return _scalar_of(candidate)
        if self.words:
            return str
        raise TypeError(f"{self.path}: no scalar type in {self.annotation!r}")

    @property
    def is_tuple(self) -> bool:
        return any(typing.get_origin(a) is tuple for a in _unwrap(self.annotation))

    @property
    def optional(self) -> bool:
        return type(None) in _unwrap(self.annotation)


def _unwrap(annotation: Any) -> tuple:
    """The alternatives of a union (one for anything else), Annotated stripped."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(_unwrap(a)[0] for a in typing.get_args(annotation))
    return (annotation,)


def _scalar_of(annotation: Any) -> type:
    annotation = _unwrap(annotation)[0]
    for base in (bool, int, float, str):  # StrictInt is Annotated[int, Strict()]: unwrapped above
        if annotation is base:
            return base
    raise TypeError(f"not a scalar setting: {annotation!r}")


def _fields(cls: type) -> dict[str, tuple[Any, FieldInfo]]:
    """A section's fields by name: their annotation (resolved) and FieldInfo."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {name: (hints[name], info) for name, info in cls.__pydantic_fields__.items()}


@functools.cache
def leaves(cls: type, prefix: str = "") -> tuple[Setting, ...]:
    """Every leaf of a section, nested sections flattened into dotted paths, in declaration order
    (read once per section: type hints are resolved here)."""
    out: list[Setting] = []
    for name, (annotation, info) in _fields(cls).items():
        path = f"{prefix}{name}"
        if dataclasses.is_dataclass(annotation):
            out += leaves(annotation, f"{path}.")
        else:
            out.append(Setting(path, annotation, info, info.get_default(call_default_factory=True)))
    return tuple(out)


def get(value: Any, path: str) -> Any:
    for part in path.split("."):
        value = getattr(value, part)
    return value


def nested(values: dict[str, Any]) -> dict:
    """Dotted paths to nested tables ({"sync.every_steps": 8} -> {"sync": {"every_steps": 8}}),
    tuples as lists (what a validator or a file reads)."""
    out: dict = {}
    for path, value in values.items():
        *heads, leaf = path.split(".")
        target = out
        for head in heads:
            target = target.setdefault(head, {})
        target[leaf] = list(value) if isinstance(value, tuple) else value
    return out


def _section_at(root: type, path: tuple) -> type | None:
    cls = root
    for part in path:
        annotation = _fields(cls).get(part, (None,))[0] if dataclasses.is_dataclass(cls) else None
        if not dataclasses.is_dataclass(annotation):
            return None
        cls = annotation
    return cls


def _where(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


_BOUNDS = {"greater_than": "> {gt}", "greater_than_equal": ">= {ge}", "less_than": "< {lt}",
           "less_than_equal": "<= {le}"}
_EXPECTED = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
             "bool_type": "true or false", "string_type": "a string", "tuple_type": "a list"}


def _field_loc(root: type, loc: tuple) -> tuple:
    """`loc` without the tags pydantic adds below a leaf for a union's alternatives
    (`port.constrained-int`, `port.literal['auto']`): the field's own location."""
    out, annotation = [], root
    for part in loc:
        if isinstance(part, int):  # an item of a list: of sections (`links[0].up_mbit`), or of values
            out.append(part)
            lists = [a for a in _unwrap(annotation) if typing.get_origin(a) is tuple]
            annotation = typing.get_args(lists[0])[0] if lists else None
            continue
        sections = [a for a in _unwrap(annotation) if dataclasses.is_dataclass(a)]
        if sections:  # a field (or an unknown one)
            out.append(part)
            annotation = _fields(sections[0]).get(part, (None,))[0]
    return tuple(out)


def _union_error(errors: list[dict], root: type) -> dict:
    """One error for a value no alternative of a union took: the rule it broke where it had the
    right type (`must be <= 65535`), else every type it could have had (`expected an integer or
    'auto'`)."""
    loc = _field_loc(root, tuple(errors[0]["loc"]))
    alternatives = [e for e in errors if _field_loc(root, tuple(e["loc"])) == loc]
    broke = [e for e in alternatives if e["type"] in _BOUNDS or e["type"] in ("value_error", "assertion_error")]
    if broke:
        return {**broke[0], "loc": loc}
    kinds = [_EXPECTED.get(e["type"]) or str((e.get("ctx") or {}).get("expected", e["msg"])) for e in alternatives]
    return {**errors[0], "loc": loc, "type": "union_type", "expected": " or ".join(dict.fromkeys(kinds))}


def explain(error: ValidationError, root: type, section: str = "") -> ConfigError:
    """pydantic's report on validating `root` as one line naming the first bad field, what it
    takes and what it got; `section`: the name the validated object goes by ("runtime", "worker")."""
    errors = error.errors(include_url=False)
    first = errors[0]
    if _field_loc(root, tuple(first["loc"])) != tuple(first["loc"]):
        first = _union_error(errors, root)
    loc, kind, value = tuple(first["loc"]), first["type"], first.get("input")
    ctx = first.get("ctx") or {}
    where = _where(((section,) if section else ()) + loc)
    if kind == "unexpected_keyword_argument":
        known = _section_at(root, loc[:-1])
        return ConfigError(f"{where}: unknown field (known: {', '.join(sorted(_fields(known)) if known else ())})")
    if kind in ("value_error", "assertion_error"):
        message = str(ctx.get("error", first["msg"]))
        if _section_at(root, loc) is not None:  # a rule across fields: its message starts with the field it names
            return ConfigError(f"{where}.{message}" if where else message)
        return ConfigError(f"{where}: {message}, got {value!r}")
    if kind.startswith("dataclass") or kind in ("dict_type", "model_type"):
        return ConfigError(f"{where}: expected a table, got {value!r}")
    if kind in _BOUNDS:
        limits = {key: f"{limit:g}" if isinstance(limit, float) else limit for key, limit in ctx.items()}
        return ConfigError(f"{where}: must be {_BOUNDS[kind].format(**limits)}, got {value!r}")
    expected = first.get("expected") if kind == "union_type" else _EXPECTED.get(kind)
    if kind == "literal_error":
        expected = "one of " + str(ctx.get("expected", "")).replace("'", "")
    if expected is not None:
        return ConfigError(f"{where}: expected {expected}, got {value!r}")
    message = first["msg"]
    return ConfigError(f"{where}: {message[0].lower()}{message[1:]}, got {value!r}")


def like(section: type, name: str, **changes: Any) -> Any:
    """Another section's declaration of a setting, for a role that hands it on (the demo gives its
    trainers and workers their options): the same help, bounds and flag, with `changes` (such as
    `default=None`: the other role's own default)."""
    info = section.__pydantic_fields__[name]
    if "default" in changes and changes["default"] is None and info.default is not None:
        extra = dict(info.json_schema_extra) if isinstance(info.json_schema_extra, dict) else {}
        changes["json_schema_extra"] = {**extra, "unset": f"theirs, {info.default}"}
    return FieldInfo.merge_field_infos(info, **changes)


def checked(cls: type, section: str, **values: Any) -> Any:
    """`cls(**values)`, or a ConfigError naming `section.field` when they are not valid (for values
    that come from outside: a flag, another library's config)."""
    try:
        return cls(**values)
    except ValidationError as error:
        raise explain(error, cls, section) from None
