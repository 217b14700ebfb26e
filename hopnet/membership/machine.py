"""One member's membership state machine: sans-IO, driven by events and the time passed in."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from hopnet.membership.changes import Pending, next_change
from hopnet.membership.lines import cut_off_line, dropped_line, left_line, refused_line, too_few_line
from hopnet.membership.messages import (
    Accept, Accepted, Beat, ChangeRequest, Commit, JoinRequest, Message, Nack, Prepare,
    Promise, Requests, Send,
)
from hopnet.membership.paxos import Acceptor, Round
from hopnet.membership.view import NO_VIEW, Ballot, View, view_relation

State = Literal["joining", "member", "left", "stopped"]


@dataclass(frozen=True)
class MembershipConfig:
    """The timing and size rules of a run's membership.

    ``peer_timeout``: a member silent this long is taken for dead; a member that heard from
    no majority of its view within it, for half of it more, is cut off and stops.
    ``retry_s``: how long a proposal's messages, a forwarded request or a join request wait
    for an answer before they go again (by default a quarter of ``peer_timeout``); a member
    further down the line takes over from a proposer that gets nowhere after
    ``peer_timeout`` per member ahead of it. ``beat_s``: how often a member says it is
    alive (a tenth of ``peer_timeout``)."""

    peer_timeout: float
    retry_s: float | None = None
    beat_s: float | None = None
    max_members: int | None = None
    min_members: int = 1
    gather_s: float = 0.0
    """How long a proposer waits, once a join is due, for more requests to put in the same view."""
    unit: str = "rank"
    """What a member is, as its lines name it (``replica`` in a run of replica groups)."""

    def __post_init__(self) -> None:
        if not self.peer_timeout > 0:
            raise ValueError(f"peer_timeout must be > 0 (got {self.peer_timeout})")
        if self.max_members is not None and self.max_members < max(1, self.min_members):
            raise ValueError(f"max_members ({self.max_members}) is below min_members ({self.min_members})")

    @property
    def retry(self) -> float:
        return self.peer_timeout / 4 if self.retry_s is None else self.retry_s

    @property
    def beat(self) -> float:
        return self.peer_timeout / 10 if self.beat_s is None else self.beat_s


class Membership:
    """The membership of one rank: which view it is in, and its part in agreeing on the next.

    Each view number is decided by single-decree Paxos among the members of the previous
    view (:mod:`hopnet.membership.paxos`). The lowest member that seems alive proposes, the
    next takes over when it stays silent; every change known when a round starts goes
    into one view. The host calls the event methods in any order, never from two threads
    at once, passes the current time into each, and sends what they return. ``state`` is
    ``"joining"`` until admitted, ``"member"``, then ``"left"`` (its leave was committed)
    or ``"stopped"`` (cut off, dropped, too few members, or refused), and ``line`` says why
    in one line. A member that left or stopped ignores everything from then on."""

    def __init__(self, rank: int, view: View | None, config: MembershipConfig, now: float,
                 contacts: Iterable[int] = ()) -> None:
        """``view``: the first view of the run, or None for a joiner, which asks ``contacts``
        (members of the running job, here or through :meth:`set_contacts`) to admit it."""
        if view is not None and rank not in view:
            raise ValueError(f"rank {rank} is not a member of {view}")
        self.rank = rank
        self.config = config
        self.view = view
        self.state: State = "joining" if view is None else "member"
        self.line: str | None = None
        self.history: list[Commit] = []
        """The commits this member installed, in order (a joiner's begin with its admission)."""
        self.votes: list[Accepted] = []
        """Every value this member accepted, as it said so: the record that a majority voted."""
        self._contacts = tuple(contacts)
        self._commits: dict[int, Commit] = {}
        self._refusals: dict[int, Commit] = {}
        self._future: dict[int, Commit] = {}
        self._pending = Pending()
        self._acceptor = Acceptor()
        self._round: Round | None = None
        self._highest_round = 0
        self._last_heard: dict[int, float] = {m: now for m in (view.members if view else ())}
        self._last_beat = float("-inf")
        self._last_forward = float("-inf")
        self._due_since: float | None = None
        self._yield_until = float("-inf")
        self._alone_since: float | None = None
        self._outbox: deque[Send] = deque()

    # events -------------------------------------------------------------------------------

    def set_contacts(self, contacts: Iterable[int]) -> None:
        """A joiner's members to ask, as it now knows them (before it asks)."""
        if self.state == "joining":
            self._contacts = tuple(contacts)

    def tick(self, now: float) -> list[Send]:
        """Time passed: beat, notice silence, propose or forward what is due."""
        if self.state == "joining":
            if now - self._last_forward >= self.config.retry:
                self._last_forward = now
                for contact in self._contacts:
                    self._send(contact, JoinRequest(NO_VIEW, self.rank))
        elif self.state == "member":
            self._beat(now)
            if self._check_reach(now):
                self._suspect_the_silent(now)
                self._drive(now)
        return self._flush(now)

    def on_message(self, sender: int, message: Message, now: float) -> list[Send]:
        """A message from rank ``sender`` arrived."""
        if self.state == "joining":
            if isinstance(message, Commit):
                self._joiner_commit(message, now)
        elif self.state == "member":
            self.heard_from(sender, now)
            self._on_member_message(sender, message, now)
        return self._flush(now)

    def heard_from(self, rank: int, now: float) -> None:
        """A sign of life from ``rank`` (the runtime's own heartbeats count too)."""
        if self.state != "member":
            return
        self._last_heard[rank] = max(now, self._last_heard.get(rank, now))
        self._pending.deaths.discard(rank)

    def request_join(self, rank: int, now: float) -> list[Send]:
        """Rank ``rank`` asks to join (through this member): it is admitted by a coming view."""
        if self.state == "member":
            self._join_asked(rank, now)
        return self._flush(now)

    def leave(self, now: float) -> list[Send]:
        """This member was asked to leave (a SIGTERM): it leaves with the next view."""
        if self.state == "member":
            self._pending.leaves.add(self.rank)
        return self._flush(now)

    def suspect(self, rank: int, now: float) -> list[Send]:
        """The runtime takes ``rank`` for dead: a coming view goes on without it."""
        if self.state == "member" and rank != self.rank and self.view is not None and rank in self.view:
            self._pending.deaths.add(rank)
        return self._flush(now)

    # reading ------------------------------------------------------------------------------

    @property
    def pending(self) -> Requests:
        """The changes this member knows of that no committed view holds yet."""
        return self._pending.requests()

    def committed(self, number: int) -> Commit | None:
        """The commit that made view ``number``, if this member installed it."""
        return self._commits.get(number)

    # messages -----------------------------------------------------------------------------

    def _on_member_message(self, sender: int, message: Message, now: float) -> None:
        view = self._current()
        if isinstance(message, JoinRequest):
            self._join_asked(message.rank, now)
            return
        relation = view_relation(message.view, view)
        if relation == "old":
            if not isinstance(message, Commit):  # a commit is never answered: no echo between two members
                self._catch_up(sender, message.view)
        elif relation == "new":
            if isinstance(message, Commit):
                self._future[message.view] = message
        elif isinstance(message, Commit):
            self._install(message, now)
        elif isinstance(message, ChangeRequest):
            self._pending.add(message.requests)
        elif sender in view:
            self._on_consensus(sender, message, now)

    def _on_consensus(self, sender: int, message: Message, now: float) -> None:
        view = self._current()
        if isinstance(message, Prepare):
            self._note_ballot(message.ballot, now)
            if self._acceptor.prepare(message.ballot):
                self._send(sender, Promise(view.number, message.ballot, self._acceptor.accepted_ballot,
                                           self._acceptor.accepted, self._pending.requests()))
            else:
                self._nack(sender, message.ballot)
        elif isinstance(message, Accept):
            self._note_ballot(message.ballot, now)
            if self._acceptor.accept(message.ballot, message.change):
                vote = Accepted(view.number, message.ballot, message.change)
                if vote not in self.votes[-1:]:  # an Accept sent again is accepted again, recorded once
                    self.votes.append(vote)
                self._send(sender, vote)
            else:
                self._nack(sender, message.ballot)
        elif isinstance(message, Promise):
            self._pending.add(message.requests)
            if self._round is not None and self._round.promised(sender, message):
                self._propose(self._round)
        elif isinstance(message, Accepted):
            if self._round is not None and self._round.acceptance(sender, message.ballot, message.change):
                self._decided(self._round)
        elif isinstance(message, Nack):
            self._highest_round = max(self._highest_round, message.promised.round)
            if self._round is not None and message.ballot == self._round.ballot:
                self._round = None
                self._yield_until = now + self.config.retry

    def _nack(self, to: int, ballot: Ballot) -> None:
        assert self._acceptor.promised is not None
        self._send(to, Nack(self._current().number, ballot, self._acceptor.promised))

    def _note_ballot(self, ballot: Ballot, now: float) -> None:
        """Another proposer is at work: let it finish before trying again."""
        self._highest_round = max(self._highest_round, ballot.round)
        if ballot.proposer != self.rank and (self._round is None or ballot > self._round.ballot):
            self._round = None
            self._yield_until = max(self._yield_until, now + self.config.retry)

    def _join_asked(self, rank: int, now: float) -> None:
        view = self._current()
        if rank in view:
            last = self.history[-1] if self.history else None
            if last is not None and rank in last.change.view:
                self._send(rank, last)  # its admission (or a later view with it) got lost
            return
        refusal = self._refusals.get(rank)
        if refusal is not None:
            self._send(rank, refusal)
            return
        self._pending.joins.add(rank)

    def _catch_up(self, sender: int, their_view: int) -> None:
        """The sender is behind: send it the commits it missed, oldest first."""
        for number in range(their_view + 1, self._current().number + 1):
            commit = self._commits.get(number)
            if commit is not None:
                self._send(sender, commit)

    # proposing ----------------------------------------------------------------------------

    def _drive(self, now: float) -> None:
        """Start a round when something is due and it is this member's turn; else forward."""
        view = self._current()
        due = (self._acceptor.accepted is not None or
               next_change(view, [self._pending.requests()], max_members=self.config.max_members,
                           proposer=self.rank) is not None)
        if not due:
            self._due_since = None
            return
        if self._due_since is None:
            self._due_since = now
        alive = self._seemingly_alive(now)
        turn = alive.index(self.rank)
        if turn == 0 or now - self._due_since >= turn * self.config.peer_timeout:
            if self._round is None:
                gathering = bool(self._pending.joins) and now - self._due_since < self.config.gather_s
                if now >= self._yield_until and not gathering:
                    self._start_round(now)
            elif now - self._round.sent >= self.config.retry:
                self._resend(self._round, now)
        elif self._pending.requests() and now - self._last_forward >= self.config.retry:
            self._last_forward = now
            self._send(alive[0], ChangeRequest(view.number, self._pending.requests()))

    def _start_round(self, now: float) -> None:
        view = self._current()
        self._highest_round += 1
        self._round = Round(Ballot(self._highest_round, self.rank), view, now)
        for member in view.members:
            self._send(member, Prepare(view.number, self._round.ballot))

    def _resend(self, round_: Round, now: float) -> None:
        """Ask again the voters that did not answer (lost messages); the ballot stays."""
        round_.sent = now
        number = round_.voters.number
        for member in round_.voters.members:
            if round_.phase == "prepare" and member not in round_.promises:
                self._send(member, Prepare(number, round_.ballot))
            elif round_.phase == "accept" and member not in round_.accepted_by:
                assert round_.change is not None
                self._send(member, Accept(number, round_.ballot, round_.change))

    def _propose(self, round_: Round) -> None:
        change = round_.value_already_accepted()
        if change is None:
            change = next_change(round_.voters, [self._pending.requests()],
                                 max_members=self.config.max_members, proposer=self.rank)
        if change is None:
            self._round = None
            return
        round_.propose(change)
        for member in round_.voters.members:
            self._send(member, Accept(round_.voters.number, round_.ballot, change))

    def _decided(self, round_: Round) -> None:
        assert round_.change is not None
        change = round_.change
        commit = Commit(round_.voters.number, round_.ballot, change, tuple(sorted(round_.accepted_by)))
        told = set(round_.voters.members) | set(change.view.members) | set(change.refused)
        for rank in sorted(told - {self.rank}):
            self._send(rank, commit)
        self._send(self.rank, commit)

    # views --------------------------------------------------------------------------------

    def _install(self, commit: Commit, now: float) -> None:
        """Move to the view ``commit`` decided, then to any later ones already received."""
        following: Commit | None = commit
        while following is not None and self.state == "member":
            self._enter(following, now)
            number = following.change.view.number
            self._future = {n: c for n, c in self._future.items() if n >= number}
            following = self._future.pop(number, None)

    def _enter(self, commit: Commit, now: float) -> None:
        change = commit.change
        new = change.view
        self.view = new
        self.history.append(commit)
        self._commits[new.number] = commit
        for rank in change.refused:
            self._refusals[rank] = commit
        self._pending.settle(change)
        self._acceptor = Acceptor()
        self._round = None
        self._due_since = None
        self._yield_until = float("-inf")
        for member in new.members:
            self._last_heard.setdefault(member, now)
        if self.rank not in new:
            self.state = "left" if self.rank in change.left else "stopped"
            unit = self.config.unit
            self.line = (left_line(self.rank, new, unit) if self.state == "left"
                         else dropped_line(self.rank, new, commit.accepted_by, unit))
        elif len(new.members) < self.config.min_members:
            left = {r for c in self.history for r in c.change.left}
            died = {r for c in self.history for r in c.change.died}
            self.state = "stopped"
            self.line = too_few_line(new, self.config.min_members, left, died, self.config.unit)

    def _joiner_commit(self, commit: Commit, now: float) -> None:
        if self.rank in commit.change.view:
            self.state = "member"
            self.view = commit.change.view
            self.history.append(commit)
            self._commits[self.view.number] = commit
            self._last_heard = {m: now for m in self.view.members}
            self._last_forward = float("-inf")
        elif self.rank in commit.change.refused:
            self.state = "stopped"
            self.line = refused_line(commit.change, self.config.max_members, self.config.unit)

    # liveness -----------------------------------------------------------------------------

    def _beat(self, now: float) -> None:
        if now - self._last_beat < self.config.beat:
            return
        self._last_beat = now
        view = self._current()
        for member in view.members:
            if member != self.rank:
                self._send(member, Beat(view.number))

    def _silent(self, member: int, now: float) -> bool:
        return member != self.rank and now - self._last_heard.get(member, now) >= self.config.peer_timeout

    def _check_reach(self, now: float) -> bool:
        """Stop, naming the partition, once no majority of the view was heard from within a
        peer timeout, for half a peer timeout more (so the whole other side is silent by then)."""
        view = self._current()
        unreachable = [m for m in view.members if self._silent(m, now)]
        if view.is_majority(set(view.members) - set(unreachable)):
            self._alone_since = None
            return True
        if self._alone_since is None:
            self._alone_since = now
        if now - self._alone_since < self.config.peer_timeout / 2:
            return True
        # The other side has been silent since the split; a member on this side that lost
        # a beat or two has not been silent for half a peer timeout.
        far = [m for m in view.members
               if m != self.rank and now - self._last_heard.get(m, now) >= self.config.peer_timeout / 2]
        self.state = "stopped"
        self.line = cut_off_line(self.rank, view, far, self.config.unit)
        self._round = None
        return False

    def _suspect_the_silent(self, now: float) -> None:
        for member in self._current().members:
            if self._silent(member, now):
                self._pending.deaths.add(member)

    def _seemingly_alive(self, now: float) -> list[int]:
        """The members in the order they take turns to propose: the lowest seemingly alive first."""
        return [m for m in self._current().members
                if m == self.rank or (not self._silent(m, now) and m not in self._pending.deaths)]

    # plumbing -----------------------------------------------------------------------------

    def _current(self) -> View:
        assert self.view is not None, "a joiner has no view yet"
        return self.view

    def _send(self, to: int, message: Message) -> None:
        self._outbox.append(Send(to, message))

    def _flush(self, now: float) -> list[Send]:
        """What to send, after handling the messages this member sent itself (in order)."""
        out: list[Send] = []
        while self._outbox:
            send = self._outbox.popleft()
            if send.to != self.rank:
                out.append(send)
            elif self.state == "member":
                self._on_member_message(self.rank, send.message, now)
        # A member that stopped or left mid-way sends nothing more of its own.
        return out if self.state in ("member", "joining") else [s for s in out if isinstance(s.message, Commit)]
