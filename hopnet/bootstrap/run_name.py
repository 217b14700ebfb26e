"""A run directory's name, and its creation: ``runs/<YYYYmmdd-HHMMSS>-<protocol>-<graph>``.

The launcher makes it (:mod:`hopnet.launch.run_dir` then claims it); under torchrun or srun,
rank 0's worker makes it (:mod:`hopnet.bootstrap.attach`).
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path

from hopnet.errors import ConfigError
from hopnet.graph import Graph

RUNS_DIR = "runs"


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
