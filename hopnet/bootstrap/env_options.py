"""Protocol options from ``HOPNET_<OPTION>`` variables, for workers of other launchers.

Under torchrun or srun there is no ``hopnet launch`` command line: each run-wide setting
and each option of the chosen protocol can be given as an upper-case variable instead
(``HOPNET_PROTOCOL=hop``, ``HOPNET_MAX_IG=4``, ``HOPNET_BACKUP_WORKERS=1``,
``HOPNET_TOKEN_QUEUES=0``, ``HOPNET_SLOWDOWN="rank=2:3,rank=3:2"`` (comma separated), ``none``
for an optional field). ``HOPNET_CONFIG`` (a JSON object) is read first, the single
variables override it. Options set this way count as given explicitly, like flags on
the command line: code may not set them to something else (see
:func:`hopnet.bootstrap.options.check_explicit`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from hopnet import registry
from hopnet.config import ProtocolConfig, option_field, run_fields
from hopnet.errors import ConfigError
from hopnet.bootstrap.env import CONFIG
from hopnet.options import iter_unique, parse_text


def variable_name(option: str) -> str:
    return "HOPNET_" + option.upper()


def config_from_variables(environ: Mapping[str, str]) -> tuple[ProtocolConfig, tuple[str, ...]]:
    """The configuration the variables describe, and the options they set explicitly. A variable
    for an option the chosen protocol does not take is refused, naming the protocol."""
    data: dict[str, Any] = {}
    explicit: list[str] = []
    base = environ.get(CONFIG, "").strip()
    if base:
        try:
            loaded = json.loads(base)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{CONFIG} is not valid JSON: {exc.msg} at column {exc.colno}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{CONFIG} must be a JSON object of protocol options")
        data.update(loaded)
        explicit.extend(loaded)
    for f in iter_unique([*run_fields(), *registry.protocol_option_fields()]):
        name = variable_name(f.name)
        text = environ.get(name)
        if text is None:
            continue
        declared = f
        if f.name != "protocol" and "protocol" in data:
            try:  # parse as the chosen protocol declares it, where it takes the option
                declared = option_field(f.name, str(data["protocol"]))
            except ConfigError:
                pass
        data[f.name] = parse_text(declared, text, source=f"{name}={text!r}")
        explicit.append(f.name)
    try:
        config = ProtocolConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"protocol options from HOPNET_* variables: {exc}") from None
    return config, tuple(dict.fromkeys(explicit))


__all__ = ["config_from_variables", "variable_name"]
