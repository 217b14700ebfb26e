"""Reading a run directory: graph.json, launch.json and the ranks' event logs.

:func:`load_run_dir` reads a finished (or running) run at once; :class:`LogTail` follows
one growing event log, handing out only complete lines, for the live progress line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError, HopnetError
from hopnet.graph import Graph

Record = dict[str, Any]
_RANK_LOG = re.compile(r"rank(\d+)\.jsonl")


@dataclass
class RunData:
    """Everything `hopnet report` knows about a run."""

    path: Path
    events: dict[int, list[Record]]
    graph: Graph | None = None
    config: ProtocolConfig | None = None
    launch: dict[str, Any] = field(default_factory=dict)
    coordinator: Record | None = None
    """The coordinator's ``stop`` record (``coordinator.jsonl``), for runs that had one."""

    @property
    def ranks(self) -> list[int]:
        return sorted(self.events)

    @property
    def world_size(self) -> int:
        if self.graph is not None:
            return self.graph.n
        return max(self.events, default=-1) + 1

    @property
    def t0(self) -> float:
        """The run's time origin on the shared monotonic clock: the earliest ``start`` record
        (or, in logs without one, the earliest stamped record)."""
        starts = [rec["mono"] for recs in self.events.values() for rec in recs
                  if rec.get("event") == "start" and "mono" in rec]
        if starts:
            return min(starts)
        stamped = [rec["mono"] for recs in self.events.values() for rec in recs if "mono" in rec]
        return min(stamped, default=0.0)


def rank_logs(run_dir: Path) -> dict[int, Path]:
    """``rank{R}.jsonl`` files of a run directory, by rank."""
    logs: dict[int, Path] = {}
    for path in run_dir.glob("rank*.jsonl"):
        match = _RANK_LOG.fullmatch(path.name)
        if match:
            logs[int(match.group(1))] = path
    return dict(sorted(logs.items()))


def parse_log(path: Path) -> list[Record]:
    """Records of one event log. A last line cut short (the worker is still writing it) is
    left out; a bad line anywhere else is an error naming the file and line."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    records: list[Record] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # partial last line
            raise ConfigError(f"{path}:{number}: not a JSON event record") from None
        if not isinstance(record, dict) or "event" not in record:
            raise ConfigError(f"{path}:{number}: not an event record (no 'event' field)")
        records.append(record)
    return records


def load_run_dir(run_dir: str | Path) -> RunData:
    """Read a run directory written by `hopnet launch` (or any directory of rank logs)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    logs = rank_logs(path)
    if not logs:
        raise ConfigError(f"{run_dir}: no rank*.jsonl event logs (is it a hopnet run directory?)")
    events = {rank: parse_log(log) for rank, log in logs.items()}
    launch = _read_json(path / "launch.json")
    graph = None
    if (path / "graph.json").exists():
        try:
            graph = Graph.from_json(path / "graph.json")
        except HopnetError as exc:
            raise ConfigError(f"{path / 'graph.json'}: {exc}") from None
    return RunData(path=path, events=events, graph=graph, config=_config(launch, events), launch=launch,
                   coordinator=_coordinator_stop(path / "coordinator.jsonl"))


def _coordinator_stop(path: Path) -> Record | None:
    """The coordinator's last ``stop`` record; None without a coordinator log or before it stopped."""
    if not path.exists():
        return None
    try:
        records = parse_log(path)
    except ConfigError:
        return None  # the coordinator's counts are extras: a damaged log must not cost the report
    return next((rec for rec in reversed(records) if rec.get("event") == "stop"), None)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    return data if isinstance(data, dict) else {}


def _config(launch: dict[str, Any], events: dict[int, list[Record]]) -> ProtocolConfig | None:
    """The options that ran: a ``start`` record's ``config`` if the workers logged it, else launch.json's."""
    candidates: list[Any] = [rec.get("config") for recs in events.values() for rec in recs[:3]
                             if rec.get("event") == "start"]
    candidates.append(launch.get("config"))
    for data in candidates:
        if isinstance(data, dict):
            try:
                return ProtocolConfig.from_record(dict(data))
            except (HopnetError, TypeError):
                continue
    return None


class LogTail:
    """Follows one event log as it grows: :meth:`read` returns the records of the lines
    completed since the last call (nothing while the file does not exist yet). With
    ``containing``, only lines holding those bytes are parsed (a reader after one rare event
    need not decode every iteration record of a fast run)."""

    def __init__(self, path: Path, containing: bytes | None = None) -> None:
        self.path = path
        self.containing = containing
        self._offset = 0
        self._partial = b""

    def read(self) -> list[Record]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        if not chunk:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        complete, _, self._partial = data.rpartition(b"\n")
        records: list[Record] = []
        for line in complete.split(b"\n"):
            if not line.strip() or (self.containing is not None and self.containing not in line):
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a damaged line must not stop the live view
            if isinstance(record, dict):
                records.append(record)
        return records
