"""A run's configuration: the protocol, its options, and the settings every protocol shares.

The options of each protocol are declared by the protocol itself (see
:mod:`hopnet.registry`); :class:`ProtocolConfig` holds the chosen protocol's options
(``config.options``) beside the run-wide settings (seed, timeouts, slowdowns, the bulk
plane). It is written as one flat JSON object (``{"protocol": "hop", "max_ig": 4,
"seed": 0, ...}``): the launcher passes it to its workers in ``HOPNET_CONFIG``, each
rank's ``start`` record and ``launch.json`` hold it. Code that embeds hopnet builds a
``ProtocolConfig(protocol="hop", max_ig=4)`` directly or passes keywords to
:func:`hopnet.init`.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hopnet import registry
from hopnet.errors import ConfigError
from hopnet.options import (OptionField, ProtocolOptions, add_arguments, flag_text, given_options, iter_unique,
                            option, option_fields)
from hopnet.slowdown import Slowdown, parse_slowdown

DEFAULT_PROTOCOL = "hop"
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_PEER_TIMEOUT_S = 5.0
BULK_PLANES = ("zmq", "torch", "auto")

O = TypeVar("O", bound=ProtocolOptions)


@dataclass(init=False)
class ProtocolConfig:
    """The protocol, its options (``options``, the protocol's own dataclass) and the run-wide
    settings. ``ProtocolConfig(protocol="hop", max_ig=4)`` takes the protocol's options as
    keywords; one the protocol does not take is refused in one line naming the protocol."""

    protocol: str = option(DEFAULT_PROTOCOL, help="training protocol")
    slowdown: list[str] = option(help="random:FACTOR:PROB or rank=R:FACTOR (repeatable)", default_factory=list)
    seed: int = option(0, help="seed for slowdowns and sampling")
    timeout_s: float = option(DEFAULT_TIMEOUT_S, flag="--timeout", metavar="SECONDS",
                              help="fail a wait after this long, naming what it waited for")
    peer_timeout_s: float = option(DEFAULT_PEER_TIMEOUT_S, metavar="SECONDS",
                                   help="declare a neighbour dead when nothing was heard from it for this long")
    bulk: str = option("auto", choices=BULK_PLANES,
                       help="what carries update tensors: zmq, torch (gloo on CPU, NCCL on CUDA) or auto "
                            "(torch for CUDA tensors, the faster one for CPU)")
    options: ProtocolOptions = field(default_factory=ProtocolOptions, compare=True)

    def __init__(self, protocol: str = DEFAULT_PROTOCOL, *, options: ProtocolOptions | None = None,
                 slowdown: Iterable[str] = (), seed: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S,
                 peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S, bulk: str = "auto",
                 **protocol_options: Any) -> None:
        spec = registry.lookup(protocol)
        if options is None:
            registry.refuse_foreign(protocol, list(protocol_options), _flag_of)
            options = spec.options(**protocol_options)
        elif protocol_options:
            raise ConfigError(f"pass either options= or the options of --protocol {protocol} as keywords, not both")
        elif not isinstance(options, spec.options):
            raise ConfigError(f"--protocol {protocol} takes {spec.options.__name__}, not {type(options).__name__}")
        self.protocol = protocol
        self.options = options
        self.slowdown = list(slowdown)
        self.seed = seed
        self.timeout_s = timeout_s
        self.peer_timeout_s = peer_timeout_s
        self.bulk = bulk
        self.validate()

    def __getattr__(self, name: str) -> Any:
        """The protocol's options read through: ``config.max_ig`` is ``config.options.max_ig``.
        (Typed code reads ``config.options_as(HopOptions).max_ig``.)"""
        if name.startswith("_") or name == "options":
            raise AttributeError(name)
        try:
            return getattr(self.options, name)
        except AttributeError:
            raise AttributeError(f"--protocol {self.protocol} has no option {name!r}") from None

    # ------------------------------------------------------------------ the declaration
    @property
    def spec(self) -> registry.ProtocolSpec[ProtocolOptions]:
        return registry.lookup(self.protocol)

    def options_as(self, kind: type[O]) -> O:
        """The protocol's options, typed as ``kind`` (what the protocol's own module declared)."""
        if not isinstance(self.options, kind):
            raise ConfigError(f"--protocol {self.protocol} has {type(self.options).__name__}, not {kind.__name__}")
        return self.options

    def validate(self) -> None:
        for f in run_fields():
            f.check(getattr(self, f.name))
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout must be > 0 (got {self.timeout_s})")
        if (isinstance(self.peer_timeout_s, bool) or not isinstance(self.peer_timeout_s, (int, float))
                or not math.isfinite(self.peer_timeout_s) or self.peer_timeout_s <= 0):
            raise ConfigError(f"--peer-timeout must be a positive number of seconds (got {self.peer_timeout_s!r})")
        for spec in self.slowdown:
            parse_slowdown(spec)
        self.options.validate()

    def validate_ranks(self, world_size: int) -> None:
        """Check the options that name ranks (slowdowns, per-rank backup workers) against the run."""
        self.make_slowdown().validate_ranks(world_size)
        self.options.check_ranks(world_size)

    def make_slowdown(self) -> Slowdown:
        return Slowdown.from_specs(self.slowdown, seed=self.seed)

    # ------------------------------------------------------------------ the flat form
    def to_dict(self) -> dict[str, Any]:
        """One flat mapping: the run-wide settings and the protocol's options."""
        data: dict[str, Any] = {"protocol": self.protocol, **self.options.to_dict()}
        data.update((f.name, getattr(self, f.name)) for f in run_fields() if f.name != "protocol")
        data["slowdown"] = list(self.slowdown)
        return data

    def to_json(self) -> str:
        data = self.to_dict()
        for name, value in data.items():
            if isinstance(value, Mapping):
                data[name] = {str(k): v for k, v in value.items()}
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ProtocolConfig:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProtocolConfig:
        """The configuration of a flat mapping (see :meth:`to_dict`); an option the protocol does
        not take, or no protocol takes, is refused in one line."""
        values = dict(data)
        run = {name: values.pop(name) for name in run_field_names() if name in values}
        return cls(**run, **values)

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> ProtocolConfig:
        """Like :meth:`from_dict`, for a configuration a run recorded: options the protocol does not
        take are left out (runs recorded before options were declared per protocol hold them all)."""
        values = dict(data)
        spec = registry.lookup(str(values.get("protocol", DEFAULT_PROTOCOL)))
        keep = set(run_field_names()) | set(spec.options.names())
        return cls.from_dict({name: value for name, value in values.items() if name in keep})

    def replace(self, **changes: Any) -> ProtocolConfig:
        """A copy with ``changes`` (run-wide settings or protocol options by name). When the protocol
        changes, the options set away from their defaults carry over, and must be the new protocol's."""
        data = self.to_dict()
        if "protocol" in changes and changes["protocol"] != self.protocol:
            defaults = self.spec.default_options().to_dict()
            for name, default in defaults.items():
                if data[name] == default:
                    del data[name]
        data.update(changes)
        return ProtocolConfig.from_dict(data)

    def explicit_names(self) -> list[str]:
        """The option names set away from their defaults (the protocol's name excluded)."""
        default = ProtocolConfig(self.protocol).to_dict()
        return [name for name, value in self.to_dict().items() if name != "protocol" and value != default[name]]


def run_fields() -> tuple[OptionField, ...]:
    """The run-wide settings (the protocol's name among them), as declared on :class:`ProtocolConfig`."""
    return option_fields(ProtocolConfig)


def run_field_names() -> tuple[str, ...]:
    return tuple(f.name for f in run_fields())


def option_field(name: str, protocol: str | None = None) -> OptionField:
    """The declaration of option ``name``: a run-wide setting, or an option of ``protocol`` (of any
    protocol that takes it, when ``protocol`` is ``None``)."""
    for f in run_fields():
        if f.name == name:
            return f
    spec_fields = registry.lookup(protocol).option_fields() if protocol else registry.protocol_option_fields()
    for f in spec_fields:
        if f.name == name:
            return f
    raise ConfigError(f"unknown protocol option {name!r}")


def _flag_of(name: str) -> str:
    try:
        return option_field(name).flag
    except ConfigError:
        return name


def flag_of(name: str) -> str:
    """The command-line flag of option ``name`` (``max_ig`` -> ``--max-ig``)."""
    return option_field(name).flag


def option_text(config: ProtocolConfig, name: str) -> str:
    """Option ``name`` of ``config`` as the user would write it (``--max-ig 3``, ``--serial``)."""
    return flag_text(option_field(name, config.protocol), config.to_dict()[name])


def all_option_names() -> list[str]:
    """Every option name of the run and of every protocol, each once."""
    return [f.name for f in iter_unique([*run_fields(), *registry.protocol_option_fields()])]


# ------------------------------------------------------------------ command line
def _protocol_help() -> str:
    lines = [f"{spec.name}: {spec.summary}" for spec in registry.specs()]
    return f"training protocol (default: {DEFAULT_PROTOCOL}). " + " ".join(lines)


def add_protocol_arguments(parser: argparse.ArgumentParser) -> None:
    """The protocol flags shared by `hopnet launch` and `hopnet simulate`: the run-wide settings,
    then one group per protocol with the options it declares."""
    group = parser.add_argument_group("protocol")
    group.add_argument("--protocol", choices=registry.names(), default=argparse.SUPPRESS, help=_protocol_help())
    add_arguments(group, [f for f in run_fields() if f.name != "protocol"])
    seen: set[str] = set()
    for spec in registry.specs():
        fields = [f for f in spec.option_fields() if f.name not in seen]
        if not fields:
            continue
        seen.update(f.name for f in fields)
        shared = {f.name: [s.name for s in registry.specs() if f.name in s.options.names()] for f in fields}
        title = f"--protocol {spec.name}"
        options_group = parser.add_argument_group(title)
        for f in fields:
            takers = shared[f.name]
            prefix = f"{', '.join(takers)}: " if len(takers) > 1 else ""
            add_arguments(options_group, [f], help_prefix=prefix)


def explicit_options(args: argparse.Namespace) -> list[str]:
    """The options the command line gave (see :func:`add_protocol_arguments`)."""
    return list(given_options(args, all_option_names()))


def config_from_args(args: argparse.Namespace) -> ProtocolConfig:
    """The configuration of the flags given; one of another protocol is refused naming both."""
    given = given_options(args, all_option_names())
    return ProtocolConfig.from_dict(given)


def describe_options(config: ProtocolConfig, *, always: Sequence[str] = ()) -> list[str]:
    """The options of ``config`` away from the protocol's defaults (and those in ``always``), as flags."""
    changed = set(config.explicit_names()) | set(always)
    return [option_text(config, name) for name in config.to_dict() if name != "protocol" and name in changed]


__all__ = ["BULK_PLANES", "DEFAULT_PEER_TIMEOUT_S", "DEFAULT_PROTOCOL", "DEFAULT_TIMEOUT_S", "ProtocolConfig",
           "add_protocol_arguments", "all_option_names", "config_from_args", "describe_options", "explicit_options",
           "flag_of", "option_field", "option_text", "run_field_names", "run_fields"]
