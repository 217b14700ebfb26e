"""One account of a launch's time: start-up, training and shutdown.

The launcher's closing line and `hopnet report` give the same split, because the launcher
computes it once, from its own start and end and the ranks' event logs, and records it in
``launch.json`` (``result.phases``), where the report reads it:

* **start-up**: from the launcher's start (``run_launch``, after the command line was parsed)
  to the first ``enter`` record of any rank (the first iteration began);
* **training**: from there to the last ``iteration`` record of any rank;
* **shutdown**: from there to the launcher's end (workers' exit, the coordinator, the
  services, the other machines' launchers).

Every process of one machine reads the same ``CLOCK_MONOTONIC``, so the launcher's
``time.monotonic()`` and the records' ``mono`` compare directly. A run that never began an
iteration is all start-up; one whose logs are missing has no split.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hopnet.report.rundir import RunData

HEAD_BYTES = 64 << 10
"""How much of the start of an event log is read for the first ``enter`` record."""
TAIL_BYTES = 256 << 10
"""How much of the end of an event log is read for the last ``iteration`` record."""


def _ms(seconds: float) -> float:
    """To the millisecond, as ``launch.json`` keeps it: the closing line rounds this, not the raw
    value, so that it reads the same when the report rebuilds it from the file (0.4496 s would
    otherwise print as 0.4 here and 0.5 there)."""
    return round(seconds, 3)


@dataclass(frozen=True)
class Phases:
    """A launch's wall time, split (seconds)."""

    total_s: float
    startup_s: float
    training_s: float
    shutdown_s: float
    worker_exit_s: dict[int, float] = field(default_factory=dict)
    """How long each rank's process took to exit after its own last iteration."""
    launcher_exit_s: float | None = None
    """How long the launcher took to end after the last worker exited."""

    def text(self) -> str:
        """``start-up 2.9s, training 1.6s, shutdown 0.6s``."""
        return (f"start-up {_ms(self.startup_s):.1f}s, training {_ms(self.training_s):.1f}s, "
                f"shutdown {_ms(self.shutdown_s):.1f}s")

    def line(self) -> str:
        """``5.1s (start-up 2.9s, training 1.6s, shutdown 0.6s)``: the launcher's closing line and
        the report's overview say it in these words."""
        return f"{_ms(self.total_s):.1f}s ({self.text()})"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"total_s": _ms(self.total_s), "startup_s": _ms(self.startup_s),
                                "training_s": _ms(self.training_s), "shutdown_s": _ms(self.shutdown_s)}
        if self.worker_exit_s:
            data["worker_exit_s"] = {str(r): _ms(s) for r, s in sorted(self.worker_exit_s.items())}
        if self.launcher_exit_s is not None:
            data["launcher_exit_s"] = _ms(self.launcher_exit_s)
        return data

    @staticmethod
    def from_json(data: Any) -> Phases | None:
        """The split ``launch.json`` records, or ``None`` when it has none (or a malformed one)."""
        if not isinstance(data, dict):
            return None
        values = [data.get(k) for k in ("total_s", "startup_s", "training_s", "shutdown_s")]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return None
        exits = data.get("worker_exit_s")
        launcher = data.get("launcher_exit_s")
        total_s, startup_s, training_s, shutdown_s = (float(v) for v in values)  # type: ignore[arg-type]
        return Phases(total_s, startup_s, training_s, shutdown_s,
                      worker_exit_s={int(r): float(s) for r, s in exits.items()} if isinstance(exits, dict) else {},
                      launcher_exit_s=float(launcher) if isinstance(launcher, (int, float)) else None)


def launch_phases(run: RunData) -> Phases | None:
    """The split the launcher recorded for ``run`` (``launch.json``'s ``result.phases``)."""
    result = run.launch.get("result")
    return Phases.from_json(result.get("phases")) if isinstance(result, dict) else None


def split(started: float, ended: float, first_iteration: float | None, last_iteration: float | None) -> Phases:
    """The phases of a launch from ``started`` to ``ended`` (monotonic seconds), given when the
    first iteration began and the last one ended (``None``: none did)."""
    total = max(0.0, ended - started)
    if first_iteration is None or last_iteration is None:
        return Phases(total, total, 0.0, 0.0)
    first = min(max(first_iteration, started), ended)
    last = min(max(last_iteration, first), ended)
    return Phases(total, first - started, last - first, ended - last)


def _records(lines: Iterable[bytes]) -> Iterable[dict[str, Any]]:
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a partial line at a cut, or a corrupt one
        if isinstance(rec, dict):
            yield rec


def _mono(rec: dict[str, Any]) -> float | None:
    mono = rec.get("mono")
    return float(mono) if isinstance(mono, (int, float)) and not isinstance(mono, bool) else None


def log_span(path: Path) -> tuple[float | None, float | None]:
    """When a rank's first iteration began and its last one ended, from its event log."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - TAIL_BYTES))
            tail = f.read()
    except OSError:
        return None, None
    first = next((m for rec in _records(head.splitlines()) if rec.get("event") == "enter"
                  and (m := _mono(rec)) is not None), None)
    last = next((m for rec in reversed(list(_records(tail.splitlines()))) if rec.get("event") == "iteration"
                 and (m := _mono(rec)) is not None), None)
    return first, last


def run_phases(run_dir: Path, ranks: Iterable[int], started: float, ended: float,
               exits: Mapping[int, float] | None = None) -> Phases:
    """The split of a launch of ``ranks`` whose logs are in ``run_dir``; ``exits``: when the
    launcher saw each rank's process exit (for :attr:`Phases.worker_exit_s`)."""
    exits = exits or {}
    firsts: list[float] = []
    lasts: dict[int, float] = {}
    for rank in ranks:
        first, last = log_span(run_dir / f"rank{rank}.jsonl")
        if first is not None:
            firsts.append(first)
        if last is not None:
            lasts[rank] = last
    phases = split(started, ended, min(firsts) if firsts else None, max(lasts.values()) if lasts else None)
    worker_exit_s = {r: max(0.0, exits[r] - last) for r, last in lasts.items() if r in exits}
    launcher_exit_s = max(0.0, ended - max(exits.values())) if exits else None
    return Phases(phases.total_s, phases.startup_s, phases.training_s, phases.shutdown_s,
                  worker_exit_s, launcher_exit_s)


__all__ = ["Phases", "launch_phases", "log_span", "run_phases", "split"]
