"""Options declared once: a dataclass field carries its flag, help and checks.

A protocol's options are a dataclass of :func:`option` fields (see
:class:`ProtocolOptions`); so are the run-wide settings of
:class:`hopnet.config.ProtocolConfig`. Everything that spells an option out derives
from that one declaration: the ``hopnet launch`` and ``hopnet simulate`` flags
(:func:`add_arguments`), the ``HOPNET_*`` variables (:func:`parse_text`), the flags
shown back to the user (:func:`flag_text`) and the checks (:meth:`ProtocolOptions.validate`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hopnet.errors import ConfigError

T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class OptionInfo:
    """What an option field declares beyond its name, type and default."""

    help: str
    flag: str | None = None
    """The long flag; by default ``--`` and the field name with dashes (``max_ig`` -> ``--max-ig``),
    ``--no-...`` for a switch that is on by default."""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    """Smallest value accepted (numbers only); ``None`` for none."""
    parse: Callable[[str], Any] | None = None
    """Parses the text of a flag or variable, when the field's type alone cannot."""
    repeated: bool = False
    """A list option: the flag may be given several times, a variable separates items by commas."""


def option(default: Any = dataclasses.MISSING, *, help: str, flag: str | None = None, metavar: str | None = None,
           choices: Sequence[str] | None = None, minimum: float | None = None,
           parse: Callable[[str], Any] | None = None, default_factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field that is a user-facing option (see :class:`OptionInfo`)."""
    info = OptionInfo(help=help, flag=flag, metavar=metavar, choices=tuple(choices) if choices else None,
                      minimum=minimum, parse=parse, repeated=default_factory is list)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={"option": info})
    return dataclasses.field(default=default, metadata={"option": info})


def flag_of(name: str, *, turns_off: bool = False) -> str:
    """The command-line flag of a declared field: ``grace_s`` -> ``--grace``, ``max_ig`` ->
    ``--max-ig``; a switch that is on by default is turned off by ``--no-NAME``."""
    base = name.removesuffix("_s").replace("_", "-")
    return f"--no-{base}" if turns_off else f"--{base}"


@dataclass(frozen=True)
class OptionField:
    """One declared option of a dataclass: its name, type (as written), default and :class:`OptionInfo`."""

    name: str
    kind: Any
    default: Any
    info: OptionInfo

    @property
    def flag(self) -> str:
        return self.info.flag or flag_of(self.name, turns_off=self.is_switch and self.default is True)

    @property
    def is_switch(self) -> bool:
        return self.kind is bool

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.kind)

    @property
    def number_kind(self) -> type | None:
        """``int`` or ``float`` for a numeric option (also when optional), else ``None``."""
        for candidate in (int, float):
            if self.kind is candidate or candidate in typing.get_args(self.kind):
                return candidate
        return None

    def check(self, value: Any) -> None:
        """Refuse a value this option cannot take, in one line naming the flag."""
        if (value is None and self.optional) or self.info.parse is not None:
            return  # an option with a parser of its own is checked by it
        if self.info.choices is not None:
            if value not in self.info.choices:
                raise ConfigError(f"{self.flag} must be one of {', '.join(self.info.choices)} (got {value!r})")
            return
        if self.is_switch:
            if not isinstance(value, bool):
                raise ConfigError(f"{self.flag} is a switch: True or False (got {value!r})")
            return
        number = self.number_kind
        if number is None:
            return
        ok = not isinstance(value, bool) and (isinstance(value, int) if number is int
                                              else isinstance(value, (int, float)) and math.isfinite(value))
        low = self.info.minimum
        if ok and low is not None and value < low:
            ok = False
        if not ok:
            noun = "an integer" if number is int else "a number"
            bound = "" if low is None else f" >= {low:g}"
            raise ConfigError(f"{self.flag} must be {noun}{bound} (got {value!r})")


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


_OPTION_FIELDS: dict[type, tuple[OptionField, ...]] = {}


def option_fields(cls: type) -> tuple[OptionField, ...]:
    """The :func:`option` fields of dataclass ``cls``, in declaration order (worked out once per
    class: ``get_type_hints`` is slow, and the simulator makes options for every worker)."""
    found = _OPTION_FIELDS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = tuple(OptionField(f.name, hints[f.name], _field_default(f), f.metadata["option"])
                      for f in dataclasses.fields(cls) if "option" in f.metadata)
        _OPTION_FIELDS[cls] = found
    return found


O = TypeVar("O", bound="ProtocolOptions")


@dataclass(frozen=True)
class ProtocolOptions:
    """Base of every protocol's options: a frozen dataclass of :func:`option` fields.

    Each field is checked against its declaration when the options are made; a protocol
    adds checks across fields by overriding :meth:`check`."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for f in option_fields(type(self)):
            f.check(getattr(self, f.name))
        self.check()

    def check(self) -> None:
        """Checks that involve several fields (raise :class:`ConfigError`)."""

    def check_ranks(self, world_size: int) -> None:
        """Checks of options that name ranks, against the run's number of workers."""

    def settings(self) -> list[str]:
        """Short ``name=value`` notes for summaries: the options away from their defaults."""
        return [f"{f.name}={getattr(self, f.name)}" for f in option_fields(type(self))
                if getattr(self, f.name) != f.default]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in option_fields(type(self))}

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in option_fields(cls))

    def replace(self: O, **changes: Any) -> O:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class NoOptions(ProtocolOptions):
    """The options of a protocol that takes none."""


# ------------------------------------------------------------------ text forms
def parse_text(f: OptionField, text: str, *, source: str) -> Any:
    """The value of option ``f`` written as ``text`` (a variable's value or a JSON-less flag);
    ``source`` names where it came from in the error (``HOPNET_MAX_IG='x'``)."""
    lowered = text.strip().lower()
    try:
        if f.optional and lowered in ("none", ""):
            return None
        if f.info.repeated:
            return [item.strip() for item in text.split(",") if item.strip()]
        if f.info.parse is not None:
            return f.info.parse(text)
        if f.is_switch:
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError("expected 1/0, true/false, yes/no or on/off")
        number = f.number_kind
        if number is not None:
            return number(text)
        return text.strip()
    except (ValueError, ConfigError) as exc:
        raise ConfigError(f"{source}: {exc}") from None


def value_text(value: Any) -> str:
    if isinstance(value, Mapping):
        return ",".join(f"{r}:{n}" for r, n in sorted((int(r), n) for r, n in value.items()))
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}"
    return str(value)


def flag_text(f: OptionField, value: Any) -> str:
    """The option as the user would write it: ``--max-ig 3``, ``--serial``, ``--no-token-queues``,
    ``--slowdown a --slowdown b``; for a value that no flag writes, words (``no --serial``)."""
    if f.is_switch:
        if value == (f.default is not True):
            return f.flag
        return f"{f.flag.removeprefix('--no-').replace('-', ' ')} on" if f.default is True else f"no {f.flag}"
    if f.info.repeated:
        return " ".join(f"{f.flag} {item}" for item in value) or f"no {f.flag}"
    if value is None:
        return f"no {f.flag}"
    return f"{f.flag} {value_text(value)}"


# ------------------------------------------------------------------ argparse
def _argparse_type(f: OptionField) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse_text(f, text, source=f.flag)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{f.flag}: ")) from None
    return convert


def _help(f: OptionField) -> str:
    if f.is_switch or f.info.repeated:
        return f.info.help
    default = "none" if f.default is None else value_text(f.default)
    return f"{f.info.help} (default: {default})"


def add_arguments(group: argparse._ArgumentGroup, fields: Sequence[OptionField], *,
                  help_prefix: str = "") -> None:
    """A flag per option. Defaults are left out of the namespace (``argparse.SUPPRESS``), so
    what is in it is what the command line gave: :func:`given_options` reads it back."""
    for f in fields:
        text = help_prefix + _help(f)
        if f.is_switch:
            action = "store_false" if f.default is True else "store_true"
            group.add_argument(f.flag, dest=f.name, action=action, default=argparse.SUPPRESS, help=text)
        elif f.info.repeated:
            group.add_argument(f.flag, dest=f.name, action="append", default=argparse.SUPPRESS,
                               metavar=f.info.metavar or "SPEC", help=text)
        else:
            # an option with a parser of its own parses when the options are made, so that its refusal
            # is the same one line as from code or a variable
            if f.info.choices is not None or f.info.parse is not None:
                group.add_argument(f.flag, dest=f.name, choices=f.info.choices, default=argparse.SUPPRESS,
                                   metavar=f.info.metavar if not f.info.choices else None, help=text)
            else:
                group.add_argument(f.flag, dest=f.name, type=_argparse_type(f), default=argparse.SUPPRESS,
                                   metavar=f.info.metavar, help=text)


def given_options(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The options among ``names`` that the command line gave (see :func:`add_arguments`)."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def iter_unique(fields: Sequence[OptionField]) -> Iterator[OptionField]:
    """Each option name once (two protocols may both take ``group_size``)."""
    seen: set[str] = set()
    for f in fields:
        if f.name not in seen:
            seen.add(f.name)
            yield f


__all__ = ["NoOptions", "OptionField", "OptionInfo", "ProtocolOptions", "add_arguments", "flag_of", "flag_text",
           "given_options", "iter_unique", "option", "option_fields", "parse_text", "value_text"]
