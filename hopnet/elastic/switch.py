"""Where a committed view change takes effect, and who hands a joiner its state: pure functions
every member computes alike from what it was sent (docs/design/elastic.md).

Each member of the old view reports the iteration it was in when it learned of the commit. The
new view's first iteration is two past the highest report, moved forward to the protocol's next
safe point: every old member is then still before it when it knows it, so it finishes the old
view's last iteration knowing that it is the last, as a run finishes its final one."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from hopnet.graph.members import MemberGraph


def first_iteration(reports: Mapping[int, int], safe_point: Callable[[int], int]) -> int:
    """The new view's first iteration, from the old members' reports (rank -> iteration)."""
    if not reports:
        raise ValueError("a view change needs at least one report")
    return safe_point(max(reports.values()) + 2)


def assign_donors(graph: MemberGraph, joiners: Iterable[int], old_members: Sequence[int]) -> dict[int, int]:
    """joiner -> the old member that hands it its state.

    At the switch every old member has finished the same iteration, so none has more progress
    than another: a joiner takes its state from one of its new neighbours that was there before
    (any old member when none of them is among the least loaded), the one given the fewest joiners
    so far (ties to the lower rank). Several joiners are spread over several donors."""
    load: dict[int, int] = {m: 0 for m in old_members}
    if not load:
        raise ValueError("a joiner needs a member that was there before it")
    donors: dict[int, int] = {}
    for joiner in sorted(joiners):
        near = [p for p in graph.peers(joiner) if p in load]
        least = min(load.values())
        pool = near if near and min(load[p] for p in near) == least else sorted(load)
        donor = min(pool, key=lambda m: (load[m], m))
        load[donor] += 1
        donors[joiner] = donor
    return donors
