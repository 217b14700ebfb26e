"""The one line a member says when it stops, leaves, or is refused."""

from __future__ import annotations

from collections.abc import Iterable

from hopnet.membership.view import Change, View, ranks_text


def cut_off_line(rank: int, view: View, unreachable: Iterable[int], unit: str = "rank") -> str:
    """``rank 3 is cut off from ranks 0, 1, 2 of view 4 (a majority): it stops; the other side goes on``."""
    cut = sorted(unreachable)
    if 2 * len(cut) > len(view.members):
        share, rest = "a majority", "the other side goes on"
    else:
        share, rest = "half of it", "no side has a majority, so the other side stops too"
    return f"{unit} {rank} is cut off from {ranks_text(cut, unit)} of view {view.number} ({share}): it stops; {rest}"


def dropped_line(rank: int, commit_view: View, decided_by: Iterable[int], unit: str = "rank") -> str:
    """A live member the others took for dead learns the view that went on without it."""
    return (f"{unit} {rank} is not in view {commit_view.number}: {ranks_text(decided_by, unit)} went on "
            f"without it (taken for dead): it stops")


def left_line(rank: int, view: View, unit: str = "rank") -> str:
    return f"{unit} {rank} left: view {view.number} goes on without it"


def too_few_line(view: View, minimum: int, left: Iterable[int], died: Iterable[int], unit: str = "rank") -> str:
    """``view 5 has 1 member, fewer than the minimum 2 (rank 3 left, ranks 1, 2 died): the run stops``."""
    count = len(view.members)
    gone = [f"{ranks_text(ranks, unit)} {verb}" for ranks, verb in ((sorted(left), "left"), (sorted(died), "died")) if ranks]
    why = f" ({', '.join(gone)})" if gone else ""
    return (f"view {view.number} has {count} member{'' if count == 1 else 's'}, fewer than the "
            f"minimum {minimum}{why}: the run stops")


def refused_line(change: Change, max_members: int | None, unit: str = "rank") -> str:
    """``the join of rank 9 was refused: view 5 has 8 members, the most allowed (8)``."""
    joins = "join" if len(change.refused) == 1 else "joins"
    verb = "was" if len(change.refused) == 1 else "were"
    return (f"the {joins} of {ranks_text(change.refused, unit)} {verb} refused: view {change.view.number} has "
            f"{len(change.view.members)} members, the most allowed ({max_members})")
