"""The protocol options as the launcher knows and shows them.

The reconciliation of the launcher's options with the trainer's (what :func:`hopnet.init`
checks) is :mod:`hopnet.bootstrap.options`.
"""

from __future__ import annotations

from hopnet.config import ProtocolConfig, all_option_names, describe_options


def option_names() -> list[str]:
    """Every option name: the run-wide settings and every protocol's options."""
    return all_option_names()


def describe(config: ProtocolConfig) -> str:
    """The options that differ from the defaults, as flags: ``hop --max-ig 4 --backup-workers 1``."""
    return " ".join([config.protocol, *describe_options(config)])
