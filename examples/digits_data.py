"""The digits dataset as tensors: one stratified train/held-out split, cached on disk.

Loading digits through scikit-learn costs about 1.5 CPU-seconds per process (the import of
sklearn itself), paid again by every worker of every run. The split is a pure function of
its seed and test fraction, so it is computed once and kept as a small tensor file under
``$HOPNET_DATA_DIR`` (default ``~/.cache/hopnet``). Delete the file to rebuild it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

Split = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def data_dir() -> Path:
    configured = os.environ.get("HOPNET_DATA_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "hopnet"


def digits_split(seed: int, test_size: float = 0.2) -> Split:
    """``(x_train, y_train, x_test, y_test)``: pixels scaled to [0, 1], labels as int64."""
    path = data_dir() / f"digits-split-seed{seed}-test{test_size}.pt"
    try:
        cached = torch.load(path, weights_only=True)
        return cached["x_train"], cached["y_train"], cached["x_test"], cached["y_test"]
    except (OSError, EOFError, RuntimeError, KeyError):
        pass
    split = _split_with_sklearn(seed, test_size)
    _write_atomically(path, dict(zip(("x_train", "y_train", "x_test", "y_test"), split)))
    return split


def _split_with_sklearn(seed: int, test_size: float) -> Split:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_size, random_state=seed, stratify=y)
    return x_train, y_train, x_test, y_test


def _write_atomically(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Concurrent workers may all miss the cache; each writes a private file and renames it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as handle:
            torch.save(tensors, handle)
        os.replace(handle.name, path)
    except OSError:
        pass  # a read-only home only costs the next run the sklearn load again
