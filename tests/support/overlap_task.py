"""The batches of tests/test_overlap.py and of its DDP reference (tests/workers/ddp_accumulate.py):
bn_task's model and data, with several micro-batches per step for gradient accumulation."""

from __future__ import annotations

import torch

from support.bn_task import batch

MICRO_BATCHES = 2


def micro_batch(rank: int, world: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``micro`` of ``step`` (``micro`` 0 alone: the step's whole batch)."""
    return batch(rank, world, step * MICRO_BATCHES + micro)
