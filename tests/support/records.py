"""A run's event records, read with :func:`hopnet.analysis.load_run`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hopnet.analysis import load_run


def records(run_dir: Path, rank: int, event: str | None = None) -> list[dict[str, Any]]:
    """``rank``'s records of a finished run, only those of ``event`` if given."""
    recs = load_run(run_dir).get(rank, [])
    return recs if event is None else [r for r in recs if r.get("event") == event]


def all_records(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    """Every rank's records of a finished run, rank by rank."""
    return [r for recs in load_run(run_dir).values() for r in recs if event is None or r.get("event") == event]


def partial_records(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a log a running worker is still writing (its last line may be half)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out
