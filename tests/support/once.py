"""A costly artefact made once per test session, whichever of pytest-xdist's worker processes
asks first: the others wait for it and read the same file."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The file ``name``, made by ``make(path)`` in the first process of this session to ask.

    Under xdist every worker's temporary root sits in one directory per session, the place for a
    shared file; a run without xdist has its own root. A ``make`` that raises leaves no file, so
    the next process to ask tries again (and fails the same way, naming its own test)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            partial = root / f"{name}.partial"
            make(partial)
            partial.rename(path)
    return path
