"""Where the repository, the test worker scripts and the examples are."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "workers"
EXAMPLES = ROOT / "examples"
