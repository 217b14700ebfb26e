"""Epochs of a fixed number of batches over an :class:`~hopnet.data.ElasticSampler`'s endless
stream: what a trainer that counts epochs (Lightning's loop, the Hugging Face Trainer) iterates
in an elastic run (docs/guides/data.md).

Such a trainer reads an epoch's length from its loader once, and ends the epoch, validates and
saves at the same batch count on every worker. An elastic sampler's share of an epoch changes
with the members (it grows after a leave, shrinks after a join), so the trainer's epochs and the
data's part: a trainer epoch here is ``batches_per_epoch`` full batches drawn from the stream
(:meth:`ElasticSampler.batches`), the same count on every member whatever the view, while the
sampler's own epochs (each sample once across the members) follow the views underneath.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch.utils.data import Sampler

from hopnet.data.sampler import ElasticSampler


def batches_per_epoch(length: int, members: int, batch_size: int) -> int:
    """One pass over ``length`` samples by ``members`` workers of ``batch_size`` each (at least 1)."""
    return max(1, length // (max(1, members) * batch_size))


class FixedEpochs(Sampler[int]):
    """Dataset indices for a ``DataLoader`` of ``batch_size``: each iteration over it (a trainer
    epoch) yields ``batches_per_epoch`` full batches of ``source``'s stream, one after the other,
    and the next iteration goes on where this one stopped.

    Register it with the worker beside ``source`` (its state is the epoch length, so a joiner
    counts its donor's epochs, not one computed from the members it joined)."""

    def __init__(self, source: ElasticSampler, batch_size: int, batches_per_epoch: int) -> None:
        if batches_per_epoch < 1 or batch_size < 1:
            raise ValueError(f"FixedEpochs needs batch_size and batches_per_epoch >= 1 "
                             f"(got {batch_size}, {batches_per_epoch})")
        self.source = source
        self.batch_size = batch_size
        self.batches_per_epoch = batches_per_epoch
        self._stream: Iterator[list[int]] | None = None

    def __len__(self) -> int:
        return self.batches_per_epoch * self.batch_size

    def __iter__(self) -> Iterator[int]:
        if self._stream is None:
            self._stream = self.source.batches(self.batch_size)
        for _ in range(self.batches_per_epoch):
            batch = next(self._stream, None)
            if batch is None:  # this member is no longer among the members
                return
            yield from batch

    def state_dict(self) -> dict[str, Any]:
        return {"batches_per_epoch": self.batches_per_epoch, "batch_size": self.batch_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["batch_size"]) != self.batch_size:
            raise ValueError(f"a state for batches of {state['batch_size']} loaded into FixedEpochs of "
                             f"{self.batch_size}")
        self.batches_per_epoch = int(state["batches_per_epoch"])


__all__ = ["FixedEpochs", "batches_per_epoch"]
