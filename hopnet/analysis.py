"""What a run did, read back: iteration gaps, and the bounds Hop proves for them.

:class:`GapTracker` keeps the largest ``Iter(i) - Iter(j)`` seen while workers enter
iterations; the simulator feeds it live, :func:`max_gap_from_run` replays the ``enter``
events of a real run's logs (monotonic timestamps are shared by the processes of one
machine). :func:`gap_bound` is the protocol's proven bound (Hop's Table 1) for a graph and a configuration.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from hopnet.config import ProtocolConfig
from hopnet.errors import HopnetError
from hopnet.graph import Graph


class GapTracker:
    """Largest Iter(i) - Iter(j) ever observed, updated whenever a worker enters an iteration.

    ``largest`` (the largest gap and the first pair ``(i, j)`` in rank order that showed it)
    costs O(1) per entry, amortised; the ``n x n`` matrix of every pair's largest gap costs
    O(n) per entry and O(n^2) memory, so it is kept only when ``matrix`` is true.
    """

    def __init__(self, n: int, matrix: bool = True, start: int = 0) -> None:
        """``start``: the iteration every worker begins in (an elastic run's view begins past 0)."""
        self.iters = np.full(n, start, dtype=np.int64)
        self.max_gap: np.ndarray | None = np.zeros((n, n), dtype=np.int64) if matrix else None
        self._count: dict[int, int] = {start: n}  # how many workers are in each iteration
        self._min = start
        self._largest = (0, 0, 0)

    @property
    def largest(self) -> tuple[int, int, int]:
        """``(gap, i, j)``: the largest gap seen and the first pair in rank order that showed it
        (``(0, 0, 0)`` while no worker has been ahead of another)."""
        return self._largest

    def entered(self, rank: int, iteration: int) -> None:
        iters = self.iters
        before = int(iters[rank])
        iters[rank] = iteration
        self._move(before, iteration)
        if self.max_gap is not None:
            row = self.max_gap[rank]
            np.maximum(row, iteration - iters, out=row)
        gap = iteration - self._min
        best, bi, bj = self._largest
        if gap <= 0 or gap < best or (gap == best and rank > bi):
            return
        # The workers ``rank`` is ``gap`` ahead of are those in the lowest iteration.
        j = int(np.argmax(iters == self._min))
        if gap > best or rank < bi or j < bj:
            self._largest = (gap, rank, j)

    def _move(self, before: int, after: int) -> None:
        count = self._count
        count[before] -= 1
        if not count[before]:
            del count[before]
        count[after] = count.get(after, 0) + 1
        if after < self._min:
            self._min = after
        elif before == self._min and before not in count:
            self._min = min(count)


class RunLogError(HopnetError, ValueError):
    """A run directory whose event logs do not describe one run (the message is one line)."""


def _read_log(path: Path, rank: int) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    lines = path.read_text(encoding="utf-8").split("\n")
    last = len(lines)
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if lineno == last:
                break  # a live run's last line may be cut short: left out
            raise RunLogError(f"{path}:{lineno}: not a JSON record") from None
        if not isinstance(record, dict):
            raise RunLogError(f"{path}:{lineno}: not a JSON object")
        if record.get("rank", rank) != rank:
            raise RunLogError(f"{path}:{lineno}: a record of rank {record.get('rank')} in rank {rank}'s log")
        records.append(record)
    starts = [r for r in records if r.get("event") == "start"]
    # a replacement of a dead worker (hopnet launch --max-restarts) appends to its rank's log,
    # starting with a start record that carries "restart": N; an elastic worker's node of each
    # later view starts with one that carries "view": N
    fresh = [r for r in starts[1:] if not _is_restart(r.get("restart")) and not isinstance(r.get("view"), int)]
    if fresh:
        runs = 1 + len(fresh)
        raise RunLogError(f"{path} holds {runs} runs ({runs} start records without \"restart\"): the run "
                          "directory was reused; launch into a fresh --run-dir or pass --overwrite")
    return records


def _is_restart(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def incarnations(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """One rank's records split by process: the first one's, then each replacement's (from its
    ``start`` record with ``"restart": N``, see ``hopnet launch --max-restarts``)."""
    parts: list[list[dict[str, Any]]] = [[]]
    for record in records:
        if record.get("event") == "start" and _is_restart(record.get("restart")) and parts[-1]:
            parts.append([])
        parts[-1].append(record)
    return parts


def _elastic(folder: Path) -> bool:
    """Whether the run in ``folder`` was launched elastic (``launch.json``'s ``elastic``)."""
    try:
        return bool(json.loads((folder / "launch.json").read_text(encoding="utf-8")).get("elastic"))
    except (OSError, ValueError, AttributeError):
        return False


def load_run(run_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Every rank's event log in a run directory, by rank, checked to be one run.

    Raises :class:`RunLogError` for a log that is not JSON lines, holds several runs, or
    belongs to a rank that the run's ``graph.json`` does not have. A rank replaced while the
    run went on (``--max-restarts``) has one log holding each of its processes in turn, each
    replacement's from a ``start`` record with ``"restart": N`` (:func:`incarnations`).
    """
    folder = Path(run_dir)
    runs: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("rank*.jsonl")):
        suffix = path.stem[len("rank"):]
        if not suffix.isdigit():
            continue
        runs[int(suffix)] = _read_log(path, int(suffix))
    graph_path = folder / "graph.json"
    if graph_path.is_file() and not _elastic(folder):  # an elastic run's joiners take ranks beyond its first graph
        n = Graph.from_json(graph_path).n
        stray = sorted(r for r in runs if r >= n)
        if stray:
            raise RunLogError(f"{folder / f'rank{stray[0]}.jsonl'}: rank {stray[0]} is not in this run's graph "
                              f"({n} nodes), a file left by another run")
    return dict(sorted(runs.items()))


def max_gap_from_run(events: dict[int, list[dict[str, Any]]], n: int) -> np.ndarray:
    """Replay the ``enter`` events of all ranks in time order through a :class:`GapTracker`."""
    stray = sorted(r for r in events if not 0 <= r < n)
    if stray:
        raise RunLogError(f"event log of rank {stray[0]} in a run of {n} workers: a file left by another run?")
    entries = []
    for rank, recs in events.items():
        for rec in recs:
            if rec.get("event") != "enter":
                continue
            if not isinstance(rec.get("mono"), (int, float)) or not isinstance(rec.get("iter"), int):
                raise RunLogError(f"rank {rank}: an enter record without mono/iter: {json.dumps(rec)[:120]}")
            entries.append((rec["mono"], rank, rec["iter"]))
    entries.sort()
    tracker = GapTracker(n)
    for _, rank, iteration in entries:
        tracker.entered(rank, iteration)
    assert tracker.max_gap is not None
    return tracker.max_gap


def gap_bound(graph: Graph, config: ProtocolConfig) -> np.ndarray | None:
    """The bound the protocol proves on Iter(i) - Iter(j), as an N x N matrix (inf = unbounded); for
    Hop its Table 1. ``None`` for a protocol that proves none."""
    bound = config.spec.gap_bound
    return bound(config.options, graph) if bound is not None else None

