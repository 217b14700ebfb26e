"""Process titles: what ``ps``, ``top`` and ``py-spy`` show for each process of a run.

Without them every forked worker reads ``python3 -m hopnet.bootstrap.forkserver 7`` (the fork
server's command line), and a user looking for the slow or stuck rank cannot tell which is
which. Each process names itself once it knows what it is:

* a worker: ``hopnet rank 2/8 train.py (run 20261128-hop-ring-8)`` (``restart 1`` added for a
  replacement), set by :mod:`hopnet.bootstrap.worker_main` before the script starts, or by
  :func:`hopnet.init` under torchrun or srun once the run directory is known;
* the coordinator: ``hopnet coordinator (run NAME)``;
* the fork server: ``hopnet fork server (run NAME)``, and its warm template
  ``hopnet fork server template``.

``NAME`` is the run directory's name. The title replaces ``/proc/PID/cmdline`` (what ``ps`` and
``py-spy`` show) and, cut to 15 bytes by the kernel, ``/proc/PID/comm`` (what ``top`` shows by
default): ``hopnet rank 2/8``. Without the ``setproctitle`` package nothing changes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from hopnet.bootstrap.env import RANK, RESTART, RUN_DIR, WORLD_SIZE

PREFIX = "hopnet"


def set_title(title: str) -> None:
    """Set this process's title (``/proc/PID/cmdline`` and ``comm``); a no-op without setproctitle."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def _run(run_dir: str | os.PathLike[str] | None, *extra: str) -> str:
    parts = [f"run {Path(run_dir).name}"] if run_dir else []
    parts.extend(extra)
    return f" ({', '.join(parts)})" if parts else ""


def script_name(argv: Sequence[str]) -> str:
    """What a worker runs, as its title shows it: the script's file name, or ``-m``'s module."""
    if not argv:
        return "python"
    if argv[0] == "-m" and len(argv) > 1:
        return argv[1]
    return os.path.basename(argv[0]) or argv[0]


def worker_title(rank: int, world_size: int, script: str, run_dir: str | os.PathLike[str] | None = None,
                 restart: int = 0) -> str:
    restarted = (f"restart {restart}",) if restart > 0 else ()
    return f"{PREFIX} rank {rank}/{world_size} {script}{_run(run_dir, *restarted)}"


def coordinator_title(run_dir: str | os.PathLike[str] | None) -> str:
    return f"{PREFIX} coordinator{_run(run_dir)}"


def store_title(run_dir: str | os.PathLike[str] | None) -> str:
    return f"{PREFIX} store{_run(run_dir)}"


def fork_server_title(run_dir: str | os.PathLike[str] | None) -> str:
    return f"{PREFIX} fork server{_run(run_dir)}"


TEMPLATE_TITLE = f"{PREFIX} fork server template"


def title_launched_worker(argv: Sequence[str], environ: Mapping[str, str]) -> None:
    """Title a worker `hopnet launch` started (its rank in ``HOPNET_RANK``); others are left as they are."""
    rank, world = environ.get(RANK, "").strip(), environ.get(WORLD_SIZE, "").strip()
    if not (rank.isdigit() and world.isdigit()):
        return
    restart = environ.get(RESTART, "").strip()
    set_title(worker_title(int(rank), int(world), script_name(argv), environ.get(RUN_DIR, "").strip() or None,
                           int(restart) if restart.isdigit() else 0))


__all__ = ["TEMPLATE_TITLE", "coordinator_title", "fork_server_title", "script_name", "set_title",
           "title_launched_worker", "worker_title"]
