"""Protocol options from two places: the launcher's command line and the trainer's code.

A trainer may set options in code (``hopnet.init(model, max_ig=4)``); that is fine for
options the user did not give on the command line, and an error for those given
explicitly there (:func:`check_explicit`). The options that then run are what every
rank registers at the rendezvous (which refuses ranks that disagree), what the
launcher prints (:func:`hopnet.launch.options.describe`) and records in ``launch.json``.
The checks run in the worker, in :func:`hopnet.init`.
"""

from __future__ import annotations

from collections.abc import Collection

from hopnet.config import ProtocolConfig, option_text
from hopnet.coordinator import coordinator_options, needs_coordinator
from hopnet.errors import ConfigError


def differences(a: ProtocolConfig, b: ProtocolConfig) -> list[str]:
    """Option names whose values differ (an option only one of them takes counts as differing)."""
    left, right = a.to_dict(), b.to_dict()
    names = [*left, *(name for name in right if name not in left)]
    return [name for name in names if left.get(name) != right.get(name)]


def _text(config: ProtocolConfig, name: str) -> str:
    return option_text(config, name) if name in config.to_dict() else f"no {name}"


def check_explicit(flags: ProtocolConfig, effective: ProtocolConfig, explicit: Collection[str],
                   where: str = "hopnet.init()") -> None:
    """Raise :class:`ConfigError` when code changed an option given explicitly on the command line."""
    clashes = [name for name in differences(flags, effective) if name in explicit]
    if not clashes:
        return
    values = effective.to_dict()
    parts = [f"{_text(flags, n)} on the command line, {n}={values.get(n)!r} in {where}" for n in clashes]
    raise ConfigError("; ".join(parts) + " (drop one of them)")


def check_coordinator_options(launched: ProtocolConfig, effective: ProtocolConfig,
                              where: str = "hopnet.init()") -> None:
    """Raise :class:`ConfigError` when code changed an option the run's coordinator is built
    from: `hopnet launch` starts the coordinator from its own flags before any worker runs,
    so such options must be flags (with defaults taken for them, a change in code would
    leave the coordinator and the workers disagreeing)."""
    built_from = {name for config in (launched, effective) if needs_coordinator(config)
                  for name in coordinator_options(config)}
    changed = [name for name in differences(launched, effective) if name in built_from]
    if not changed:
        return
    values = effective.to_dict()
    given = ", ".join(f"{name}={values.get(name)!r}" for name in changed)
    flags = " ".join(_text(effective, name) if name in values else f"--protocol {launched.protocol}"
                     for name in changed)
    raise ConfigError(f"{given} in {where}: the run's coordinator was started by `hopnet launch` from its "
                      f"flags before this worker ran; pass {flags} to `hopnet launch` instead")
