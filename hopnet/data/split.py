"""Who consumes which samples of each epoch, through view changes: the arithmetic of
:class:`hopnet.data.ElasticSampler`, without torch.

An epoch's samples are positions ``0 .. length - 1`` in that epoch's order (the sampler maps a
position to a dataset index through the epoch's permutation). Every member of a view holds the
same :class:`Split` and so computes every member's share without talking.

A member's *stream* in a view is the queue it was given when the view began (the samples of
epochs that were already under way, pooled and re-divided), followed by its fresh share of
every later epoch: a contiguous slice of the epoch's order, slices in sorted-rank order,
sizes differing by at most one. A member's *cursor* counts the samples it has taken from its
stream since the view began, across epoch boundaries; one integer per member is all a view
change needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Segment = tuple[int, int, int]
"""``(epoch, start, stop)``: the positions ``start .. stop - 1`` of that epoch's order."""


def even_sizes(total: int, parts: int, first_extra: int = 0) -> list[int]:
    """``total`` cut into ``parts`` sizes differing by at most one; the larger ones go to the
    parts from index ``first_extra`` on (wrapping), so that successive cuts spread them."""
    base, extra = divmod(total, parts)
    return [base + (1 if (i - first_extra) % parts < extra else 0) for i in range(parts)]


def cut(ranges: Sequence[tuple[int, int]], sizes: Sequence[int]) -> list[list[tuple[int, int]]]:
    """The concatenation of ``ranges`` cut into consecutive pieces of ``sizes``."""
    pieces: list[list[tuple[int, int]]] = []
    pending = [r for r in ranges if r[1] > r[0]]
    index, offset = 0, 0  # the first range not yet fully given out, and how much of it is
    for size in sizes:
        piece: list[tuple[int, int]] = []
        while size > 0:
            start, stop = pending[index]
            take = min(size, stop - start - offset)
            piece.append((start + offset, start + offset + take))
            size -= take
            offset += take
            if start + offset == stop:
                index, offset = index + 1, 0
        pieces.append(piece)
    return pieces


def sorted_members(members: Iterable[int]) -> tuple[int, ...]:
    """``members`` as a view holds them, or ValueError for a list no view can have."""
    ranks = list(members)
    if not ranks:
        raise ValueError("a view needs at least one member")
    if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks):
        raise ValueError(f"members must be ranks (integers >= 0), got {ranks}")
    duplicates = sorted({r for r in ranks if ranks.count(r) > 1})
    if duplicates:
        raise ValueError(f"members list rank(s) {', '.join(map(str, duplicates))} more than once")
    return tuple(sorted(ranks))


@dataclass(frozen=True)
class Split:
    """One view's division of the samples: identical on every member of the view."""

    length: int
    """Samples in an epoch."""
    view: int
    members: tuple[int, ...]
    queues: tuple[tuple[Segment, ...], ...]
    """Aligned with ``members``: what each was given when the view began, oldest epoch first."""
    opened: int
    """The last epoch whose samples are all in ``queues`` (or were consumed before the view
    began); every later epoch is divided afresh among ``members``. -1: none yet."""
    _fresh: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False)
    _queue_of: dict[int, tuple[Segment, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = even_sizes(self.length, len(self.members))
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        object.__setattr__(self, "_fresh", {r: (starts[i], starts[i] + sizes[i]) for i, r in enumerate(self.members)})
        object.__setattr__(self, "_queue_of", dict(zip(self.members, self.queues)))

    @classmethod
    def first(cls, length: int, members: Iterable[int], view: int = 0) -> Split:
        """The division at the start of training: every epoch, fresh, among ``members``."""
        if length < 0:
            raise ValueError(f"a dataset cannot have {length} samples")
        ranks = sorted_members(members)
        return cls(length, view, ranks, tuple(() for _ in ranks), -1)

    # ------------------------------------------------------------------ one member's stream
    def queue_length(self, rank: int) -> int:
        return sum(stop - start for _, start, stop in self._queue(rank))

    def fresh_share(self, rank: int) -> tuple[int, int]:
        """``(start, stop)``: ``rank``'s slice of every epoch after :attr:`opened`."""
        return self._fresh[rank]

    def locate(self, rank: int, cursor: int) -> tuple[int, int] | None:
        """``(epoch, position)`` of the sample at ``cursor`` in ``rank``'s stream; ``None``
        when the stream ends before it (a member whose fresh share is empty)."""
        run = self.locate_run(rank, cursor)
        return None if run is None else (run[0], run[1])

    def locate_run(self, rank: int, cursor: int) -> tuple[int, int, int] | None:
        """:meth:`locate`, with how many samples from there on lie at consecutive positions of the
        same epoch's order: ``(epoch, position, count)``."""
        for epoch, start, stop in self._queue(rank):
            if cursor < stop - start:
                return epoch, start + cursor, stop - start - cursor
            cursor -= stop - start
        start, stop = self.fresh_share(rank)
        if stop == start:
            return None
        epochs, offset = divmod(cursor, stop - start)
        return self.opened + 1 + epochs, start + offset, stop - start - offset

    def remaining(self, rank: int, cursor: int, through_epoch: int) -> int:
        """How many samples of epochs up to ``through_epoch`` ``rank``'s stream holds from ``cursor`` on."""
        return sum(stop - start for _, start, stop in self.unconsumed(rank, cursor, through_epoch))

    def unconsumed(self, rank: int, cursor: int, through_epoch: int) -> list[Segment]:
        """The segments of ``rank``'s stream from ``cursor`` on, cut off after ``through_epoch``."""
        left: list[Segment] = []
        for epoch, first, last in self._queue(rank):
            taken = min(cursor, last - first)
            cursor -= taken
            if first + taken < last and epoch <= through_epoch:
                left.append((epoch, first + taken, last))
        start, stop = self.fresh_share(rank)
        first_fresh = self.opened + 1
        if stop > start:  # whole fresh epochs consumed: skipped by arithmetic, a long run has many
            done = min(cursor // (stop - start), max(0, through_epoch - first_fresh + 1))
            first_fresh, cursor = first_fresh + done, cursor - done * (stop - start)
        for epoch in range(first_fresh, through_epoch + 1):
            taken = min(cursor, stop - start)
            cursor -= taken
            if start + taken < stop:
                left.append((epoch, start + taken, stop))
        return left

    def check_cursor(self, rank: int, cursor: int) -> None:
        if not isinstance(cursor, int) or isinstance(cursor, bool) or cursor < 0:
            raise ValueError(f"rank {rank}'s cursor must be an integer >= 0, got {cursor!r}")
        if cursor > self.queue_length(rank) and self.locate(rank, cursor - 1) is None:
            raise ValueError(f"rank {rank}'s cursor {cursor} is past its share "
                             f"({self.queue_length(rank)} samples in view {self.view})")

    # ------------------------------------------------------------------ a view change
    def changed(self, view: int, members: Iterable[int], cursors: Mapping[int, int]) -> Split:
        """The next view's division: every sample the old members had not consumed (each
        member's stream past its cursor) is pooled, epoch by epoch, and re-divided among
        ``members``. ``cursors``: every old member's, a dead one's as last reported."""
        ranks = sorted_members(members)
        if not isinstance(view, int) or view <= self.view:
            raise ValueError(f"view {view!r} does not follow view {self.view}")
        missing = [r for r in self.members if r not in cursors]
        unknown = sorted(r for r in cursors if r not in self.members)
        if missing or unknown:
            raise ValueError(f"view {view}: cursors are needed for exactly the members of view {self.view} "
                             f"({', '.join(map(str, self.members))}); "
                             + (f"missing rank(s) {', '.join(map(str, missing))}" if missing else
                                f"rank(s) {', '.join(map(str, unknown))} were not members"))
        for rank in self.members:
            self.check_cursor(rank, cursors[rank])
        last = self.opened
        for rank in self.members:
            consumed = self.locate(rank, cursors[rank] - 1) if cursors[rank] else None
            if consumed is not None:
                last = max(last, consumed[0])
        pools: dict[int, list[tuple[int, int]]] = {}
        for rank in self.members:
            for epoch, start, stop in self.unconsumed(rank, cursors[rank], last):
                pools.setdefault(epoch, []).append((start, stop))
        queues: list[list[Segment]] = [[] for _ in ranks]
        first_extra = 0
        for epoch in sorted(pools):
            total = sum(stop - start for start, stop in pools[epoch])
            sizes = even_sizes(total, len(ranks), first_extra)
            first_extra = (first_extra + total % len(ranks)) % len(ranks)
            for queue, piece in zip(queues, cut(pools[epoch], sizes)):
                queue.extend((epoch, start, stop) for start, stop in piece)
        return Split(self.length, view, ranks, tuple(tuple(q) for q in queues), last)

    def _queue(self, rank: int) -> tuple[Segment, ...]:
        return self._queue_of[rank]

    # ------------------------------------------------------------------ plain values
    def to_dict(self) -> dict[str, Any]:
        return {"length": self.length, "view": self.view, "members": list(self.members),
                "queues": [[list(s) for s in q] for q in self.queues], "opened": self.opened}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> Split:
        try:
            members = tuple(int(r) for r in state["members"])
            queues = tuple(tuple((int(e), int(a), int(b)) for e, a, b in q) for q in state["queues"])
            if len(queues) != len(members):
                raise ValueError("its queues do not match its members")
            split = cls(int(state["length"]), int(state["view"]), members, queues, int(state["opened"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not an elastic sampler's state: {type(exc).__name__}: {exc}") from None
        if sorted_members(split.members) != split.members:
            raise ValueError("not an elastic sampler's state: its members are not sorted")
        return split


__all__ = ["Segment", "Split", "cut", "even_sizes", "sorted_members"]
