"""How many threads each worker's torch may use: the usable cores shared among the local workers.

torch sizes its intra-op thread pool to all the machine's cores by default. With
several workers on one machine every worker then runs that many threads, and the
oversubscribed cores make a small model several times slower. Like torchrun, the
launcher sets ``OMP_NUM_THREADS`` (which torch reads at start-up) to the cores this
process may run on divided by the workers it starts, at least 1, unless the user set
it already.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

THREADS_VAR = "OMP_NUM_THREADS"


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def threads_per_worker(local_workers: int, cores: int | None = None) -> int:
    cores = usable_cores() if cores is None else cores
    return max(1, cores // max(1, local_workers))


def limit_worker_threads(env: MutableMapping[str, str], local_workers: int, cores: int | None = None) -> str | None:
    """Set ``OMP_NUM_THREADS`` in ``env`` unless it is there; return the line that says so (or None)."""
    if env.get(THREADS_VAR, "").strip():
        return None
    cores = usable_cores() if cores is None else cores
    threads = threads_per_worker(local_workers, cores)
    env[THREADS_VAR] = str(threads)
    plural = "" if local_workers == 1 else "s"
    return (f"{THREADS_VAR}={threads} for each of {local_workers} worker{plural} ({cores} usable cores); "
            f"set {THREADS_VAR} to choose otherwise")
