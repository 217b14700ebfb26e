"""Keeping the model's floating buffers in step under the protocols that average gradients.

Averaged gradients keep the parameters identical on every rank, but a buffer that the
forward pass updates (BatchNorm's running statistics) follows each rank's own batches
and drifts apart. torch's DistributedDataParallel broadcasts rank 0's buffers before each
forward pass; the gradient protocols take ``--buffers``, declared once (:class:`GradientOptions`,
in :mod:`hopnet.protocols.gradient_options`) for all of them:

* ``broadcast`` (the default, DDP's choice): after each step every rank takes rank 0's
  buffers. Rank 0's own buffers follow its own batches exactly as under DDP.
* ``average``: after each step every rank takes the mean of all ranks' buffers.
* ``local``: buffers are never communicated (no extra message per step).

Integer buffers (``num_batches_tracked``) are never communicated (see
:mod:`hopnet.model_state`). A broadcast is a sum all-reduce in which every rank but the
root contributes zeros: ``x + 0`` is exact, so every rank ends with the root's bytes,
over the same collective (and the same order of calls) as the gradients.

A protocol whose reductions run behind the compute (pipe-sgd) cannot reduce the live
buffers, which the trainer's forward pass writes meanwhile: it reduces a copy taken when
the step launched the reduction (:meth:`BufferSync.snapshot`) and writes the result into
the model when it applies that reduction's gradient (:meth:`BufferSync.adopt`), so the
buffers lag by as many iterations as the gradients do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hopnet.protocols.gradient_options import BUFFER_MODES, GradientOptions
from hopnet.runtime.services import AllReduce

ROOT = 0


class BufferSync:
    """The floating buffers of one worker's model, and how ``mode`` keeps them in step."""

    def __init__(self, mode: str, buffers: Sequence[torch.Tensor], rank: int, world_size: int) -> None:
        self.mode = mode
        self.buffers = list(buffers)
        self.rank = rank
        self.active = mode != "local" and bool(self.buffers) and world_size > 1
        self._pool: list[list[torch.Tensor]] = []

    async def reduce(self, collective: AllReduce, group: Sequence[int], tensors: Sequence[torch.Tensor],
                     tag: str) -> None:
        """Broadcast or average ``tensors`` (the buffers, or a snapshot of them) in place among ``group``."""
        if not self.active:
            return
        for i, tensor in enumerate(tensors):
            if self.mode == "broadcast":
                if self.rank != ROOT:
                    tensor.zero_()
                await collective.allreduce(group, tensor, "sum", tag=f"{tag}/{i}")
            else:
                await collective.allreduce(group, tensor, "mean", tag=f"{tag}/{i}")

    async def sync(self, collective: AllReduce, group: Sequence[int], tag: str) -> None:
        """Bring the model's own buffers in step now (the trainer is blocked in its step)."""
        await self.reduce(collective, group, self.buffers, tag)

    def snapshot(self, source: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """A copy of the buffers as they are now (or of an earlier ``source`` snapshot), for a
        reduction that runs behind the compute."""
        copies = self._pool.pop() if self._pool else [torch.empty_like(b) for b in self.buffers]
        for copy, buffer in zip(copies, self.buffers if source is None else source):
            copy.copy_(buffer)
        return copies

    def adopt(self, reduced: Sequence[torch.Tensor]) -> None:
        """Write a reduced snapshot into the model's buffers (the root of a broadcast keeps its own,
        fresher ones), and take the snapshot back for reuse."""
        if not (self.mode == "broadcast" and self.rank == ROOT):
            for buffer, value in zip(self.buffers, reduced):
                buffer.copy_(value)
        self.release(reduced)

    def release(self, snapshot: Sequence[torch.Tensor]) -> None:
        self._pool.append(list(snapshot))


__all__ = ["BUFFER_MODES", "BufferSync", "GradientOptions"]
