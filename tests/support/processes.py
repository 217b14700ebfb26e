"""What a test asks of a process it started, or that a launch started."""

from __future__ import annotations

from hopnet.launch.death_watch import process_state


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    return process_state(pid) not in (None, "Z")
