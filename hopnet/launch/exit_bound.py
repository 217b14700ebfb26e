"""The end of a run is bounded: once a worker has finished, the others get ``--exit-timeout``
(default ``--timeout``) to exit. A worker that finished its loop but does not exit (a thread
that never ends, an atexit handler that hangs) is then stopped and named; the run still counts
as finished. One still training that long after the first finished fails the run."""

from __future__ import annotations

from pathlib import Path

from hopnet.launch.worker_logs import worker_log

STOP_RECORD = (b'"event":"stop"', b'"event": "stop"')


def ends_with_event(run_dir: Path, rank: int, markers: tuple[bytes, ...], *, lines: int,
                    tail_bytes: int = 64 << 10) -> bool:
    """Whether one of the last ``lines`` lines of ``rank``'s event log holds one of ``markers``
    (only the log's tail is read)."""
    try:
        with worker_log(run_dir, rank).open("rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(0, handle.tell() - tail_bytes))
            tail = handle.read()
    except OSError:
        return False
    return any(marker in line for line in tail.splitlines()[-lines:] for marker in markers)


def finished_its_loop(run_dir: Path, rank: int) -> bool:
    """Whether ``rank``'s worker closed (a ``stop`` record near the end of its log): it finished training."""
    return ends_with_event(run_dir, rank, STOP_RECORD, lines=16)


def overdue_lines(run_dir: Path, pending: list[int], bound_s: float) -> tuple[list[str], list[int]]:
    """What to say of the ``pending`` ranks when the bound ran out, and which of them had not
    finished training (those fail the run)."""
    lines, unfinished = [], []
    for rank in pending:
        if finished_its_loop(run_dir, rank):
            lines.append(f"rank {rank} finished its loop but did not exit within {bound_s:g}s; killed")
        else:
            unfinished.append(rank)
    return lines, unfinished


__all__ = ["ends_with_event", "finished_its_loop", "overdue_lines"]
