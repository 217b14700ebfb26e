"""Per-worker event logs: one JSON object a line, for `hopnet report`, live progress and tests.

Every record has ``event``, ``rank``, ``t`` (seconds since the worker started, on its
clock: virtual time in the simulator) and ``mono`` (``time.monotonic()``, shared by the
processes of one machine, so the logs of a run merge into one timeline). The records and
their fields are documented in docs/reference/events.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any

FLUSH_INTERVAL_S = 0.5


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
    """Appends events to ``path`` as JSON lines.

    Written records reach the file at least every ``flush_interval_s`` (checked on each
    write; the Node also calls :meth:`flush` on a timer while it waits), so a reader
    following the file sees progress live. A reader may find a partial last line.
    """

    def __init__(self, path: str | Path, flush_interval_s: float = FLUSH_INTERVAL_S) -> None:
        super().__init__(keep=False)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")
        self.flush_interval_s = flush_interval_s
        self._flush_due = time.monotonic() + flush_interval_s
        self._pending = 0

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._pending += 1
        if time.monotonic() >= self._flush_due:
            self.flush()

    def flush(self) -> None:
        self._flush_due = time.monotonic() + self.flush_interval_s
        if self._file is not None and self._pending:
            self._file.flush()
            self._pending = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def parse_lines(text: str) -> list[dict[str, Any]]:
    """The records of a JSONL text. A last line cut short (still being written) is left
    out: no proper prefix of a JSON object is itself valid JSON."""
    lines = text.split("\n")
    records = [json.loads(line) for line in lines[:-1] if line.strip()]
    if lines[-1].strip():
        try:
            records.append(json.loads(lines[-1]))
        except json.JSONDecodeError:
            pass
    return records


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Load a JSONL event log written by :class:`JsonlEventLog` (tolerates a partial last line)."""
    return parse_lines(Path(path).read_text(encoding="utf-8"))
