"""Observed iteration gaps between neighbours, beside the bound Hop's Table 1 proves for them.

The observed gap of an ordered pair of neighbours (i, j) is the largest Iter(i) - Iter(j)
seen while replaying every rank's ``enter`` records in time order
(:func:`hopnet.analysis.max_gap_from_run`); the bound is :func:`hopnet.analysis.gap_bound`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hopnet.analysis import gap_bound, max_gap_from_run
from hopnet.config import ProtocolConfig
from hopnet.report.rundir import RunData


@dataclass(frozen=True)
class EdgeGap:
    """The largest ``Iter(ahead) - Iter(behind)`` observed between two neighbours, and its bound."""

    ahead: int
    behind: int
    observed: int
    bound: float | None
    """Table 1's bound (``math.inf`` when the setting leaves the gap unbounded); ``None``
    when the run's options are unknown."""

    @property
    def within(self) -> bool | None:
        return None if self.bound is None else self.observed <= self.bound


def edge_gaps(run: RunData) -> list[EdgeGap]:
    """One :class:`EdgeGap` per ordered pair of neighbours (an edge in either direction)."""
    graph = run.graph
    if graph is None:
        return []
    n = graph.n
    events = {rank: records for rank, records in run.events.items() if 0 <= rank < n}
    if not any(rec.get("event") == "enter" and "mono" in rec for recs in events.values() for rec in recs):
        return []
    observed = max_gap_from_run(events, n)
    bounds = gap_bound(graph, run.config) if run.config is not None else None
    gaps = []
    for i in range(n):
        for j in graph.peers(i):
            bound = None if bounds is None else float(bounds[i][j])
            gaps.append(EdgeGap(i, j, int(observed[i][j]), bound))
    return gaps


def bound_rule(config: ProtocolConfig) -> str | None:
    """The protocol's proven bound on Iter(i) - Iter(j), in words (len = shortest path length);
    ``None`` for a protocol that proves none."""
    rule = config.spec.gap_rule
    return rule(config.options) if rule is not None else None


def format_bound(bound: float | None) -> str:
    if bound is None:
        return "?"
    return "∞" if math.isinf(bound) else str(int(bound))
