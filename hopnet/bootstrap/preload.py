"""The training frameworks a fork server imports once for all its workers (``HOPNET_PRELOAD``).

A worker forked from the fork server (:mod:`hopnet.bootstrap.forkserver`) finds torch and hopnet
imported; a Lightning script would still import Lightning itself, about 3.5 CPU-s per worker
(transformers and Accelerate, about 2 more). The launcher names the frameworks its script imports
(:func:`frameworks_imported`) in :data:`PRELOAD_VAR`, and the fork server imports them before it
forks a worker.

An import may run a tensor operation (Lightning's does). With more than one intra-op thread that
starts torch's OpenMP team, and a child forked afterwards hangs in its first parallel operation:
the fork server imports them with one thread, and its children set theirs from
``OMP_NUM_THREADS``."""

from __future__ import annotations

import ast
import contextlib
import gc
import importlib
import os
import sys
from collections.abc import Mapping

PRELOAD_VAR = "HOPNET_PRELOAD"
"""Comma-separated modules the fork server imports before its first worker (``none``: nothing)."""
FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate", "hopnet.integrations")
"""The imports worth preloading when a script names them: each costs a worker seconds of CPU."""


def frameworks_imported(script: str | os.PathLike[str]) -> list[str]:
    """The modules of :data:`FRAMEWORKS` (and under them) that ``script``'s code imports, by any
    ``import`` statement at any depth; ``[]`` when it cannot be read or parsed."""
    try:
        with open(script, "rb") as f:
            tree = ast.parse(f.read(), filename=os.fspath(script))
    except (OSError, SyntaxError, ValueError):
        return []
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        else:
            continue
        found += [name for name in names if name not in found and _is_framework(name)]
    return found


def _is_framework(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FRAMEWORKS) and module != "hopnet.integrations"


def preload_named(env: Mapping[str, str]) -> None:
    """Import the modules ``env`` names in :data:`PRELOAD_VAR` (one a machine lacks is skipped: the
    worker's own import then says so), torch held at one intra-op thread meanwhile."""
    names = [n.strip() for n in env.get(PRELOAD_VAR, "").split(",") if n.strip() and n.strip() != "none"]
    missing = [n for n in names if n not in sys.modules]
    if not missing:
        return
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else 0
    if torch is not None:
        torch.set_num_threads(1)
    try:
        for name in missing:
            with contextlib.suppress(Exception):
                importlib.import_module(name)
    finally:
        if torch is not None:
            torch.set_num_threads(threads)
    gc.freeze()  # as the fork server's own imports: a worker's collector never walks (and copies) them


__all__ = ["FRAMEWORKS", "PRELOAD_VAR", "frameworks_imported", "preload_named"]
