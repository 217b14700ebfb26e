"""Each process's shard of what the replica holds: contiguous, near-equal slices of a flat tensor.

In ``ddp`` mode every process of a replica holds the whole model (hopnet's flat tensors), and
member ``m`` runs its lane on slice ``m`` of each flat: :func:`lane_state` is that slice as a
:class:`~hopnet.model_state.ModelState` of views, so what the lane mixes lands in the model.
:func:`share_slices` then gives every member every other member's slices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hopnet.model_state import ModelState


def bounds(numel: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` of ``numel`` elements cut into ``parts`` near-equal slices."""
    base, extra = divmod(numel, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _overlap(part: tuple[int, int], region: tuple[int, int]) -> tuple[int, int] | None:
    start, stop = max(part[0], region[0]), min(part[1], region[1])
    return (start, stop) if start < stop else None


def lane_state(state: ModelState, parts: int, index: int) -> ModelState:
    """Slice ``index`` of every flat of ``state`` (its parameter and buffer parts where it covers them)."""
    flats, params, buffers = [], [], []
    param_parts = {p.data_ptr(): p.numel() for p in state.params}  # each flat's parameter part starts it
    for flat in state.flats:
        start, stop = bounds(flat.numel(), parts, index)
        flats.append(flat[start:stop])
        n_params = param_parts.get(flat.data_ptr(), 0)
        if (piece := _overlap((start, stop), (0, n_params))) is not None:
            params.append(flat[piece[0]:piece[1]])
        if (piece := _overlap((start, stop), (n_params, flat.numel()))) is not None:
            buffers.append(flat[piece[0]:piece[1]])
    return ModelState(flats, params, buffers)


def buffer_regions(state: ModelState) -> list[torch.Tensor]:
    """The floating buffers of each flat (what DDP broadcasts from the replica's first process)."""
    return list(state.buffers)


def share_slices(tensors: Sequence[torch.Tensor], parts: int, index: int, group: Any) -> None:
    """Every member's slice of each tensor, from that member to all (an all-gather of uneven slices as
    one broadcast per member: slices are views, written in place)."""
    del index  # every member sends its own slice and receives the others alike
    works = []
    for tensor in tensors:
        for member in range(parts):
            start, stop = bounds(tensor.numel(), parts, member)
            if start == stop:
                continue
            src = dist.get_global_rank(group, member) if group is not dist.group.WORLD else member
            works.append(dist.broadcast(tensor[start:stop], src=src, group=group, async_op=True))
    for work in works:
        work.wait()


__all__ = ["bounds", "buffer_regions", "lane_state", "share_slices"]
