"""A run directory holds one run: refuse to mix a new run into an old one's files.

Workers append to ``rank{R}.jsonl``, so a reused directory would get two ``start``
events in one log, and a smaller run would leave a larger run's ``rank3.jsonl``
behind for analysis to trip over. `hopnet launch --run-dir DIR` therefore refuses a
directory that already holds a run, and with ``--overwrite`` removes that run's
hopnet files first: the ones listed in :data:`RUN_FILE_PATTERNS`, nothing else.
"""

from __future__ import annotations

import os
from pathlib import Path

from hopnet.errors import ConfigError

RUN_FILE_PATTERNS = ("launch.json", "launch.json.tmp", "graph.json", "rank*.jsonl", "coordinator.jsonl")
"""The files a launch writes into its run directory (scripts may add their own, which stay)."""


def previous_run_files(path: str | os.PathLike[str]) -> list[Path]:
    """The hopnet files of an earlier run found in ``path`` (sorted; empty when there is none)."""
    folder = Path(path)
    if not folder.is_dir():
        return []
    found = {p for pattern in RUN_FILE_PATTERNS for p in folder.glob(pattern) if p.is_file()}
    return sorted(found)


def _describe(files: list[Path]) -> str:
    logs = [f for f in files if f.suffix == ".jsonl"]
    named = [f.name for f in files if f.suffix != ".jsonl" and not f.name.endswith(".tmp")]
    if logs:
        named.append(f"{len(logs)} event log{'' if len(logs) == 1 else 's'}")
    return ", ".join(named) if named else ", ".join(f.name for f in files)


def clear_previous_run(run_dir: str | os.PathLike[str], overwrite: bool) -> str | None:
    """Refuse a ``run_dir`` that holds a run, or (``overwrite``) remove that run's files.

    Returns a line saying what was removed, or ``None`` when there was nothing to remove.
    Raises :class:`ConfigError` when the directory holds a run and ``overwrite`` is false.
    """
    files = previous_run_files(run_dir)
    if not files:
        return None
    shown = os.fspath(run_dir)
    what = _describe(files)
    if not overwrite:
        raise ConfigError(f"--run-dir {shown} already holds a run ({what}): choose another directory "
                          "or pass --overwrite to replace it")
    for f in files:
        try:
            f.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise ConfigError(f"--overwrite: cannot remove {os.fspath(f)}: {exc.strerror or exc}") from None
    kept = sorted(p.name for p in Path(run_dir).iterdir())
    tail = f"; kept {len(kept)} other file{'' if len(kept) == 1 else 's'}" if kept else ""
    return f"--overwrite: removed the previous run's {what} from {shown}{tail}"
