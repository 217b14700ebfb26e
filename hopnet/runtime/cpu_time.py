"""Where a worker's training thread spent its time on the machine's cores: the kernel's counters.

``/proc/self/task/TID/schedstat`` gives a thread's time on a core and the time it was runnable
but waited for one (the run queue). Summed over the worker's two busy threads (the trainer's
and its event loop's) at the start and at the end of training, the second one tells CPU
contention (more busy workers than cores, or a busy machine) apart from a slow link or a
straggler: a worker that waits for a core does not wait on its peers, and no protocol option
gives it a core (:mod:`hopnet.report.contention`). Those two, not every thread of the process:
the others (ZeroMQ's, gloo's) wake briefly and often, and their short waits would make a
sleeping worker look busy.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from pathlib import Path

TASKS = Path("/proc/self/task")


def machine() -> dict[str, object]:
    """This process's machine and the cores it may run on (its CPU affinity)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 0
    return {"host": socket.gethostname(), "cores": cores}


def scheduler_times(threads: Iterable[int | None]) -> dict[str, float]:
    """Seconds the ``threads`` (native ids) ran (``cpu_s``) and waited runnable for a core (``runq_s``)
    so far; empty where the kernel does not count them."""
    ran = waited = 0
    for tid in {t for t in threads if t is not None}:
        try:
            fields = (TASKS / str(tid) / "schedstat").read_text().split()
            ran, waited = ran + int(fields[0]), waited + int(fields[1])
        except (OSError, IndexError, ValueError):
            return {}
    return {"cpu_s": round(ran / 1e9, 6), "runq_s": round(waited / 1e9, 6)}


__all__ = ["machine", "scheduler_times"]
