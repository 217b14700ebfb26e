"""Changes asked for but not yet in a view, and the next view they make."""

from __future__ import annotations

from collections.abc import Iterable

from hopnet.membership.messages import Requests
from hopnet.membership.view import Change, View


def next_change(view: View, requests: Iterable[Requests], *, max_members: int | None,
                proposer: int) -> Change | None:
    """The change ``requests`` make to ``view``, batched into one; None when they change nothing.

    A leave wins over a death of the same rank; the proposer never counts itself dead. A
    join of a rank still in the view waits for a view without it. Joins are admitted in
    rank order while the view has room under ``max_members``; the rest are refused."""
    joins: set[int] = set()
    leaves: set[int] = set()
    deaths: set[int] = set()
    for asked in requests:
        joins.update(asked.joins)
        leaves.update(asked.leaves)
        deaths.update(asked.deaths)
    members = set(view.members)
    left = leaves & members
    died = (deaths & members) - left - {proposer}
    staying = members - left - died
    waiting = sorted(joins - members)
    room = len(waiting) if max_members is None else max(0, max_members - len(staying))
    joined, refused = waiting[:room], waiting[room:]
    if not (left or died or joined or refused):
        return None
    return Change(view=View(view.number + 1, tuple(sorted(staying | set(joined)))),
                  joined=tuple(joined), left=tuple(sorted(left)), died=tuple(sorted(died)),
                  refused=tuple(refused))


class Pending:
    """What one member knows was asked for and is not yet in a committed view."""

    def __init__(self) -> None:
        self.joins: set[int] = set()
        self.leaves: set[int] = set()
        self.deaths: set[int] = set()

    def add(self, asked: Requests) -> None:
        self.joins.update(asked.joins)
        self.leaves.update(asked.leaves)
        self.deaths.update(asked.deaths)

    def requests(self) -> Requests:
        return Requests(tuple(sorted(self.joins)), tuple(sorted(self.leaves)), tuple(sorted(self.deaths)))

    def settle(self, change: Change) -> None:
        """Forget what ``change`` did or made moot."""
        members = set(change.view.members)
        self.joins -= members | set(change.refused)
        self.leaves &= members
        self.deaths &= members
