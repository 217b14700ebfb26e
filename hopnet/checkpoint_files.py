"""Where per-rank checkpoints live and which iterations they hold: their file names, the variables
that place them, and the common resume point (:func:`common_iteration`). Torch-free, so that the
launcher, which finds the resume point, does not import torch; :mod:`hopnet.checkpoint` writes and
reads the files."""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINT_EVERY = "HOPNET_CHECKPOINT_EVERY"
CHECKPOINT_DIR = "HOPNET_CHECKPOINT_DIR"
RESUME = "HOPNET_RESUME"
DEFAULT_SUBDIR = "checkpoints"
OPTIMIZER_STATE = "hopnet.optimizer"
"""The name a DistributedOptimizer registers its state under (:meth:`hopnet.api.Worker.register_state`)."""
PROTOCOL_STATE = "hopnet.protocol"
"""The name a protocol's own state is saved under (:meth:`hopnet.protocols.base.Protocol.checkpoint_state`)."""
KEEP = 3
"""Checkpoints kept per rank (the newest): enough for ranks a few iterations apart to share one."""
_NAME = re.compile(r"rank(\d+)-iter(\d+)\.pt")


def checkpoint_name(rank: int, iteration: int) -> str:
    return f"rank{rank}-iter{iteration:08d}.pt"


def rank_iterations(directory: Path, rank: int) -> list[int]:
    """The iterations of ``rank``'s complete checkpoints in ``directory``, ascending."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.fullmatch(path.name)
        if match and int(match.group(1)) == rank:
            found.append(int(match.group(2)))
    return sorted(found)


def common_iteration(directory: Path, world_size: int) -> int | None:
    """The highest iteration that every rank ``0 .. world_size-1`` has a complete checkpoint of."""
    common: set[int] | None = None
    for rank in range(world_size):
        mine = set(rank_iterations(directory, rank))
        common = mine if common is None else common & mine
        if not common:
            return None
    return max(common) if common else None
