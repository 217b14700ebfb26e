"""The views of an elastic run (docs/guides/elastic.md), from the ranks' event logs: each view's
members, who joined, left, died or was refused, its first iteration and when it was committed;
and the words the launcher and the report say a view change in
(``view 2: rank 2 left (5 workers)``).

A view is committed by every member that installs it (a ``view_committed`` record each); its
first iteration is in the ``view_entered``, ``joined`` and ``view_change_at`` records. View 0 is
the launch's own ranks and has no record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hopnet.report.rundir import Record, RunData

CHANGES = ("joined", "left", "died", "refused")
FIRST_ITER_EVENTS = ("view_entered", "joined", "view_change_at")


def _ranks(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(r for r in value if isinstance(r, int) and not isinstance(r, bool))


def rank_list(ranks: Iterable[int], unit: str = "rank") -> str:
    """``rank 2`` / ``ranks 4, 5`` (``unit``: ``replica`` in a run of replica groups, whose views name replicas)."""
    names = [str(r) for r in ranks]
    return (f"{unit} " if len(names) == 1 else f"{unit}s ") + ", ".join(names)


@dataclass(frozen=True)
class View:
    number: int
    members: tuple[int, ...]
    joined: tuple[int, ...] = ()
    left: tuple[int, ...] = ()
    died: tuple[int, ...] = ()
    refused: tuple[int, ...] = ()
    mono: float | None = None
    """When the first member committed it (the shared monotonic clock); ``None`` for view 0."""
    first_iter: int | None = None
    """The view's first iteration (0 for view 0); ``None`` while no member has said."""

    def change(self, unit: str = "rank") -> str:
        """``ranks 4, 5 joined, rank 2 left``; ``started`` for view 0."""
        parts = [f"{rank_list(ranks, unit)} {what}" for what in CHANGES if (ranks := getattr(self, what))]
        return ", ".join(parts) if parts else "started" if self.number == 0 else "no change"

    def line(self, replicas: bool = False) -> str:
        """``view 1: ranks 4, 5 joined (6 workers)``: the launcher's line for this view (``replicas``: its
        members are replica groups, ``view 1: replica 2 joined (3 replicas)``)."""
        if replicas:
            return f"view {self.number}: {self.change('replica')} ({len(self.members)} replicas)"
        return f"view {self.number}: {self.change()} ({len(self.members)} workers)"

    @staticmethod
    def committed(record: Record) -> View | None:
        """The view a ``view_committed`` record installs (``None`` for another record)."""
        number = record.get("view")
        if record.get("event") != "view_committed" or not isinstance(number, int):
            return None
        mono = record.get("mono")
        return View(number, _ranks(record.get("members")), joined=_ranks(record.get("joined")),
                    left=_ranks(record.get("left")), died=_ranks(record.get("died")),
                    refused=_ranks(record.get("refused")), mono=float(mono) if isinstance(mono, (int, float)) else None)


def fold_views(records: Iterable[Record], first_members: Iterable[int]) -> list[View]:
    """Every view the ``records`` (of any ranks, in any order) show, view 0 (``first_members``) first."""
    views: dict[int, View] = {0: View(0, tuple(first_members), first_iter=0)}
    firsts: dict[int, int] = {}
    for record in records:
        view = View.committed(record)
        if view is not None:
            known = views.get(view.number)
            if known is None or (view.mono is not None and (known.mono is None or view.mono < known.mono)):
                views[view.number] = view
        elif record.get("event") in FIRST_ITER_EVENTS:
            number, iteration = record.get("view"), record.get("iter")
            if isinstance(number, int) and isinstance(iteration, int):
                firsts[number] = min(iteration, firsts.get(number, iteration))
    out = []
    for number in sorted(views):
        view = views[number]
        if number in firsts and number != 0:
            view = dataclasses.replace(view, first_iter=firsts[number])
        out.append(view)
    return out


def first_members(run: RunData) -> list[int]:
    """The launch's own ranks (view 0): ``launch.json``'s ``world_size``, else the graph's; in a run of
    replica groups, its replicas (the views name replicas)."""
    size = run.launch.get("world_size")
    replicas = run.launch.get("replicas")
    if isinstance(size, int) and isinstance(replicas, dict) and isinstance(replicas.get("size"), int):
        size //= max(1, replicas["size"])
    if not isinstance(size, int):
        size = run.graph.n if run.graph is not None else run.world_size
    return list(range(size))


def run_views(run: RunData) -> list[View]:
    """The views of ``run``; a run that is not elastic has view 0 only."""
    return fold_views((rec for records in run.events.values() for rec in records), first_members(run))


def is_elastic(run: RunData) -> bool:
    """Whether ``run`` was launched elastic (``--max-nproc``) or its logs show a view change."""
    return isinstance(run.launch.get("elastic"), dict) or any(
        rec.get("event") == "view_committed" for records in run.events.values() for rec in records)


def view_marks(views: list[View], t0: float) -> list[tuple[float, str]]:
    """``(seconds since t0, "view N")`` of each view change, for the plots' time axes."""
    return [(view.mono - t0, f"view {view.number}") for view in views if view.number > 0 and view.mono is not None]


__all__ = ["View", "first_members", "fold_views", "is_elastic", "rank_list", "run_views", "view_marks"]
