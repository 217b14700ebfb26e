"""A torch ``Sampler`` that gives each sample once per epoch across the live members of a run,
through every change of membership (docs/guides/data.md).

Every member builds one with the same dataset length, seed and members; each epoch's order is
the same permutation on all of them (``torch.randperm`` seeded with ``seed + epoch``, as torch's
``DistributedSampler``), divided among the members in contiguous slices in sorted-rank order,
sizes differing by at most one: no sample is padded in or dropped. At a view change,
:meth:`ElasticSampler.change_view` pools what the old members had not consumed and divides it
among the new ones; every member computes the same division from the same arguments.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from hopnet.data.split import Split

STATE_FORMAT = 1


class ElasticSampler(Sampler[int]):
    """This member's dataset indices, epoch after epoch, through view changes.

    ``dataset``: the dataset (or its length). ``rank``: this member's. ``members``: the ranks of
    the view it starts in (numbered ``view``). ``seed``: the same on every member. ``shuffle``:
    ``False`` keeps each epoch in dataset order.

    Iterating yields what this member has not consumed yet of its share of epoch :attr:`epoch`
    (set it with :meth:`set_epoch` at the start of each epoch, as with ``DistributedSampler``),
    after any rest of an earlier epoch that a view change gave it; a sample counts as consumed
    once it is handed out. The iterator reads the sampler as it goes, so a
    :meth:`change_view` between two samples takes effect at the next one.
    """

    def __init__(self, dataset: Sized | int, *, rank: int, members: Iterable[int], view: int = 0,
                 seed: int = 0, shuffle: bool = True) -> None:
        length = dataset if isinstance(dataset, int) else len(dataset)
        self._split = Split.first(length, members, view)
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._cursor = 0
        self._orders: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ what a member reads
    @property
    def epoch(self) -> int:
        """The epoch this member is in (:meth:`set_epoch`): iteration goes no further."""
        return self._epoch

    @property
    def view(self) -> int:
        return self._split.view

    @property
    def members(self) -> tuple[int, ...]:
        return self._split.members

    @property
    def cursor(self) -> int:
        """Samples this member has consumed since the current view began, across epochs: what
        it reports for the next view change."""
        return self._cursor

    @property
    def split(self) -> Split:
        """The current view's division of the samples (the same on every member)."""
        return self._split

    def __len__(self) -> int:
        """How many samples iterating now yields: this member's share of the epochs up to
        :attr:`epoch` not consumed yet (all of it at the start of an epoch or of a view)."""
        if self.rank not in self._split.members:
            return 0
        return self._split.remaining(self.rank, self._cursor, self._epoch)

    def __iter__(self) -> Iterator[int]:
        while True:
            if self.rank not in self._split.members:
                return
            place = self._split.locate(self.rank, self._cursor)
            if place is None or place[0] > self._epoch:
                return
            self._cursor += 1
            yield self._order(place[0])[place[1]]

    def batches(self, batch_size: int) -> Iterator[list[int]]:
        """Full batches of this member's indices, without end: its share of epoch :attr:`epoch`,
        then (moving to the next epoch itself) of the next. A batch that spans the end of an
        epoch takes the start of the next one, so every batch has ``batch_size`` indices, as a
        trainer that counts iterations rather than epochs wants. It ends only when this member
        is no longer among the members, or a whole epoch gives it nothing. Each batch is read
        when it is asked for, a run of consecutive positions at a time."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batches({batch_size!r}): the batch size must be an integer >= 1")
        fresh = False  # the first pass may find the current epoch's share already consumed
        passing, given = False, 0  # in a pass over the current epoch; what it gave so far
        while True:
            batch: list[int] = []
            ended = False
            while len(batch) < batch_size and not ended:
                if not passing:
                    if self.rank not in self._split.members:
                        ended = True
                        break
                    passing, given = True, 0
                if taken := self._take(batch_size - len(batch)):
                    batch += taken
                    given += len(taken)
                    continue
                passing = False  # the pass is over: the epoch's share is consumed, or the member left
                if given == 0 and fresh:
                    ended = True
                else:
                    self.set_epoch(self._epoch + 1)
                    fresh = True
            if batch:
                yield batch
            if ended:
                return

    def _take(self, limit: int) -> list[int]:
        """Up to ``limit`` of what iterating yields next (of epochs up to :attr:`epoch`), consumed."""
        taken: list[int] = []
        while len(taken) < limit and self.rank in self._split.members:
            run = self._split.locate_run(self.rank, self._cursor)
            if run is None or run[0] > self._epoch:
                break
            epoch, position, count = run
            count = min(count, limit - len(taken))
            taken += self._order(epoch)[position:position + count]
            self._cursor += count
        return taken

    # ------------------------------------------------------------------ what a member does
    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` next, as with ``DistributedSampler``. Epochs go forward: setting
        the current one again changes nothing (a loop resumed from a checkpoint may start with
        it); moving past epochs whose share is not done skips their rest, which then counts as
        consumed (a loop that finishes each epoch before the next loses nothing)."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < self._epoch:
            raise ValueError(f"set_epoch({epoch!r}): epochs go forward (this sampler is at epoch {self._epoch})")
        if epoch > self._epoch and self.rank in self._split.members:
            self._cursor += self._split.remaining(self.rank, self._cursor, epoch - 1)
        self._epoch = epoch

    def change_view(self, view: int, members: Iterable[int], cursors: Mapping[int, int]) -> None:
        """Enter view ``view`` of ``members``: the samples the old view's members had not consumed
        (each one's :attr:`cursor` in ``cursors``; a member that died counts by its last
        reported cursor) are re-divided among ``members``, and this member's cursor starts at 0
        in its new share. Call it on every member of the new view with the same arguments."""
        own = cursors.get(self.rank)
        if self.rank in self._split.members and own is not None and own != self._cursor:
            raise ValueError(f"view {view}: rank {self.rank}'s cursor is {own}, but it has consumed "
                             f"{self._cursor} samples in view {self.view}")
        self._split = self._split.changed(view, members, cursors)
        self._cursor = 0

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "rank": self.rank, "seed": self.seed, "shuffle": self.shuffle,
                "epoch": self._epoch, "cursor": self._cursor, "split": self._split.to_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from ``state``: this member's own (a checkpoint), exactly where it was. A state
        saved by another member (a replacement, or a worker resynced from a neighbour, takes its
        donor's) brings the division and the donor's progress: its cursor and epoch, the nearest
        this member can know of its own."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not an elastic sampler's state (format {state.get('format')!r})")
        split = Split.from_dict(state["split"])
        if split.length != self._split.length:
            raise ValueError(f"a state for {split.length} samples loaded into a sampler of {self._split.length}")
        if (state["seed"], state["shuffle"]) != (self.seed, self.shuffle):
            raise ValueError(f"a state for seed {state['seed']}, shuffle {state['shuffle']} loaded into a sampler "
                             f"of seed {self.seed}, shuffle {self.shuffle}")
        cursor = int(state["cursor"])
        if self.rank in split.members and int(state["rank"]) != self.rank:
            cursor = self._nearest_cursor(split, cursor)
        if self.rank in split.members:
            split.check_cursor(self.rank, cursor)
        self._split, self._cursor, self._epoch = split, cursor, int(state["epoch"])

    def _nearest_cursor(self, split: Split, cursor: int) -> int:
        """The donor's cursor, within this member's stream (whose fresh share may be empty)."""
        if cursor > split.queue_length(self.rank) and split.locate(self.rank, cursor - 1) is None:
            return split.queue_length(self.rank)
        return cursor

    # ------------------------------------------------------------------ the epochs' orders
    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            length = self._split.length
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(length, generator=generator).tolist()
            else:
                order = list(range(length))
            if len(self._orders) >= 2:  # a share may hold the end of one epoch and the start of the next
                del self._orders[min(self._orders)]
            self._orders[epoch] = order
        return order


__all__ = ["ElasticSampler"]
