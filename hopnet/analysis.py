"""What a run did, read back: iteration gaps, and the bounds Hop proves for them.

:class:`GapTracker` keeps the largest ``Iter(i) - Iter(j)`` seen while workers enter
iterations; the simulator feeds it live, :func:`max_gap_from_run` replays the ``enter``
events of a real run's logs (monotonic timestamps are shared by the processes of one
machine). :func:`gap_bound` is Hop's Table 1 for a graph and a configuration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hopnet.config import ProtocolConfig
from hopnet.graph import Graph
from hopnet.runtime.events import read_events


class GapTracker:
    """Largest Iter(i) - Iter(j) ever observed, updated whenever a worker enters an iteration."""

    def __init__(self, n: int) -> None:
        self.iters = np.zeros(n, dtype=np.int64)
        self.max_gap = np.zeros((n, n), dtype=np.int64)

    def entered(self, rank: int, iteration: int) -> None:
        self.iters[rank] = iteration
        row = self.max_gap[rank]
        np.maximum(row, iteration - self.iters, out=row)


def load_run(run_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Every rank's event log in a run directory, by rank."""
    runs: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(Path(run_dir).glob("rank*.jsonl")):
        rank = int(path.stem[len("rank"):])
        runs[rank] = read_events(path)  # a live run's last line may be cut short: left out
    return runs


def max_gap_from_run(events: dict[int, list[dict[str, Any]]], n: int) -> np.ndarray:
    """Replay the ``enter`` events of all ranks in time order through a :class:`GapTracker`."""
    entries = sorted((rec["mono"], rank, rec["iter"]) for rank, recs in events.items()
                     for rec in recs if rec.get("event") == "enter")
    tracker = GapTracker(n)
    for _, rank, iteration in entries:
        tracker.entered(rank, iteration)
    return tracker.max_gap


def gap_bound(graph: Graph, config: ProtocolConfig) -> np.ndarray:
    """Hop's Table 1: the upper bound on Iter(i) - Iter(j) as an N x N matrix (inf = unbounded)."""
    d = graph.shortest_path_lengths().astype(float)
    forward = d.T  # forward[i][j] = length(Path j -> i)
    backward = d   # backward[i][j] = length(Path i -> j)
    if config.protocol == "notify-ack":
        return np.minimum(forward, 2 * backward)
    if config.has_backup_workers:
        base = np.full_like(forward, np.inf)
    elif config.staleness is not None:
        base = (config.staleness + 1) * forward
    else:
        base = forward
    if config.token_queues:
        return np.minimum(base, config.max_ig * backward)
    return base
