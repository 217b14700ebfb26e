"""Per-worker event logs: one JSON object a line, for `hopnet report` and the tests.

Every record has ``event`` (``start``, ``iteration``, ``skip``, ``peer_left``, ``stop``...),
``rank`` and ``t`` (seconds since the worker started, on its clock: virtual time in the
simulator). ``iteration`` records add ``iter``, the update-queue depth ``queue``, the
``tokens`` held per out-neighbour, and whatever the trainer reported (``loss``...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any


class EventLog:
    """Collects events in memory (the simulator, tests). Subclasses also persist them."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        if self.keep:
            self.records.append(record)

    def flush(self) -> None:
        """Make what was written so far durable (for records that must survive a crash)."""

    def close(self) -> None:
        pass


class JsonlEventLog(EventLog):
    """Appends events to ``path`` as JSON lines (flushed every ``flush_every`` records and on close)."""

    def __init__(self, path: str | Path, flush_every: int = 32) -> None:
        super().__init__(keep=False)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")
        self._flush_every = flush_every
        self._pending = 0

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._pending += 1
        if self._pending >= self._flush_every:
            self._file.flush()
            self._pending = 0

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._pending = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Load a JSONL event log written by :class:`JsonlEventLog`."""
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
