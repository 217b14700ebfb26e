"""Where the launcher reads a worker process's event log, and which process a log's peer is.

With one process per replica, process ``R`` logs to ``rank{R}.jsonl`` and names its peers by
rank. In a run of replica groups (``launch.json``'s ``replicas``) a process logs where its lane
does (:meth:`hopnet.replica.layout.ReplicaLayout.log_name`) and names its peers by replica: the
peer of member ``m`` is member ``m`` of that replica.
"""

from __future__ import annotations

import json
from pathlib import Path

from hopnet.replica.layout import lane_log_name

_cache: dict[Path, tuple[int, int]] = {}
"""run directory -> (launch.json's mtime_ns, replica size)."""


def replica_size(run_dir: Path) -> int:
    """The run's processes per replica (1 when ``launch.json`` names no replicas, or is unreadable)."""
    record = run_dir / "launch.json"
    try:
        stamp = record.stat().st_mtime_ns
    except OSError:
        return 1
    cached = _cache.get(run_dir)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    try:
        replicas = json.loads(record.read_text(encoding="utf-8")).get("replicas")
    except (OSError, ValueError):
        return 1
    size = int(replicas["size"]) if isinstance(replicas, dict) and isinstance(replicas.get("size"), int) else 1
    _cache[run_dir] = (stamp, size)
    return size


def worker_log(run_dir: Path, rank: int) -> Path:
    """The event log of process ``rank``."""
    size = replica_size(run_dir)
    if size == 1:
        return run_dir / f"rank{rank}.jsonl"
    return run_dir / lane_log_name(rank // size, rank % size)


def peer_process(run_dir: Path, writer: int, peer: int) -> int:
    """The process that ``peer``, named in process ``writer``'s log, stands for."""
    size = replica_size(run_dir)
    return peer if size == 1 else peer * size + writer % size


__all__ = ["peer_process", "replica_size", "worker_log"]
