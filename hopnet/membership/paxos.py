"""Single-decree Paxos for one view number: a voter's promises, a proposer's round.

The voters of view ``n + 1`` are the members of view ``n``. A proposal needs promises,
then acceptances, from a strict majority of them, and a value some voter already accepted
is proposed again (the one of the highest ballot), so once a majority accepted a value no
other value can gather a majority for the same view number."""

from __future__ import annotations

from typing import Literal

from hopnet.membership.messages import Promise
from hopnet.membership.view import Ballot, Change, View


class Acceptor:
    """A voter's state for one view number. It starts empty when its member installs a view."""

    def __init__(self) -> None:
        self.promised: Ballot | None = None
        self.accepted_ballot: Ballot | None = None
        self.accepted: Change | None = None

    def prepare(self, ballot: Ballot) -> bool:
        """Promise ``ballot`` unless a higher one was promised (a repeated ballot is promised again)."""
        if self.promised is not None and ballot < self.promised:
            return False
        self.promised = ballot
        return True

    def accept(self, ballot: Ballot, change: Change) -> bool:
        """Accept ``change`` under ``ballot`` unless a higher ballot was promised."""
        if self.promised is not None and ballot < self.promised:
            return False
        self.promised = ballot
        self.accepted_ballot = ballot
        self.accepted = change
        return True


class Round:
    """One proposer's attempt at one view number under one ballot."""

    def __init__(self, ballot: Ballot, voters: View, started: float) -> None:
        self.ballot = ballot
        self.voters = voters
        self.started = started
        self.sent = started
        """When its messages last went out (they go out again to whoever did not answer)."""
        self.phase: Literal["prepare", "accept", "decided"] = "prepare"
        self.promises: dict[int, Promise] = {}
        self.accepted_by: set[int] = set()
        self.change: Change | None = None

    def promised(self, voter: int, promise: Promise) -> bool:
        """Count a promise; True when it completes a majority (once)."""
        if self.phase != "prepare" or promise.ballot != self.ballot or voter not in self.voters:
            return False
        self.promises[voter] = promise
        return self.voters.is_majority(self.promises)

    def value_already_accepted(self) -> Change | None:
        """The value of the highest ballot the promisers accepted, which must be proposed again."""
        best: tuple[Ballot, Change] | None = None
        for promise in self.promises.values():
            if promise.accepted is not None and promise.accepted_ballot is not None:
                if best is None or promise.accepted_ballot > best[0]:
                    best = (promise.accepted_ballot, promise.accepted)
        return None if best is None else best[1]

    def propose(self, change: Change) -> None:
        self.phase = "accept"
        self.change = change

    def acceptance(self, voter: int, ballot: Ballot, change: Change) -> bool:
        """Count an acceptance; True when it completes a majority (once): the value is decided."""
        if self.phase != "accept" or ballot != self.ballot or change != self.change or voter not in self.voters:
            return False
        self.accepted_by.add(voter)
        if not self.voters.is_majority(self.accepted_by):
            return False
        self.phase = "decided"
        return True
