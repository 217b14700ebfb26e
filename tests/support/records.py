"""A run's event records, read with :func:`hopnet.analysis.load_run`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hopnet.analysis import load_run


def records(run_dir: Path, rank: int, event: str | None = None) -> list[dict[str, Any]]:
    """``rank``'s records, only those of ``event`` if given; none while its log does not exist.

    Also for a live run: the last line of a log still being written may be cut short, and
    :func:`load_run` leaves it out."""
    recs = load_run(run_dir).get(rank, [])
    return recs if event is None else [r for r in recs if r.get("event") == event]


def all_records(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    """Every rank's records of a finished run, rank by rank."""
    return [r for recs in load_run(run_dir).values() for r in recs if event is None or r.get("event") == event]


def coordinator_records(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    """The coordinator's records (``coordinator.jsonl``, which :func:`load_run` does not read);
    a line still being written is left out, as :func:`load_run` does for a rank's log."""
    path = run_dir / "coordinator.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if event is None or record.get("event") == event:
            out.append(record)
    return out


class LogFollower:
    """A rank's event log read as it grows: each :meth:`new` returns the records written since
    the last call (a last line still being written waits for the next call)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def first_new(self, found: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        """The first record written since the last call that ``found`` accepts, or None; the
        records before and after it in that batch are read past."""
        return next((rec for rec in self.new() if found(rec)), None)


def consensus_error(run_dir: Path, n: int) -> float:
    """How far the furthest of ranks ``0..n-1``'s final models (``final_rank{r}.pt``, a flat tensor
    each) is from their mean, relative to the mean's norm."""
    import torch

    params = torch.stack([torch.load(run_dir / f"final_rank{r}.pt") for r in range(n)])
    mean = params.mean(dim=0)
    return ((params - mean).norm(dim=1) / mean.norm()).max().item()


def member_log(run_dir: Path, replica: int, member: int) -> list[dict[str, Any]]:
    """The event log of ``member`` of ``replica`` in a run of replica groups (member 0's is the replica's
    ``rank{R}.jsonl``, member m's ``lane{m}/rank{R}.jsonl``); a line still being written is left out,
    and a log not written yet is empty."""
    path = run_dir / (f"rank{replica}.jsonl" if member == 0 else f"lane{member}/rank{replica}.jsonl")
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
