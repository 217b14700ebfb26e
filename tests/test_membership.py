"""Membership views (hopnet/membership): each path on its own, then N members on a deterministic
in-memory network with random delivery order, loss, duplication, crashes and partitions.

Safety: no two different views are ever committed with the same number, and each committed
view was accepted by a majority of its predecessor. Liveness: with a majority connected and
no further failures a pending change is committed. Partitions: in 3+1 the 3 go on without
the 1, which stops with one line; in 2+2 nobody commits and all four stop."""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hopnet.membership import (
    NO_VIEW, Accept, Accepted, Ballot, Beat, Change, Commit, JoinRequest, Membership,
    MembershipConfig, Message, Prepare, Promise, Requests, Send, View, accepts, view_relation,
)
from hopnet.membership.changes import next_change
from hopnet.membership.paxos import Acceptor, Round

CONFIG = MembershipConfig(peer_timeout=1.0)
STEP = 0.05


class Cluster:
    """Members on an in-memory network: each step delivers the messages in flight in a random
    order, holding some back, losing and duplicating others, then ticks every live member."""

    def __init__(self, n: int, *, seed: int = 0, config: MembershipConfig = CONFIG, loss: float = 0.0,
                 dup: float = 0.0, hold: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.config = config
        self.loss, self.dup, self.hold = loss, dup, hold
        self.now = 0.0
        self.first = View(0, tuple(range(n)))
        self.machines = {rank: Membership(rank, self.first, config, self.now) for rank in range(n)}
        self.in_flight: list[tuple[int, int, Message]] = []
        self.sent: list[tuple[int, int, Message]] = []
        self.crashed: set[int] = set()
        self.sides: list[set[int]] | None = None

    def join(self, rank: int, contacts: Iterable[int] | None = None) -> None:
        members = sorted(self.machines) if contacts is None else list(contacts)
        self.machines[rank] = Membership(rank, None, self.config, self.now, contacts=members)

    def post(self, sender: int, sends: list[Send]) -> None:
        for send in sends:
            self.sent.append((sender, send.to, send.message))
            self.in_flight.append((sender, send.to, send.message))

    def crash(self, rank: int) -> None:
        self.crashed.add(rank)

    def partition(self, *sides: Iterable[int]) -> None:
        self.sides = [set(side) for side in sides]

    def heal(self) -> None:
        self.sides = None

    def calm(self) -> None:
        self.loss = self.dup = self.hold = 0.0

    def _connected(self, a: int, b: int) -> bool:
        return self.sides is None or any(a in side and b in side for side in self.sides)

    def step(self) -> None:
        self.now = round(self.now + STEP, 6)
        flight, self.in_flight = self.in_flight, []
        self.rng.shuffle(flight)
        for sender, to, message in flight:
            if to in self.crashed or to not in self.machines or not self._connected(sender, to):
                continue
            if self.rng.random() < self.hold:
                self.in_flight.append((sender, to, message))
                continue
            if self.rng.random() < self.loss:
                continue
            if self.rng.random() < self.dup:
                self.in_flight.append((sender, to, message))
            self.post(to, self.machines[to].on_message(sender, message, self.now))
        for rank in sorted(self.machines):
            if rank not in self.crashed:
                self.post(rank, self.machines[rank].tick(self.now))

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds / STEP)):
            self.step()

    def live(self) -> dict[int, Membership]:
        return {r: m for r, m in self.machines.items() if r not in self.crashed and m.state == "member"}

    def commits(self) -> list[Commit]:
        """Every commit any member ever installed or sent."""
        found = [c for m in self.machines.values() for c in m.history]
        return found + [msg for _, _, msg in self.sent if isinstance(msg, Commit)]

    def check_safety(self) -> None:
        decided: dict[int, Change] = {}
        for commit in self.commits():
            number = commit.change.view.number
            assert commit.view == number - 1
            assert decided.setdefault(number, commit.change) == commit.change, (
                f"two views numbered {number}: {decided[number].describe()} and {commit.change.describe()}")
        accepted = {(rank, vote.view, vote.ballot, vote.change)
                    for rank, m in self.machines.items() for vote in m.votes}
        assert {(s, msg) for s, _, msg in self.sent if isinstance(msg, Accepted)} <= {
            (rank, vote) for rank, m in self.machines.items() for vote in m.votes}
        views = {0: self.first, **{n: change.view for n, change in decided.items()}}
        for commit in self.commits():
            before = views[commit.view]  # a committed view's predecessor was committed too
            assert set(commit.accepted_by) <= set(before.members)
            assert before.is_majority(commit.accepted_by), (commit, before)
            for voter in commit.accepted_by:
                assert (voter, commit.view, commit.ballot, commit.change) in accepted


def _all_agree(cluster: Cluster) -> View:
    views = {m.view for m in cluster.live().values()}
    assert len(views) == 1, views
    view = views.pop()
    assert view is not None
    return view


# views, the tag rule, the changes -----------------------------------------------------------


def test_a_view_is_numbered_and_holds_sorted_distinct_ranks() -> None:
    view = View(3, (0, 2, 5))
    assert view.majority == 2 and 2 in view and 1 not in view
    assert view.is_majority([0, 5, 9]) and not view.is_majority([0, 9])
    for bad in [(-1, (0,)), (0, (2, 1)), (0, (1, 1)), (0, (-1,))]:
        with pytest.raises(ValueError):
            View(*bad)


def test_a_message_of_an_older_view_is_refused_and_a_newer_one_held() -> None:
    current = View(4, (0, 1, 2))
    assert not accepts(3, current) and accepts(4, current) and accepts(5, current)
    assert [view_relation(n, current) for n in (3, 4, 5)] == ["old", "current", "new"]


def test_changes_arriving_together_make_one_view() -> None:
    view = View(2, (0, 1, 2, 3))
    change = next_change(view, [Requests(joins=(5,)), Requests(joins=(4,), leaves=(2,), deaths=(3, 2))],
                         max_members=None, proposer=0)
    assert change == Change(View(3, (0, 1, 4, 5)), joined=(4, 5), left=(2,), died=(3,))
    assert change.describe() == "view 3 (0, 1, 4, 5): ranks 4, 5 joined, rank 2 left, rank 3 died"


def test_nothing_to_change_makes_no_view() -> None:
    view = View(2, (0, 1, 2))
    # a join of a member waits for a view without it; deaths and leaves of non-members are moot;
    # the proposer does not count itself dead
    assert next_change(view, [Requests(joins=(1,), leaves=(7,), deaths=(0, 8))], max_members=None, proposer=0) is None


def test_joins_beyond_the_maximum_are_refused_in_rank_order() -> None:
    view = View(0, (0, 1, 2))
    change = next_change(view, [Requests(joins=(9, 4, 6), leaves=(1,))], max_members=4, proposer=0)
    assert change is not None and change.joined == (4, 6) and change.refused == (9,)
    assert change.view.members == (0, 2, 4, 6)


# the consensus' parts -----------------------------------------------------------------------


def test_an_acceptor_keeps_its_promise() -> None:
    acceptor = Acceptor()
    value = Change(View(1, (0, 1)), died=(2,))
    assert acceptor.prepare(Ballot(2, 1))
    assert not acceptor.prepare(Ballot(1, 5)) and not acceptor.accept(Ballot(2, 0), value)
    assert acceptor.prepare(Ballot(2, 1))  # a repeated prepare is promised again
    assert acceptor.accept(Ballot(2, 1), value) and acceptor.accepted == value


def test_a_round_proposes_again_the_value_accepted_under_the_highest_ballot() -> None:
    voters = View(0, (0, 1, 2, 3, 4))
    mine = Round(Ballot(5, 0), voters, 0.0)
    low, high = Change(View(1, (0, 1, 2, 3)), died=(4,)), Change(View(1, (0, 1, 2, 4)), left=(3,))
    nothing = Requests()
    assert not mine.promised(1, Promise(0, Ballot(5, 0), Ballot(1, 1), low, nothing))
    assert not mine.promised(9, Promise(0, Ballot(5, 0), None, None, nothing))  # not a voter
    assert not mine.promised(2, Promise(0, Ballot(4, 2), None, None, nothing))  # another ballot
    assert not mine.promised(2, Promise(0, Ballot(5, 0), Ballot(3, 2), high, nothing))
    assert mine.promised(3, Promise(0, Ballot(5, 0), None, None, nothing))
    assert mine.value_already_accepted() == high
    mine.propose(high)
    assert not mine.acceptance(0, Ballot(5, 0), high) and not mine.acceptance(1, Ballot(5, 0), low)
    assert not mine.acceptance(1, Ballot(5, 0), high)
    assert mine.acceptance(2, Ballot(5, 0), high) and mine.phase == "decided"
    assert not mine.acceptance(3, Ballot(5, 0), high)  # decided once


# one member's paths, on a network that loses nothing ----------------------------------------


def test_a_joiner_is_admitted_by_the_next_view_and_live_ranks_keep_theirs() -> None:
    cluster = Cluster(3)
    cluster.join(3, contacts=[2])
    cluster.run(2.0)
    assert _all_agree(cluster) == View(1, (0, 1, 2, 3))
    assert cluster.machines[3].history[0].change.joined == (3,)
    cluster.check_safety()


def test_joins_arriving_together_go_into_one_view() -> None:
    cluster = Cluster(4)
    cluster.join(4)
    cluster.join(5)
    cluster.post(1, cluster.machines[1].leave(cluster.now))
    cluster.run(2.0)
    assert _all_agree(cluster) == View(1, (0, 2, 3, 4, 5))
    assert cluster.machines[1].state == "left"
    assert cluster.machines[1].line == "rank 1 left: view 1 goes on without it"
    cluster.check_safety()


def test_a_member_taken_for_dead_is_left_out() -> None:
    cluster = Cluster(4)
    cluster.crash(3)
    cluster.run(3.0)
    assert _all_agree(cluster) == View(1, (0, 1, 2))
    assert cluster.machines[0].history[-1].change.died == (3,)


def test_the_runtime_s_suspicion_removes_a_member_before_its_silence_does() -> None:
    cluster = Cluster(3)
    cluster.crash(2)
    for rank in (0, 1):
        cluster.post(rank, cluster.machines[rank].suspect(2, cluster.now))
    cluster.run(0.5)  # well before peer_timeout
    assert _all_agree(cluster) == View(1, (0, 1))


def test_a_member_the_others_took_for_dead_stops_when_it_learns() -> None:
    cluster = Cluster(4)
    for rank in (0, 1, 2):
        cluster.post(rank, cluster.machines[rank].suspect(3, cluster.now))
    cluster.partition({0, 1, 2}, {3})
    cluster.run(0.6)
    assert {cluster.machines[r].view for r in (0, 1, 2)} == {View(1, (0, 1, 2))}
    assert cluster.machines[3].state == "member"  # not yet cut off for long
    cluster.heal()
    cluster.run(0.4)
    assert cluster.machines[3].state == "stopped"
    assert cluster.machines[3].line == ("rank 3 is not in view 1: ranks 0, 1, 2 went on without it "
                                        "(taken for dead): it stops")


def test_a_join_beyond_the_maximum_is_refused_in_one_line() -> None:
    cluster = Cluster(3, config=MembershipConfig(peer_timeout=1.0, max_members=4))
    cluster.join(3)
    cluster.join(4)
    cluster.run(2.0)
    assert _all_agree(cluster) == View(1, (0, 1, 2, 3))
    refused = cluster.machines[4]
    assert refused.state == "stopped"
    assert refused.line == "the join of rank 4 was refused: view 1 has 4 members, the most allowed (4)"
    # asking again gets the same answer
    cluster.machines[4] = Membership(4, None, cluster.config, cluster.now, contacts=[1])
    cluster.run(1.0)
    assert cluster.machines[4].line == refused.line


def test_below_the_minimum_the_run_stops_naming_who_left_and_who_died() -> None:
    cluster = Cluster(4, config=MembershipConfig(peer_timeout=1.0, min_members=3))
    cluster.post(1, cluster.machines[1].leave(cluster.now))
    cluster.run(1.0)
    assert _all_agree(cluster) == View(1, (0, 2, 3))
    cluster.crash(3)
    cluster.run(3.0)
    for rank in (0, 2):
        machine = cluster.machines[rank]
        assert machine.state == "stopped" and machine.view == View(2, (0, 2))
        assert machine.line == ("view 2 has 2 members, fewer than the minimum 3 "
                                "(rank 1 left, rank 3 died): the run stops")


def test_an_old_view_s_message_is_answered_with_the_commits_it_missed() -> None:
    cluster = Cluster(3)
    cluster.join(3)
    cluster.run(1.5)
    cluster.join(4)
    cluster.run(1.5)
    ahead = cluster.machines[0]
    assert ahead.view is not None and ahead.view.number == 2
    answer = ahead.on_message(1, Prepare(0, Ballot(9, 1)), cluster.now)
    assert [s.message for s in answer] == [ahead.committed(1), ahead.committed(2)]
    assert ahead.on_message(1, answer[0].message, cluster.now) == []  # a commit is never answered
    behind = Membership(1, cluster.first, CONFIG, cluster.now)
    for send in answer:
        behind.on_message(0, send.message, cluster.now)
    assert behind.view == ahead.view


def test_commits_received_out_of_order_are_installed_in_order() -> None:
    cluster = Cluster(3)
    cluster.join(3)
    cluster.run(1.5)
    cluster.join(4)
    cluster.run(1.5)
    first, second = cluster.machines[0].committed(1), cluster.machines[0].committed(2)
    assert first is not None and second is not None
    behind = Membership(1, cluster.first, CONFIG, cluster.now)
    behind.on_message(0, second, cluster.now)
    assert behind.view == cluster.first
    behind.on_message(0, first, cluster.now)
    assert behind.view == second.change.view and behind.history == [first, second]


def test_the_next_member_finishes_what_a_dead_proposer_started() -> None:
    """Rank 0 got rank 1 to accept a view admitting rank 7, then died: rank 1 proposes with a
    higher ballot and must commit the value already accepted, not one of its own."""
    cluster = Cluster(4)
    started = Change(View(1, (0, 1, 2, 3, 7)), joined=(7,))
    accepted = cluster.machines[1].on_message(0, Accept(0, Ballot(1, 0), started), 0.0)
    assert [s.message for s in accepted] == [Accepted(0, Ballot(1, 0), started)]
    cluster.crash(0)
    cluster.run(3.0)
    commit = cluster.machines[2].committed(1)
    assert commit is not None and commit.change == started and commit.ballot > Ballot(1, 0)
    assert 0 not in _all_agree(cluster)
    cluster.check_safety()


def test_a_joiner_sends_join_requests_until_admitted() -> None:
    joiner = Membership(7, None, CONFIG, 0.0, contacts=[0, 1])
    assert joiner.tick(0.0) == [Send(0, JoinRequest(NO_VIEW, 7)), Send(1, JoinRequest(NO_VIEW, 7))]
    assert joiner.tick(0.1) == []
    assert len(joiner.tick(0.3)) == 2
    assert joiner.on_message(0, Beat(4), 0.3) == [] and joiner.state == "joining"
    early = Membership(7, None, CONFIG, 0.0)  # started before any member registered: nobody to ask yet
    assert early.tick(0.0) == []
    early.set_contacts([0])
    assert early.tick(0.3) == [Send(0, JoinRequest(NO_VIEW, 7))]


def test_a_member_that_left_or_stopped_ignores_everything() -> None:
    cluster = Cluster(3)
    cluster.post(2, cluster.machines[2].leave(cluster.now))
    cluster.run(1.0)
    gone = cluster.machines[2]
    assert gone.state == "left"
    assert gone.tick(cluster.now + 5) == [] and gone.on_message(0, Beat(0), cluster.now) == []


# many members, a network that misbehaves ----------------------------------------------------

network = dict(seed=st.integers(0, 2**32 - 1), loss=st.floats(0.0, 0.15), dup=st.floats(0.0, 0.2),
               hold=st.floats(0.0, 0.4))


@settings(max_examples=300, deadline=None)
@given(n=st.integers(3, 5), crashes=st.lists(st.tuples(st.integers(0, 9), st.floats(0.0, 4.0)), max_size=3),
       joins=st.lists(st.floats(0.0, 4.0), max_size=3),
       leaves=st.lists(st.tuples(st.integers(0, 9), st.floats(0.0, 4.0)), max_size=2),
       cut=st.sampled_from([None, 1, 2]), **network)
def test_no_two_views_ever_share_a_number(n: int, crashes: list[tuple[int, float]], joins: list[float],
                                          leaves: list[tuple[int, float]], cut: int | None, seed: int,
                                          loss: float, dup: float, hold: float) -> None:
    """Safety under anything: crashes of any number, joins, leaves, a partition that heals."""
    cluster = Cluster(n, seed=seed, loss=loss, dup=dup, hold=hold)
    events = ([(t, "crash", r) for r, t in crashes] + [(t, "join", n + i) for i, t in enumerate(joins)] +
              [(t, "leave", r) for r, t in leaves])
    if cut is not None:
        events += [(1.0, "cut", cut), (3.0, "heal", 0)]
    events.sort()
    while cluster.now < 6.0:
        while events and events[0][0] <= cluster.now:
            _, what, rank = events.pop(0)
            _apply(cluster, what, rank)
        cluster.step()
    cluster.check_safety()


def _apply(cluster: Cluster, what: str, rank: int) -> None:
    ranks = sorted(cluster.machines)
    if what == "crash":
        cluster.crash(ranks[rank % len(ranks)])
    elif what == "join":
        cluster.join(rank)
    elif what == "leave":
        leaver = ranks[rank % len(ranks)]
        cluster.post(leaver, cluster.machines[leaver].leave(cluster.now))
    elif what == "cut":
        cluster.partition(ranks[:rank], ranks[rank:])
    else:
        cluster.heal()


@settings(max_examples=150, deadline=None)
@given(n=st.integers(4, 5), crash=st.booleans(), leave=st.booleans(), joins=st.integers(0, 2),
       when=st.floats(0.0, 2.0), **network)
def test_with_a_majority_connected_a_pending_change_is_committed(n: int, crash: bool, leave: bool, joins: int,
                                                                 when: float, seed: int, loss: float,
                                                                 dup: float, hold: float) -> None:
    """At most one member crashes and one leaves, amid loss, duplication and reordering;
    then the network behaves: every change is committed and the live members agree."""
    cluster = Cluster(n, seed=seed, loss=loss, dup=dup, hold=hold)
    cluster.run(when)
    if crash:
        cluster.crash(n - 1)
    if leave:
        cluster.post(1, cluster.machines[1].leave(cluster.now))
    for i in range(joins):
        cluster.join(n + i)
    cluster.run(2.0)
    cluster.calm()
    cluster.run(6.0)
    cluster.check_safety()
    view = _all_agree(cluster)
    assert cluster.live(), "nobody goes on"
    assert (n - 1 in view) is not crash
    if leave:
        assert 1 not in view and cluster.machines[1].state in ("left", "stopped")
    admitted = {r for c in cluster.commits() for r in c.change.joined}
    assert admitted == set(range(n, n + joins))
    assert all(not m.pending for m in cluster.live().values())


@settings(max_examples=100, deadline=None)
@given(alone=st.integers(0, 3), change_pending=st.booleans(), **network)
def test_in_a_3_1_split_the_3_go_on_and_the_1_stops(alone: int, change_pending: bool, seed: int,
                                                    loss: float, dup: float, hold: float) -> None:
    cluster = Cluster(4, seed=seed, loss=min(loss, 0.1), dup=dup, hold=min(hold, 0.3))
    cluster.run(0.5)
    if change_pending:
        cluster.join(9, contacts=[alone])  # asks only the one that will be cut off
    others = [r for r in range(4) if r != alone]
    cluster.partition(others, [alone, 9])
    cluster.run(4.0)
    cluster.check_safety()
    assert {r: m.view for r, m in cluster.live().items()} == {r: View(1, tuple(others)) for r in others}
    cut = cluster.machines[alone]
    assert cut.state == "stopped" and cut.view == cluster.first and not cut.history
    assert cut.line == (f"rank {alone} is cut off from ranks {', '.join(map(str, others))} of view 0 "
                        "(a majority): it stops; the other side goes on")
    if change_pending:
        assert cluster.machines[9].state == "joining"


@settings(max_examples=100, deadline=None)
@given(pair=st.sampled_from([(0, 1), (0, 2), (0, 3)]), **network)
def test_in_a_2_2_split_neither_side_commits_and_both_stop(pair: tuple[int, int], seed: int, loss: float,
                                                           dup: float, hold: float) -> None:
    cluster = Cluster(4, seed=seed, loss=min(loss, 0.1), dup=dup, hold=min(hold, 0.3))
    cluster.run(0.5)
    other = tuple(r for r in range(4) if r not in pair)
    cluster.partition(pair, other)
    cluster.run(2.5)
    cluster.heal()  # too late: a member that stopped stays stopped
    cluster.run(1.0)
    assert not cluster.commits()
    for side, far in ((pair, other), (other, pair)):
        for rank in side:
            machine = cluster.machines[rank]
            assert machine.state == "stopped" and machine.view == cluster.first
            assert machine.line == (f"rank {rank} is cut off from ranks {far[0]}, {far[1]} of view 0 (half of it): "
                                    "it stops; no side has a majority, so the other side stops too")
