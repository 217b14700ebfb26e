"""Weighted sums of received updates, one per iteration in flight, region by region (issue 18).

Hop's mix (Eq. 1) is a weighted average, so it need not keep every update until the
reduce: as an update of iteration ``k`` arrives it is added, weighted, into one sum for
``k``. A worker then holds the model, one sum per iteration in flight and the buffers being
received, whatever its in-degree.

The model's flat tensors are cut into :class:`Region` s (:func:`plan_regions`): one per
tensor for a model sent whole, chunks of a fixed size for one that is streamed (each chunk
its own message). A sum keeps a part and a weight total per region, allocated when the
region's first contribution arrives (the received chunk itself becomes the part, scaled in
place), so a sum holds only the regions that came, and an update that arrived in part (a
backup worker whose update was still arriving at the reduce, a sender that died
mid-stream) counts exactly in the regions it delivered: :func:`mix_into` divides each
region by its own weight total.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hopnet.wire import TensorSpec


@dataclass(frozen=True, slots=True)
class Region:
    """Elements ``start .. start + count`` of flat tensor ``tensor``."""

    tensor: int
    start: int
    count: int
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.dtype, (self.count,))

    def of(self, flats: list[torch.Tensor]) -> torch.Tensor:
        return flats[self.tensor][self.start:self.start + self.count]


def plan_regions(specs: tuple[TensorSpec, ...], chunk_bytes: int | None,
                 devices: Sequence[torch.device] = ()) -> tuple[Region, ...]:
    """The regions of flat tensors ``specs`` (on ``devices``, CPU by default): each tensor whole
    (``chunk_bytes`` None), or cut into chunks of at most ``chunk_bytes`` (at least one element each).
    Sender and receiver derive the same plan from the same specs and chunk size."""
    regions: list[Region] = []
    for i, spec in enumerate(specs):
        n = spec.numel
        device = devices[i] if devices else torch.device("cpu")
        if chunk_bytes is None:
            regions.append(Region(i, 0, n, spec.dtype, device))
            continue
        step = max(1, chunk_bytes // max(1, spec.nbytes // max(1, n)))
        for start in range(0, max(n, 1), step):
            regions.append(Region(i, start, min(step, n - start), spec.dtype, device))
    return tuple(regions)


class RegionPool:
    """Free tensors by (dtype, numel, device): chunk receive buffers and sum parts, recycled."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int, torch.device], list[torch.Tensor]] = {}
        self.allocated = 0

    def take(self, region: Region) -> torch.Tensor:
        free = self._free.get((region.dtype, region.count, region.device))
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(region.count, dtype=region.dtype, device=region.device)

    def has_free(self, regions: Sequence[Region]) -> bool:
        """Whether :meth:`take` would hand out a tensor for each of ``regions`` without allocating one."""
        need: dict[tuple[torch.dtype, int, torch.device], int] = {}
        for region in regions:
            key = (region.dtype, region.count, region.device)
            need[key] = need.get(key, 0) + 1
        return all(len(self._free.get(key, ())) >= count for key, count in need.items())

    def give(self, tensor: torch.Tensor) -> None:
        if tensor.dim() == 1 and tensor.is_contiguous() and tensor.storage_offset() == 0:
            self._free.setdefault((tensor.dtype, tensor.numel(), tensor.device), []).append(tensor)


@dataclass(slots=True)
class WeightedSum:
    parts: list[torch.Tensor | None]
    """Per region, ``sum(weight_j * update_j[region])`` over the updates that delivered it."""
    weights: list[float]
    """Per region, ``sum(weight_j)`` over the same updates."""
    chunks: int = 0
    """Contributions added (a whole update counts once per region)."""


class MixSums:
    """One :class:`WeightedSum` per iteration over ``regions``; parts come from and go back to ``pool``."""

    def __init__(self, regions: tuple[Region, ...], pool: RegionPool) -> None:
        self.regions = regions
        self.pool = pool
        self._sums: dict[int, WeightedSum] = {}
        self.high_water = 0
        """Most iterations summed at once."""

    def _sum(self, iteration: int) -> WeightedSum:
        held = self._sums.get(iteration)
        if held is None:
            n = len(self.regions)
            held = self._sums[iteration] = WeightedSum([None] * n, [0.0] * n)
            self.high_water = max(self.high_water, len(self._sums))
        return held

    def add(self, iteration: int, index: int, tensor: torch.Tensor, weight: float) -> None:
        """Add ``weight * tensor`` into region ``index`` of iteration's sum. The sum owns ``tensor``
        afterwards (it becomes the region's part, or goes back to the pool once added)."""
        held = self._sum(iteration)
        part = held.parts[index]
        if part is None:
            held.parts[index] = tensor.mul_(weight)
        else:
            part.add_(tensor, alpha=weight)
            self.pool.give(tensor)
        held.weights[index] += weight
        held.chunks += 1

    def add_copy(self, iteration: int, index: int, tensor: torch.Tensor, weight: float) -> None:
        """Like :meth:`add` for a tensor the caller keeps (a view into a whole update)."""
        held = self._sum(iteration)
        part = held.parts[index]
        if part is None:
            held.parts[index] = torch.mul(tensor, weight, out=self.pool.take(self.regions[index]))
        else:
            part.add_(tensor, alpha=weight)
        held.weights[index] += weight
        held.chunks += 1

    def add_whole(self, iteration: int, tensors: list[torch.Tensor], weight: float) -> list[torch.Tensor]:
        """Add a whole update region by region. Returns the tensors the sum did not take (a region
        that is a whole tensor takes it; others are copied out of it)."""
        left = list(tensors)
        for index, region in enumerate(self.regions):
            whole = tensors[region.tensor]
            if region.start == 0 and region.count == whole.numel():
                self.add(iteration, index, whole, weight)
                left = [t for t in left if t is not whole]
            else:
                self.add_copy(iteration, index, region.of(tensors), weight)
        return left

    def pop(self, iteration: int) -> WeightedSum | None:
        """Iteration's sum (None if nothing was added), now the caller's to :meth:`release`."""
        return self._sums.pop(iteration, None)

    def release(self, summed: WeightedSum) -> None:
        for part in summed.parts:
            if part is not None:
                self.pool.give(part)
        summed.parts = [None] * len(summed.parts)

    def discard_older_than(self, iteration: int) -> None:
        for old in [k for k in self._sums if k < iteration]:
            self.release(self._sums.pop(old))

    def __len__(self) -> int:
        return len(self._sums)


def mix_into(flats: list[torch.Tensor], own_weight: float, summed: WeightedSum, regions: tuple[Region, ...]) -> None:
    """Per region, ``x <- (own_weight * x + sum) / (own_weight + sum's weight)``, in place; a region
    nothing arrived for keeps the model's values."""
    for region, part, weight in zip(regions, summed.parts, summed.weights):
        if part is None:
            continue
        total = own_weight + weight
        region.of(flats).mul_(own_weight / total).add_(part, alpha=1.0 / total)
