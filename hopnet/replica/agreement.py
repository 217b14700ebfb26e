"""The lanes of a replica choose alike: :class:`LaneAgreement`.

A protocol that chooses by what has reached it (Hop's backup workers: mix the updates that came)
would let the lanes of one replica choose differently, each by its own arrivals. Before such a
choice every lane offers what it has; the choice is made from what they all have (the
intersection), and only once that meets what every lane needs. One all-reduce (MIN) of a small
integer vector over the replica does both: a 0/1 entry per candidate (MIN is AND) and the
negated need (MIN is the largest need). It runs on a gloo group of its own, apart from the
trainer's DDP or FSDP traffic, in a thread, so the lane's event loop goes on receiving while
the members meet. A member that dies ends the wait with an error; its replica fails as a unit.

Every lane makes its agreements on one group in the same order. A protocol with two streams of
choices whose order differs from lane to lane (eager-SGD: its round engine starts rounds while
the trainer's calls choose results) makes one stream's on :attr:`LaneAgreement.side`, a second
group, so neither waits for the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from typing import Any

import torch


class LaneAgreement:
    """Agreement among the ``size`` lanes of one replica on subsets of ``0 .. candidates - 1``."""

    def __init__(self, group: Any, candidates: int, side: LaneAgreement | None = None) -> None:
        self.group = group
        self.candidates = candidates
        self.side = side
        """An agreement on a group of its own, for choices made in an order independent of this one's."""
        self.rounds = 0
        """How many agreements this lane took part in (each one all-reduce)."""
        self.models_mixed = False
        """The lane changed its slice of the model since the replica's last step (:meth:`mixed_models`)."""

    def mixed_models(self) -> None:
        self.models_mixed = True

    def _all_reduce_min(self, vector: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # (torch's stubs name the enum apart)
        self.group.allreduce([vector], opts).wait()
        return vector

    async def common(self, have: Collection[int], need: int, candidates: int | None = None
                     ) -> tuple[frozenset[int], bool]:
        """Every lane's ``have`` intersected, and whether it holds every lane's ``need``. ``candidates``:
        how many there are (``have`` is a subset of ``0 .. candidates - 1``), when not the replicas."""
        vector = torch.zeros((self.candidates if candidates is None else candidates) + 1, dtype=torch.int64)
        for j in have:
            vector[j] = 1
        vector[-1] = -need
        self.rounds += 1
        reduced = await asyncio.to_thread(self._all_reduce_min, vector)
        common = frozenset(int(j) for j in torch.nonzero(reduced[:-1]).flatten().tolist())
        return common, len(common) >= -int(reduced[-1])

    async def least(self, value: int) -> int:
        """The smallest of every lane's ``value`` (how far a replica skips: as far as its most cautious lane)."""
        (least,) = await self.least_each([value])
        return least

    async def least_each(self, values: Sequence[int]) -> list[int]:
        """The smallest of every lane's ``values[i]``, for each ``i`` (every lane gives as many)."""
        self.rounds += 1
        reduced = await asyncio.to_thread(self._all_reduce_min, torch.tensor(list(values), dtype=torch.int64))
        return [int(v) for v in reduced.tolist()]


__all__ = ["LaneAgreement"]
