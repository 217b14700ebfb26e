"""What a test asks of a process it started, or that a launch started."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hopnet.launch.death_watch import process_state

from support.wait import wait_until


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    return process_state(pid) not in (None, "Z")


def wait_gone(pids: Iterable[int], timeout_s: float, *, running: Callable[[int], bool] = alive) -> None:
    """Wait until none of ``pids`` is ``running``; fail naming those still running after ``timeout_s``."""
    watched = list(pids)
    wait_until(lambda: not any(running(pid) for pid in watched), timeout_s,
               what=lambda: f"processes {watched} to end ({[pid for pid in watched if running(pid)]} still running)")
