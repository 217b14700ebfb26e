"""Partial Reduce's frozen filter keeps its window's connectivity incrementally
(hopnet/protocols/partial_reduce/window.py): the same decisions as rebuilding a union-find
over the window for every group, which is the reference written here."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

import pytest

from hopnet.coordinator.base import Send
from hopnet.protocols.partial_reduce.controller import PartialReduceController
from hopnet.protocols.partial_reduce.window import WindowComponents


def rebuilt_roots(groups: Iterable[Sequence[int]], size: int) -> list[int]:
    """Each rank's component (as its smallest rank), from scratch."""
    parent = list(range(size))

    def find(x: int) -> int:
        while parent[x] != x:
            x = parent[x]
        return x

    for members in groups:
        for other in members[1:]:
            a, b = find(members[0]), find(other)
            parent[max(a, b)] = min(a, b)
    return [find(x) for x in range(size)]


class RebuildingController(PartialReduceController):
    """The filter as first written: a union-find over the last T - 1 groups, rebuilt per group."""

    def _pick(self, size: int) -> tuple[list[tuple[int, int]], bool] | None:
        queue = list(self.queue)
        chosen = list(range(size))
        repaired = False
        if self._window_full(size):
            roots = rebuilt_roots(self.recent, self.world_size)
            root = {rank: roots[rank] for rank, _ in queue}
            active = {r for members in self.recent for r in members if r not in self.gone}
            active.update(queue[i][0] for i in chosen)
            required = {roots[r] for r in active}
            covered = {root[queue[i][0]] for i in chosen}
            if not required <= covered:
                repaired = self._repair(queue, chosen, root, covered, required)
                if not repaired and len(queue) == size and not self._held:
                    self._held = True
                    self.holds += 1
                    return None
                if not required <= covered:
                    self.frozen_accepted += 1
        self._held = False
        picked = [queue[i] for i in chosen]
        taken = set(chosen)
        self.queue = type(self.queue)(entry for i, entry in enumerate(queue) if i not in taken)
        for rank, _ in picked:
            self.queued.discard(rank)
        if repaired:
            self.repairs += 1
        return picked, repaired


def groups_of(sends: list[Send]) -> list[tuple[int, tuple[int, ...], tuple[float, ...], int]]:
    seen: dict[int, tuple[int, tuple[int, ...], tuple[float, ...], int]] = {}
    for send in sends:
        m = send.message
        seen.setdefault(m["gid"], (m["gid"], tuple(m["members"]), tuple(m["weights"]), m["iter"]))
    return list(seen.values())


def run_both(n: int, p: int, window: int | None, events: int, seed: int) -> PartialReduceController:
    """Random ready / group-done / leave / rejoin events, fed to both controllers; every reply
    must be the same. The incremental controller, to inspect."""
    rng = random.Random(seed)
    new = PartialReduceController(n, p, frozen_window=window)
    old = RebuildingController(n, p, frozen_window=window)
    computing = set(range(n))  # neither queued nor gone
    counters = [0] * n
    for _ in range(events):
        roll = rng.random()
        if roll < 0.02 and len(new.gone) < n - 1:
            rank = rng.choice(sorted(set(range(n)) - new.gone))
            replies = [c.on_message(rank, {"t": "bye"}) for c in (new, old)]
            computing.discard(rank)
        elif roll < 0.04 and new.gone:
            rank = rng.choice(sorted(new.gone))
            replies = [c.on_worker_rejoined(rank) for c in (new, old)]
            computing.add(rank)
        elif computing:
            rank = rng.choice(sorted(computing))
            counters[rank] += 1
            replies = [c.on_message(rank, {"t": "ready", "iter": counters[rank]}) for c in (new, old)]
            computing.discard(rank)
        else:
            continue
        assert replies[0] == replies[1]
        for gid, members, _, iteration in groups_of(replies[0]):
            for member in members:
                counters[member] = iteration
                computing.add(member)
    assert new.summary() == old.summary()
    assert new.recent == old.recent
    return new


@pytest.mark.parametrize("n, p, window, seed", [(4, 2, None, 0), (7, 3, None, 1), (9, 3, 4, 2), (12, 2, 6, 3),
                                                (10, 4, None, 4), (6, 2, 1, 5), (16, 3, 3, 6)])
def test_the_incremental_filter_decides_as_the_rebuilt_one(n: int, p: int, window: int | None, seed: int) -> None:
    controller = run_both(n, p, window, 3000, seed)
    assert controller.next_gid > 3 * max(controller.frozen_window, 1)  # the window slid many times


def test_random_events_exercise_repairs_holds_and_departures() -> None:
    totals = {"repairs": 0, "holds": 0, "frozen_accepted": 0, "left": 0}
    for seed in range(6):
        summary = run_both(8, 2, 5, 1500, 100 + seed).summary()
        for key in ("repairs", "holds", "frozen_accepted"):
            totals[key] += summary[key]
        totals["left"] += len(summary["left"])
    assert all(value > 0 for value in totals.values()), totals


def test_window_components_match_a_rebuild_across_slides() -> None:
    rng = random.Random(7)
    n, width = 30, 9
    window = WindowComponents(n)
    groups: list[tuple[int, ...]] = []
    gone: set[int] = set()
    for step in range(2000):
        if len(groups) == width:
            assert window.pop_oldest() == groups.pop(0)
        group = tuple(rng.sample(range(n), rng.randint(1, 4)))
        groups.append(group)
        window.push(group)
        if step % 13 == 0:
            rank = rng.randrange(n)
            window.set_gone(rank, rank not in gone)
            gone ^= {rank}
        roots = rebuilt_roots(groups, n)
        by_root: dict[int, set[int]] = {}
        for rank in range(n):
            by_root.setdefault(roots[rank], set()).add(window.find(rank))
        assert all(len(found) == 1 for found in by_root.values())  # the same partition
        assert len({window.find(r) for r in range(n)}) == len(by_root)
        in_window = {r for g in groups for r in g} - gone
        live = {roots[r] for r in in_window}
        assert window.live_components == len(live)
        assert all(window.is_live(window.find(r)) == (roots[r] in live) for r in range(n))
