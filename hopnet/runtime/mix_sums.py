"""Weighted sums of received updates, one per iteration in flight (issue 18: bounded memory).

Hop's mix (Eq. 1) is a weighted average, so it need not keep every update until the
reduce: as an update of iteration ``k`` arrives it is added, weighted, into one sum for
``k``, and its receive buffer is given back. The first update of an iteration becomes
that sum itself (scaled in place), so a worker holds the model, one sum per iteration in
flight and the buffers being received, whatever its in-degree. The weights are summed
too: the reduce divides by them and its own weight, so backup workers (however many
updates came) and any per-update weight are renormalised at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class WeightedSum:
    tensors: list[torch.Tensor]
    """``sum(weight_j * update_j)``, tensor by tensor."""
    weight: float
    """``sum(weight_j)``."""
    count: int


class MixSums:
    """One :class:`WeightedSum` per iteration; ``release`` takes back buffers no longer needed."""

    def __init__(self, release: Callable[[list[torch.Tensor]], None]) -> None:
        self._release = release
        self._sums: dict[int, WeightedSum] = {}
        self.high_water = 0
        """Most iterations summed at once."""

    def add(self, iteration: int, tensors: list[torch.Tensor], weight: float) -> None:
        """Add ``weight * tensors`` into iteration's sum. The sum owns ``tensors`` afterwards (it
        becomes the sum, or is released once added)."""
        held = self._sums.get(iteration)
        if held is None:
            for t in tensors:
                t.mul_(weight)
            self._sums[iteration] = WeightedSum(tensors, weight, 1)
            self.high_water = max(self.high_water, len(self._sums))
            return
        for total, t in zip(held.tensors, tensors):
            total.add_(t, alpha=weight)
        held.weight += weight
        held.count += 1
        self._release(tensors)

    def pop(self, iteration: int) -> WeightedSum | None:
        """Iteration's sum (None if nothing was added), now the caller's to release."""
        return self._sums.pop(iteration, None)

    def discard_older_than(self, iteration: int) -> None:
        for old in [k for k in self._sums if k < iteration]:
            self._release(self._sums.pop(old).tensors)

    def __len__(self) -> int:
        return len(self._sums)


def mix_into(flats: list[torch.Tensor], own_weight: float, summed: WeightedSum) -> None:
    """``flat <- (own_weight * flat + sum) / (own_weight + sum weight)``, in place."""
    total = own_weight + summed.weight
    for flat, part in zip(flats, summed.tensors):
        flat.mul_(own_weight / total).add_(part, alpha=1.0 / total)
