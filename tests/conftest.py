"""Shared helpers for the multi-process tests: run `hopnet launch` as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
EXAMPLES = ROOT / "examples"


def run_launch(args: list[str], *, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`hopnet launch ARGS`, capturing output; the launcher ends its workers itself."""
    return subprocess.run([sys.executable, "-m", "hopnet.cli.main", "launch", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture
def launch():
    return run_launch
