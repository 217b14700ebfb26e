"""Protocol options from two places: the launcher's command line and the trainer's code.

A trainer may set options in code (``hopnet.init(model, max_ig=4)``); that is fine for
options the user did not give on the command line, and an error for those given
explicitly there (:func:`check_explicit`). The options that then run are what every
rank registers at the rendezvous (which refuses ranks that disagree), what the
launcher prints (:func:`describe`) and records in ``launch.json``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import Any

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError

FLAGS = {
    "protocol": "--protocol",
    "max_ig": "--max-ig",
    "token_queues": "--no-token-queues",
    "serial": "--serial",
    "backup_workers": "--backup-workers",
    "staleness": "--staleness",
    "skip_threshold": "--skip-threshold",
    "max_jump": "--max-jump",
    "slowdown": "--slowdown",
    "seed": "--seed",
    "timeout_s": "--timeout",
    "peer_timeout_s": "--peer-timeout",
    "group_buffer": "--no-group-buffer",
    "global_division": "--no-global-division",
    "inter_intra": "--no-inter-intra",
}
"""The command-line flag of every :class:`ProtocolConfig` field (others: ``--field-name``)."""


def option_names() -> list[str]:
    """Every :class:`ProtocolConfig` field, in declaration order."""
    return [f.name for f in fields(ProtocolConfig)]


def flag_of(name: str) -> str:
    return FLAGS.get(name, "--" + name.removesuffix("_s").replace("_", "-"))


def _value_text(name: str, value: Any) -> str:
    if name == "backup_workers" and isinstance(value, Mapping):
        return ",".join(f"{r}:{n}" for r, n in sorted((int(r), n) for r, n in value.items()))
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}"
    return str(value)


def flag_text(name: str, value: Any) -> str:
    """``--max-ig 3``, ``--serial``, ``--no-token-queues``, ``--slowdown a --slowdown b``."""
    flag = flag_of(name)
    if name == "token_queues":
        return flag if not value else "token queues on"
    if name == "serial":
        return flag if value else "no --serial"
    if name in ("group_buffer", "global_division", "inter_intra"):
        return flag if not value else f"{flag.removeprefix('--no-').replace('-', ' ')} on"
    if name == "slowdown":
        return " ".join(f"{flag} {spec}" for spec in value) or f"no {flag}"
    if value is None:
        return f"no {flag}"
    return f"{flag} {_value_text(name, value)}"


def _comparable(config: ProtocolConfig) -> dict[str, Any]:
    data = dict(vars(config))
    if isinstance(data["backup_workers"], Mapping):
        data["backup_workers"] = {int(r): n for r, n in data["backup_workers"].items()}
    return data


def differences(a: ProtocolConfig, b: ProtocolConfig) -> list[str]:
    """Field names whose values differ, in declaration order."""
    left, right = _comparable(a), _comparable(b)
    return [name for name in option_names() if left.get(name) != right.get(name)]


def check_explicit(flags: ProtocolConfig, effective: ProtocolConfig, explicit: Collection[str],
                   where: str = "hopnet.init()") -> None:
    """Raise :class:`ConfigError` when code changed an option given explicitly on the command line."""
    clashes = [name for name in differences(flags, effective) if name in explicit]
    if not clashes:
        return
    parts = [f"{flag_text(n, getattr(flags, n))} on the command line, {n}={getattr(effective, n)!r} in {where}"
             for n in clashes]
    raise ConfigError("; ".join(parts) + " (drop one of them)")


def check_coordinator_options(launched: ProtocolConfig, effective: ProtocolConfig,
                              where: str = "hopnet.init()") -> None:
    """Raise :class:`ConfigError` when code changed an option the run's coordinator is built
    from: `hopnet launch` starts the coordinator from its own flags before any worker runs,
    so such options must be flags (with defaults taken for them, a change in code would
    leave the coordinator and the workers disagreeing)."""
    from hopnet.coordinator import CONFIG_FIELDS, needs_coordinator

    if not (needs_coordinator(launched) or needs_coordinator(effective)):
        return
    changed = [name for name in differences(launched, effective) if name in CONFIG_FIELDS]
    if not changed:
        return
    given = ", ".join(f"{name}={getattr(effective, name)!r}" for name in changed)
    flags = " ".join(flag_text(name, getattr(effective, name)) for name in changed)
    raise ConfigError(f"{given} in {where}: the run's coordinator was started by `hopnet launch` from its "
                      f"flags before this worker ran; pass {flags} to `hopnet launch` instead")


def describe(config: ProtocolConfig) -> str:
    """The options that differ from the defaults, as flags: ``hop --max-ig 4 --backup-workers 1``."""
    default = ProtocolConfig()
    parts = [config.protocol]
    for name in differences(default, config):
        if name != "protocol":
            parts.append(flag_text(name, getattr(config, name)))
    return " ".join(parts)


def config_from_mapping(data: Mapping[str, Any]) -> ProtocolConfig:
    return ProtocolConfig.from_dict(dict(data))
