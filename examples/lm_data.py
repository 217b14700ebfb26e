"""A text corpus every machine has without a download: the Python standard library's own source.

The ``.py`` files under the running interpreter's ``stdlib`` path (``site-packages`` and the test
suites left out), as bytes: the tokenizer is the identity on bytes (a vocabulary of 256). The
files are taken in the order of a hash of their path relative to that root (a mix of modules, not
an alphabetical prefix) until ``max_bytes`` is reached, and a second hash of the same path puts a
file in the held-out split or the training split. Both are pure functions of the paths, so every
worker, and every machine with the same Python version, reads the same split.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import torch

SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[str]:
    """The corpus's files as paths relative to ``root`` (posix), sorted."""
    root = stdlib_root() if root is None else root
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]  # not into site-packages: it can be huge
        relative = Path(folder).relative_to(root)
        files += [(relative / name).as_posix() for name in names
                  if name.endswith(".py") and not name.startswith("test_")]
    return sorted(files)


def _digest(relative: str) -> bytes:
    return hashlib.blake2b(relative.encode(), digest_size=16, person=b"hopnet-lm").digest()


def is_heldout(relative: str, heldout_percent: int = 5) -> bool:
    """Whether the file goes to the held-out split: a hash of its relative path decides."""
    return _digest(relative)[0] * 100 < heldout_percent * 256


def load_corpus(max_bytes: int, *, root: Path | None = None,
                heldout_percent: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, heldout)``: uint8 tensors of the files' bytes, each file followed by a newline; about
    ``max_bytes`` of training text and a tenth of that held out (less where the files run out)."""
    root = stdlib_root() if root is None else root
    splits: dict[bool, list[bytes]] = {False: [], True: []}
    sizes = {False: 0, True: 0}
    caps = {False: max_bytes, True: max_bytes // 10}
    for relative in sorted(corpus_files(root), key=lambda name: (_digest(name)[1:], name)):
        held = is_heldout(relative, heldout_percent)
        if sizes[held] < caps[held]:
            splits[held].append((root / relative).read_bytes() + b"\n")
            sizes[held] += len(splits[held][-1])
        if sizes[False] >= caps[False] and sizes[True] >= caps[True]:
            break
    train, heldout = splits[False], splits[True]
    if not train or not heldout:
        raise SystemExit(f"lm_data: too little stdlib source under {root} for a train/held-out split")
    return (torch.frombuffer(bytearray(b"".join(train)), dtype=torch.uint8),
            torch.frombuffer(bytearray(b"".join(heldout)), dtype=torch.uint8))


def random_windows(data: torch.Tensor, context: int, count: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` windows at random offsets: inputs and next-byte targets, int64 ``[count, context]``."""
    starts = torch.randint(len(data) - context - 1, (count,), generator=generator)
    windows = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def heldout_windows(data: torch.Tensor, context: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out set: ``count`` windows evenly spaced over the held-out bytes, the same everywhere."""
    starts = torch.linspace(0, len(data) - context - 1, count).long()
    windows = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]
