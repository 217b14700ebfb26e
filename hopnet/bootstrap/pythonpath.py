"""The ``PYTHONPATH`` a launch gives its processes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import hopnet


def worker_pythonpath(environ: Mapping[str, str]) -> str:
    """PYTHONPATH for workers: this hopnet's parent directory first, so workers import the
    same hopnet as the launcher even when it is not installed."""
    root = str(Path(hopnet.__file__).resolve().parent.parent)
    parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        parts.insert(0, root)
    return os.pathsep.join(parts)
