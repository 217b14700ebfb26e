"""The environment a test gives the processes it starts."""

from __future__ import annotations

import os

from hopnet.bootstrap.env import ENV_VARS
from hopnet.bootstrap.forkserver_template import TEMPLATE_VAR

from support.paths import ROOT

FOREIGN_PREFIXES = ("HOPNET_", "SLURM_", "TORCHELASTIC_")
FOREIGN_NAMES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"})
"""A launcher's or a scheduler's variables in the test's own environment must not leak
into the run under test (a worker would think it was started by them)."""


def clean_env(**extra: str) -> dict[str, str]:
    """``os.environ`` without launcher or scheduler variables, with this checkout first on
    ``PYTHONPATH`` so the processes import the hopnet under test, and the session's fork-server
    template; ``extra`` is added."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS and k not in FOREIGN_NAMES and not k.startswith(FOREIGN_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if TEMPLATE_VAR in os.environ:  # the test session's warm fork-server template (support.template)
        env[TEMPLATE_VAR] = os.environ[TEMPLATE_VAR]
    env.update(extra)
    return env
