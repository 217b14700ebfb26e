"""The lanes of one replica agreeing in one process: an in-process stand-in for their gloo groups
(:class:`hopnet.replica.agreement.LaneAgreement`)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence


class Meeting:
    """One agreement group of one replica: the ``i``-th call of every lane meets the others' ``i``-th."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls: list[int] = [0] * size
        self.rounds: dict[int, tuple[list[list[int]], asyncio.Future[list[int]]]] = {}

    async def least_each(self, member: int, values: Sequence[int]) -> list[int]:
        index = self.calls[member]
        self.calls[member] += 1
        if index not in self.rounds:
            self.rounds[index] = ([], asyncio.get_running_loop().create_future())
        offered, done = self.rounds[index]
        offered.append(list(values))
        if len(offered) == self.size:
            assert len({len(v) for v in offered}) == 1, f"agreement {index}: the lanes asked apart: {offered}"
            done.set_result([min(column) for column in zip(*offered)])
        await asyncio.sleep(2e-4)  # an all-reduce among the lanes is not free
        return await asyncio.shield(done)


class InprocLanes:
    """:class:`hopnet.runtime.services.ReplicaLanes` over :class:`Meeting` s."""

    def __init__(self, meeting: Meeting, member: int, side: InprocLanes | None = None) -> None:
        self.meeting, self.member, self.side = meeting, member, side

    async def least_each(self, values: Sequence[int]) -> list[int]:
        return await self.meeting.least_each(self.member, values)

    async def least(self, value: int) -> int:
        return (await self.least_each([value]))[0]

    async def common(self, have: Collection[int], need: int, candidates: int | None = None
                     ) -> tuple[frozenset[int], bool]:
        raise AssertionError("these lanes agree on counts, not subsets")
