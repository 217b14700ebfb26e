"""hopnet.data.ElasticSampler: each sample once per epoch across the members, through any
sequence of view changes (joins, leaves, deaths counted by their last reported cursor).

The schedules are drawn by hypothesis: members consume at their own pace (some run an epoch
ahead), views change at random points, joiners take their state from a member, and members
resume from their own state_dict now and then. At the end the live members drain every epoch
up to the last, and each epoch's samples must have been consumed exactly once.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from hopnet.data import ElasticSampler, FixedEpochs, Split, batches_per_epoch

SEED = 7


@dataclass
class Member:
    """One member's sampler and what it consumed, each sample labelled with its epoch."""

    sampler: ElasticSampler
    last_epoch: int
    consumed: list[tuple[int, int]] = field(default_factory=list)
    _iterator: Iterator[int] | None = None

    def take(self, count: int) -> None:
        """Consume up to ``count`` samples, moving to the next epoch (up to ``last_epoch``) when
        the share of this one is done, as a trainer's endless batch stream does."""
        while count > 0:
            if self._iterator is None:
                self._iterator = iter(self.sampler)
            place = self.sampler.split.locate(self.sampler.rank, self.sampler.cursor)
            index = next(self._iterator, None)
            if index is None:
                self._iterator = None
                if self.sampler.epoch >= self.last_epoch:
                    return
                self.sampler.set_epoch(self.sampler.epoch + 1)
                continue
            assert place is not None and place[0] <= self.sampler.epoch
            self.consumed.append((place[0], index))
            count -= 1

    def drain(self) -> None:
        self.take(10**9)

    def resume_from_own_checkpoint(self, length: int) -> None:
        fresh = ElasticSampler(length, rank=self.sampler.rank, members=[0], seed=SEED)
        fresh.load_state_dict(self.sampler.state_dict())
        assert fresh.state_dict() == self.sampler.state_dict()
        self.sampler, self._iterator = fresh, None


class Choices:
    """Where a schedule's random choices come from: hypothesis (shrinkable) or a seeded generator."""

    def __init__(self, data: st.DataObject | None = None, rng: random.Random | None = None) -> None:
        self.data, self.rng = data, rng

    def integer(self, low: int, high: int) -> int:
        if self.data is not None:
            return self.data.draw(st.integers(low, high))
        assert self.rng is not None
        return self.rng.randint(low, high)

    def subset(self, items: list[int], most: int) -> list[int]:
        if self.data is not None:
            return self.data.draw(st.lists(st.sampled_from(items), unique=True, max_size=most)) if items else []
        assert self.rng is not None
        return self.rng.sample(items, self.rng.randint(0, most))

    def choice(self, items: list[int]) -> int:
        return items[self.integer(0, len(items) - 1)]


@dataclass(frozen=True)
class Schedule:
    length: int
    members: list[int]
    last_epoch: int
    changes: int


schedules = st.builds(Schedule, st.integers(0, 40), st.lists(st.integers(0, 9), min_size=1, max_size=5, unique=True),
                      st.integers(0, 3), st.integers(0, 6))


def _run(choices: Choices, schedule: Schedule,
         stale_deaths: bool = False) -> tuple[dict[int, Member], set[tuple[int, int]]]:
    """Play a schedule: consumption at random paces, view changes with random joins, leaves and
    deaths. Returns every member that ever lived, and what the dead members consumed past the
    cursor they last reported (with ``stale_deaths``; else every report is exact)."""
    length, last_epoch = schedule.length, schedule.last_epoch
    everyone = {r: Member(ElasticSampler(length, rank=r, members=schedule.members, seed=SEED), last_epoch)
                for r in schedule.members}
    live = sorted(schedule.members)
    unreported: set[tuple[int, int]] = set()
    next_rank = 10
    for view in range(1, schedule.changes + 1):
        for rank in live:
            everyone[rank].take(choices.integer(0, length + 3))
            if choices.integer(0, 1):
                everyone[rank].resume_from_own_checkpoint(length)
        gone = choices.subset(live, len(live) - 1)
        cursors = {r: everyone[r].sampler.cursor for r in live}
        for rank in gone:
            if stale_deaths and choices.integer(0, 1):
                reported = choices.integer(0, cursors[rank])
                taken = everyone[rank].consumed
                unreported |= set(taken[len(taken) - (cursors[rank] - reported):])
                cursors[rank] = reported
        joiners = list(range(next_rank, next_rank + choices.integer(0, 2)))
        next_rank += len(joiners)
        new_members = sorted([r for r in live if r not in gone] + joiners)
        donor = everyone[choices.choice(live)].sampler.state_dict()
        for rank in joiners:  # a joiner takes a member's state, then the view change
            sampler = ElasticSampler(length, rank=rank, members=[rank], seed=SEED)
            sampler.load_state_dict(donor)
            everyone[rank] = Member(sampler, last_epoch)
        for rank in new_members:
            everyone[rank].sampler.change_view(view, new_members, cursors)
        assert len({everyone[r].sampler.split for r in new_members}) == 1, "the members computed different splits"
        live = new_members
    for rank in live:
        everyone[rank].drain()
    return everyone, unreported


def _per_epoch(everyone: dict[int, Member]) -> dict[int, Counter[int]]:
    counts: dict[int, Counter[int]] = {}
    for member in everyone.values():
        for epoch, index in member.consumed:
            counts.setdefault(epoch, Counter())[index] += 1
    return counts


@settings(max_examples=300, deadline=None)
@given(schedule=schedules, data=st.data())
def test_every_sample_once_per_epoch_through_any_view_changes(schedule: Schedule, data: st.DataObject) -> None:
    everyone, _ = _run(Choices(data), schedule)
    counts = _per_epoch(everyone)
    for epoch in range(schedule.last_epoch + 1):
        assert counts.get(epoch, Counter()) == Counter(range(schedule.length)), f"epoch {epoch}"
    assert set(counts) <= set(range(schedule.last_epoch + 1))


@settings(max_examples=200, deadline=None)
@given(schedule=schedules, data=st.data())
def test_a_dead_members_samples_past_its_last_report_are_given_again_and_only_those(
        schedule: Schedule, data: st.DataObject) -> None:
    """At-least-once for what a member consumed after its last report, exactly once for the rest."""
    everyone, unreported = _run(Choices(data), schedule, stale_deaths=True)
    counts = _per_epoch(everyone)
    for epoch in range(schedule.last_epoch + 1):
        given_out = counts.get(epoch, Counter())
        assert set(given_out) == set(range(schedule.length)), f"epoch {epoch}: a sample was never given"
        assert {(epoch, i) for i, n in given_out.items() if n > 1} <= unreported


@settings(max_examples=50, deadline=None)
@given(schedule=schedules, seed=st.integers(0, 2**32))
def test_the_same_schedule_gives_the_same_samples(schedule: Schedule, seed: int) -> None:
    def play() -> dict[int, list[tuple[int, int]]]:
        everyone, _ = _run(Choices(rng=random.Random(seed)), schedule)
        return {rank: member.consumed for rank, member in everyone.items()}

    assert play() == play()


# ---------------------------------------------------------------------- one view: a plain sharded split
@pytest.mark.parametrize("length, n", [(12, 4), (13, 4), (3, 5), (0, 2), (1797, 3)])
@pytest.mark.parametrize("epoch", [0, 3])
def test_one_view_is_contiguous_shards_of_distributed_samplers_permutation(length: int, n: int, epoch: int) -> None:
    """Without a view change each member gets a contiguous slice of the epoch's permutation, the
    same permutation as DistributedSampler's (same seed, same epoch), in rank order; sizes differ
    by at most one: no sample padded in (DistributedSampler repeats some to even the shares)."""
    dataset = TensorDataset(torch.arange(length))
    shares = []
    for rank in range(n):
        sampler = ElasticSampler(dataset, rank=rank, members=range(n), seed=SEED)
        sampler.set_epoch(epoch)
        assert len(sampler) == len(list(ElasticSampler(dataset, rank=rank, members=range(n), seed=SEED)))
        shares.append(list(sampler))
        assert len(sampler) == 0  # consumed: an epoch's share is given once
    whole: DistributedSampler[int] = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    whole.set_epoch(epoch)
    assert [i for share in shares for i in share] == list(whole)
    assert max(map(len, shares)) - min(map(len, shares)) <= (1 if length % n else 0)
    theirs: DistributedSampler[int] = DistributedSampler(dataset, num_replicas=n, rank=0, seed=SEED)
    if length % n == 0:
        assert len(shares[0]) == len(theirs)
    else:
        assert sum(map(len, shares)) == length < len(theirs) * n


def test_moving_past_an_unfinished_epoch_skips_its_rest() -> None:
    sampler = ElasticSampler(12, rank=0, members=[0, 1], shuffle=False)
    iterator = iter(sampler)
    assert [next(iterator) for _ in range(2)] == [0, 1]
    sampler.set_epoch(1)
    assert sampler.cursor == 6 and len(sampler) == 6  # the rest of epoch 0 counts as consumed
    assert list(iterator) == [0, 1, 2, 3, 4, 5]
    sampler.set_epoch(1)  # the same epoch again: nothing changes
    assert sampler.cursor == 12


def test_without_shuffle_an_epoch_is_in_dataset_order() -> None:
    shares = [list(ElasticSampler(10, rank=r, members=[4, 9, 2], shuffle=False)) for r in (2, 4, 9)]
    assert shares == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_the_epochs_orders_differ_and_are_the_same_on_every_member() -> None:
    a, b = (ElasticSampler(50, rank=0, members=[0], seed=SEED) for _ in range(2))
    first = list(a)
    a.set_epoch(1)
    second = list(a)
    assert sorted(first) == sorted(second) == list(range(50)) and first != second
    assert list(b) == first


# ---------------------------------------------------------------------- in a trainer
def test_a_view_change_between_two_batches_takes_effect_at_the_next_one() -> None:
    """A DataLoader's iteration goes on through change_view: the rest of the epoch comes from the new share."""
    dataset = TensorDataset(torch.arange(20))
    samplers = {r: ElasticSampler(dataset, rank=r, members=[0, 1], seed=SEED) for r in (0, 1)}
    loader = DataLoader(dataset, batch_size=3, sampler=samplers[0])
    seen = []
    for i, (batch,) in enumerate(loader):
        seen += batch.tolist()
        if i == 1:  # rank 1 died having consumed 4 (its last report); rank 2 joins
            joiner = ElasticSampler(dataset, rank=2, members=[2], seed=SEED)
            joiner.load_state_dict(samplers[0].state_dict())
            cursors = {0: samplers[0].cursor, 1: 4}
            for sampler in (samplers[0], joiner):
                sampler.change_view(1, [0, 2], cursors)
    rank1 = list(ElasticSampler(dataset, rank=1, members=[0, 1], seed=SEED))[:4]
    assert sorted(seen + rank1 + list(joiner)) == list(range(20))
    assert len(samplers[0]) == 0


def test_batches_with_a_batch_sampler_count_what_they_hand_out() -> None:
    sampler = ElasticSampler(10, rank=0, members=[0], seed=SEED)
    batches = iter(BatchSampler(sampler, batch_size=4, drop_last=False))
    next(batches)
    assert sampler.cursor == 4 and len(sampler) == 6


# ---------------------------------------------------------------------- checkpoints
def test_a_state_dict_resumes_mid_epoch_where_it_was() -> None:
    sampler = ElasticSampler(30, rank=1, members=[0, 1, 2], seed=SEED)
    sampler.set_epoch(2)
    iterator = iter(sampler)
    first = [next(iterator) for _ in range(4)]
    assert sampler.cursor == 20 + 4  # set_epoch(2) skipped epochs 0 and 1: 10 samples each
    sampler.change_view(5, [1, 2, 3], {0: 23, 1: sampler.cursor, 2: 30})
    head = [next(iterator) for _ in range(2)]
    state = sampler.state_dict()
    resumed = ElasticSampler(30, rank=1, members=[0], seed=SEED)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.view, resumed.members, resumed.cursor) == (2, 5, (1, 2, 3), 2)
    assert resumed.state_dict() == state
    rest = list(resumed)
    assert rest == list(iterator)
    assert len(set(first + head + rest)) == len(first + head + rest)


def test_a_replacement_that_loads_its_donors_state_goes_on_at_the_donors_count() -> None:
    """A replacement in place (--max-restarts) or a resynced worker loads a neighbour's registered
    state: it takes the division and the donor's progress, the nearest it can know of its own."""
    donor = ElasticSampler(40, rank=0, members=range(4), seed=SEED)
    iterator = iter(donor)
    [next(iterator) for _ in range(6)]
    replacement = ElasticSampler(40, rank=2, members=range(4), seed=SEED)
    replacement.load_state_dict(donor.state_dict())
    own = list(ElasticSampler(40, rank=2, members=range(4), seed=SEED))
    assert replacement.cursor == 6 and list(replacement) == own[6:]


# ---------------------------------------------------------------------- bad input: one line each
def _one_line_error(call: Callable[..., object], *args: object) -> str:
    with pytest.raises(ValueError) as caught:
        call(*args)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_bad_input_is_refused_in_one_line() -> None:
    sampler = ElasticSampler(10, rank=0, members=[0, 1], seed=SEED)
    list(sampler)
    assert "rank(s) 3 more than once" in _one_line_error(lambda: ElasticSampler(10, rank=0, members=[3, 0, 3]))
    assert "at least one member" in _one_line_error(lambda: ElasticSampler(10, rank=0, members=[]))
    assert "ranks (integers >= 0)" in _one_line_error(lambda: ElasticSampler(10, rank=0, members=[0, -1]))
    assert "does not follow view 0" in _one_line_error(sampler.change_view, 0, [0, 1], {0: 5, 1: 0})
    assert "more than once" in _one_line_error(sampler.change_view, 1, [0, 1, 1], {0: 5, 1: 0})
    assert "missing rank(s) 1" in _one_line_error(sampler.change_view, 1, [0], {0: 5})
    assert "rank(s) 7 were not members" in _one_line_error(sampler.change_view, 1, [0], {0: 5, 1: 0, 7: 0})
    assert "rank 1's cursor must be an integer >= 0" in _one_line_error(sampler.change_view, 1, [0], {0: 5, 1: -2})
    assert "rank 0's cursor is 4, but it has consumed 5" in _one_line_error(sampler.change_view, 1, [0], {0: 4, 1: 0})
    sampler.set_epoch(2)
    assert "epochs go forward" in _one_line_error(sampler.set_epoch, 1)
    tiny = ElasticSampler(2, rank=0, members=[0, 1, 2], seed=SEED)  # rank 2's share is empty
    assert "rank 2's cursor 1 is past its share" in _one_line_error(tiny.change_view, 1, [0], {0: 0, 1: 0, 2: 1})
    other = ElasticSampler(11, rank=0, members=[0, 1], seed=SEED)
    assert "for 10 samples loaded into a sampler of 11" in _one_line_error(other.load_state_dict, sampler.state_dict())
    reseeded = ElasticSampler(10, rank=0, members=[0, 1], seed=SEED + 1)
    assert "seed 7" in _one_line_error(reseeded.load_state_dict, sampler.state_dict())
    assert "not an elastic sampler's state" in _one_line_error(other.load_state_dict, {"format": 1, "split": {}})
    assert "not an elastic sampler's state" in _one_line_error(other.load_state_dict, {})


def test_a_split_is_plain_values() -> None:
    split = Split.first(10, [2, 0]).changed(1, [0, 1, 2], {0: 3, 2: 7})
    assert Split.from_dict(split.to_dict()) == split


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 60), n=st.integers(1, 5), batch_size=st.integers(1, 17), epochs=st.integers(1, 3))
def test_endless_batches_are_full_and_cover_each_epoch_once_across_members(length: int, n: int, batch_size: int,
                                                                          epochs: int) -> None:
    samplers = [ElasticSampler(length, rank=r, members=range(n), seed=5) for r in range(n)]
    streams = [sampler.batches(batch_size) for sampler in samplers]
    taken: list[list[int]] = [[] for _ in range(n)]
    for rank, stream in enumerate(streams):
        share = len(samplers[rank])  # this member's share of one epoch
        while len(taken[rank]) < share * epochs:
            batch = next(stream)
            assert len(batch) == batch_size  # a batch spanning an epoch's end takes the next one's start
            taken[rank].extend(batch)
    shares = [len(ElasticSampler(length, rank=r, members=range(n), seed=5)) for r in range(n)]
    for epoch in range(epochs):
        seen = Counter(i for rank in range(n) for i in taken[rank][epoch * shares[rank]:(epoch + 1) * shares[rank]])
        assert seen == Counter(range(length)), f"epoch {epoch}"


def test_endless_batches_end_when_the_member_has_left_and_refuse_a_bad_size() -> None:
    sampler = ElasticSampler(10, rank=2, members=[0, 1, 2], seed=0)
    stream = sampler.batches(2)
    first = next(stream)
    sampler.change_view(1, [0, 1], {0: 0, 1: 0, 2: 2})
    assert len(first) == 2 and list(stream) == []
    with pytest.raises(ValueError, match=r"batches\(0\): the batch size must be an integer >= 1"):
        next(ElasticSampler(10, rank=0, members=[0]).batches(0))


def test_fixed_epochs_cut_the_stream_into_trainer_epochs_of_one_length() -> None:
    """A trainer's epoch is the same number of full batches on every member, whatever its share (and
    after a view change); the next epoch goes on in the sampler's stream; a joiner counts its donor's
    epochs, not one computed from the members it joined."""
    assert batches_per_epoch(100, 2, 8) == 6 and batches_per_epoch(3, 4, 8) == 1
    members = {rank: ElasticSampler(50, rank=rank, members=[0, 1], seed=SEED) for rank in (0, 1)}
    epochs = {rank: FixedEpochs(sampler, 4, batches_per_epoch(50, 2, 4)) for rank, sampler in members.items()}
    loaders = {rank: DataLoader(range(50), batch_size=4, sampler=epochs[rank]) for rank in (0, 1)}
    first = [int(i) for rank in (0, 1) for batch in loaders[rank] for i in batch]
    assert len(loaders[0]) == 6 and len(first) == len(set(first)) == 48  # 6 batches each, none twice
    reference = [i for b in itertools.islice(ElasticSampler(50, rank=0, members=[0, 1], seed=SEED).batches(4), 12)
                 for i in b]
    assert first[:24] == reference[:24]
    assert [i for b in loaders[0] for i in b.tolist()] == reference[24:]  # the next epoch goes on in the stream

    joiner = ElasticSampler(50, rank=2, members=[2], seed=SEED)
    joiner.load_state_dict(members[0].state_dict())
    cursors = {rank: sampler.cursor for rank, sampler in members.items()}
    for sampler in (*members.values(), joiner):
        sampler.change_view(1, [0, 1, 2], cursors)
    epochs[2] = FixedEpochs(joiner, 4, batches_per_epoch(50, 3, 4))
    epochs[2].load_state_dict(epochs[0].state_dict())
    assert epochs[2].batches_per_epoch == 6
    assert {rank: len(list(epochs[rank])) for rank in (0, 1, 2)} == {0: 24, 1: 24, 2: 24}
