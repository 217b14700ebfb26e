"""Protocol options from ``HOPNET_<OPTION>`` variables, for workers of other launchers.

Under torchrun or srun there is no ``hopnet launch`` command line: each field of
:class:`~hopnet.config.ProtocolConfig` can be given as an upper-case variable instead
(``HOPNET_PROTOCOL=hop``, ``HOPNET_MAX_IG=4``, ``HOPNET_BACKUP_WORKERS=1``,
``HOPNET_TOKEN_QUEUES=0``, ``HOPNET_SLOWDOWN="rank=2:3,rank=3:2"`` (comma separated), ``none``
for an optional field). ``HOPNET_CONFIG`` (a JSON object) is read first, the single
variables override it. Options set this way count as given explicitly, like flags on
the command line: code may not set them to something else (see
:func:`hopnet.launch.options.check_explicit`).
"""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from hopnet.config import ProtocolConfig, parse_backup_workers
from hopnet.errors import ConfigError
from hopnet.launch.env import CONFIG

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def variable_name(option: str) -> str:
    return "HOPNET_" + option.upper()


def _parse(option: str, kind: str, text: str) -> Any:
    name = variable_name(option)
    lowered = text.strip().lower()
    if "None" in kind and lowered in ("none", ""):
        return None
    try:
        if option == "backup_workers":
            return parse_backup_workers(text)
        if option == "slowdown":
            return [spec.strip() for spec in text.split(",") if spec.strip()]
        if kind.startswith("bool"):
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError("expected 1/0, true/false, yes/no or on/off")
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
        return text.strip()
    except (ValueError, ConfigError) as exc:
        raise ConfigError(f"{name}={text!r}: {exc}") from None


def config_from_variables(environ: Mapping[str, str]) -> tuple[ProtocolConfig, tuple[str, ...]]:
    """The configuration the variables describe, and the options they set explicitly."""
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
    hints = typing.get_type_hints(ProtocolConfig)
    for f in fields(ProtocolConfig):
        text = environ.get(variable_name(f.name))
        if text is None:
            continue
        kind = re.sub(r"<class '(\w+)'>", r"\1", str(hints[f.name]))
        data[f.name] = _parse(f.name, kind, text)
        explicit.append(f.name)
    try:
        config = ProtocolConfig.from_dict(data)
        config.validate()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"protocol options from HOPNET_* variables: {exc}") from None
    return config, tuple(dict.fromkeys(explicit))


__all__ = ["config_from_variables", "variable_name"]
