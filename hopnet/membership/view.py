"""Views, the changes between them, ballots, and the rule that keeps an old view's messages out."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

NO_VIEW = -1
"""The view number a joiner's messages carry before it is admitted to any view."""


def ranks_text(ranks: Iterable[int], unit: str = "rank") -> str:
    """``rank 3`` or ``ranks 0, 1, 2``: ranks as a line names them (``unit``: what a member is, ``replica``
    in a run of replica groups)."""
    listed = sorted(ranks)
    if len(listed) == 1:
        return f"{unit} {listed[0]}"
    return f"{unit}s " + ", ".join(str(r) for r in listed)


@dataclass(frozen=True)
class View:
    """The members of the run from view ``number`` on: sorted, distinct ranks.

    A view may be empty only as the last one of a run (everyone left or died)."""

    number: int
    members: tuple[int, ...]

    def __post_init__(self) -> None:
        if isinstance(self.number, bool) or not isinstance(self.number, int) or self.number < 0:
            raise ValueError(f"a view number is an int >= 0 (got {self.number!r})")
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in self.members):
            raise ValueError(f"view {self.number}: members are ranks, ints >= 0 (got {self.members!r})")
        if list(self.members) != sorted(set(self.members)):
            raise ValueError(f"view {self.number}: members must be sorted and distinct (got {self.members!r})")

    @property
    def majority(self) -> int:
        """How many members make a strict majority of this view."""
        return len(self.members) // 2 + 1

    def is_majority(self, ranks: Iterable[int]) -> bool:
        """Whether ``ranks`` include a strict majority of this view's members."""
        return len(set(ranks) & set(self.members)) >= self.majority

    def __contains__(self, rank: object) -> bool:
        return rank in self.members

    def __str__(self) -> str:
        return f"view {self.number} (" + ", ".join(str(r) for r in self.members) + ")"


@dataclass(frozen=True)
class Change:
    """The value agreed on for one view number: the next view and why it differs from the last.

    ``joined`` were admitted, ``left`` left on purpose (a SIGTERM), ``died`` were taken for
    dead, ``refused`` asked to join but did not fit under the size limit."""

    view: View
    joined: tuple[int, ...] = ()
    left: tuple[int, ...] = ()
    died: tuple[int, ...] = ()
    refused: tuple[int, ...] = ()

    def describe(self) -> str:
        """``view 5 (0, 1, 4): rank 4 joined, rank 2 left, rank 3 died``."""
        parts = [f"{ranks_text(ranks)} {verb}" for ranks, verb in
                 ((self.joined, "joined"), (self.left, "left"), (self.died, "died"),
                  (self.refused, "refused")) if ranks]
        return f"{self.view}: " + (", ".join(parts) if parts else "no change")


@dataclass(frozen=True, order=True)
class Ballot:
    """A proposal's number: a round, then the proposer's rank, so two proposers never share one."""

    round: int
    proposer: int


def view_relation(message_view: int, current_view: View) -> Literal["old", "current", "new"]:
    """Whether a message tagged ``message_view`` is from an older view than ``current_view``,
    from it, or from a newer one (its sender installed a view this member has not yet)."""
    if message_view < current_view.number:
        return "old"
    return "current" if message_view == current_view.number else "new"


def accepts(message_view: int, current_view: View) -> bool:
    """Whether a message tagged ``message_view`` may be used by a member in ``current_view``.

    A message of an older view never is: its sender counted on members, weights and
    iterations that no longer hold. One of a newer view is not refused, only early: the
    runtime holds it until its membership installs that view (:func:`view_relation` says
    which)."""
    return view_relation(message_view, current_view) != "old"
