"""A run directory holds one run: refuse to mix a new run into an old one's files.

Workers append to ``rank{R}.jsonl``, so a reused directory would get two ``start``
events in one log, and a smaller run would leave a larger run's ``rank3.jsonl``
behind for analysis to trip over. `hopnet launch --run-dir DIR` therefore refuses a
directory that already holds a run, and with ``--overwrite`` removes that run's
hopnet files first: the ones listed in :data:`RUN_FILE_PATTERNS`, nothing else.
Without ``--run-dir`` a fresh ``runs/<time>-<protocol>-<graph>`` is made (:func:`make_run_dir`).
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path

from hopnet.graph import Graph

from hopnet.errors import ConfigError

RUN_FILE_PATTERNS = ("launch.json", "launch.json.tmp", "graph.json", "rank*.jsonl", "coordinator.jsonl", "model.pt")
"""The files a launch writes into its run directory (scripts may add their own, which stay)."""
RUNS_DIR = "runs"


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


def _slug(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.]+", "-", text).strip("-.")
    return slug or "graph"


def graph_label(graph: Graph, spec: Graph | str | os.PathLike[str] | None) -> str:
    """A short name for run directories: the graph's name, else the file's stem."""
    if graph.name:
        return _slug(graph.name)
    if spec is not None and not isinstance(spec, Graph):
        return _slug(Path(os.fspath(spec)).stem)
    return f"graph{graph.n}"


def make_run_dir(run_dir: str | os.PathLike[str] | None, protocol: str, label: str,
                 base: str | os.PathLike[str] = RUNS_DIR) -> Path:
    """Create and return the run directory: ``run_dir`` as given, or a fresh
    ``runs/<YYYYmmdd-HHMMSS>-<protocol>-<graph>`` (suffixed ``-2``, ``-3``... if taken)."""
    if run_dir is not None:
        path = Path(run_dir)
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--run-dir {os.fspath(run_dir)!r} exists and is not a directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--run-dir {os.fspath(run_dir)!r}: {exc.strerror or exc}") from None
        return path.resolve()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = f"{stamp}-{_slug(protocol)}-{label}"
    base_path = Path(base)
    try:
        base_path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {os.fspath(base_path)!r}: {exc.strerror or exc}") from None
    for attempt in range(1, 1000):
        path = base_path / (stem if attempt == 1 else f"{stem}-{attempt}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(f"cannot create run directory {os.fspath(path)!r}: {exc.strerror or exc}") from None
        return path.resolve()
    raise ConfigError(f"cannot find a free run directory name under {os.fspath(base_path)!r}")
