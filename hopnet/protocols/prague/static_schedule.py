"""Prague's conflict-free static schedule (ASPLOS'20 Sec. 4.2, Figs. 9 and 10).

Each worker computes its group for an iteration alone, with no Group Generator: the
groups of one iteration are disjoint, so they all run at once and never wait on each other.
The schedule repeats every 4 iterations. Machines come from the graph's ``machine`` field,
ordered by their lowest rank and numbered ``n = 0 .. M-1`` (the paper's ring of nodes); a
machine's local workers ``LW0, LW1, ...`` are its ranks in ascending order. With 4 local
workers per machine it is the paper's Fig. 10:

======  ==============================================================================
phase   groups
======  ==============================================================================
0       {LW0 of every machine}; {LW2, LW3} on each machine; LW1 skips
1       every machine's local workers together (Intra)
2       {LW0, LW3} on each machine; {LW1 of n, LW1 of (n + M/2) mod M}; LW2 skips
3       as phase 1
======  ==============================================================================

So iteration 4k has {W0, W4, W8, W12}, and W2, W6, W10, W14 skip iteration 4k+2 (16 workers
on 4 machines). For ``L`` local workers the rules generalise as follows:

* phase 0: the LW0s of all machines; LW1 skips; LW2.. are paired in order ({LW2, LW3},
  {LW4, LW5}, ...), an odd one out skips;
* phase 2: {LW0, LW(L-1)} when L >= 3; LW1 with LW1 of the opposite machine (skips when
  M = 1 or that machine has no LW1); of the workers between, LW2 skips and the rest are
  paired from LW3 on ({LW3, LW4}, ...: other pairs than in phase 0), an odd one out skips.
  With L = 2, LW0 skips in phase 2 (its partner LW1 goes to the opposite machine);
* phases 1 and 3: all local workers of a machine.

A group of one is no sync (``None``). Every phase's groups are disjoint and every member
computes the same group; phase 0 joins all machines and phase 1 joins each machine, so the
union over a period is connected. "Opposite machine" needs an even M whenever some machine
has two or more workers (Prague leaves odd M undefined); :func:`check_static_schedule`
refuses the rest in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from hopnet.errors import ConfigError

PERIOD = 4

__all__ = ["PERIOD", "check_static_schedule", "machine_layout", "static_group", "static_phases"]


def machine_layout(machines: Sequence[str | None]) -> tuple[tuple[int, ...], ...]:
    """Each machine's ranks, ascending, machines ordered by their lowest rank.

    Raises :class:`ConfigError` when a rank has no machine label."""
    by_label: dict[str, list[int]] = {}
    for rank, label in enumerate(machines):
        if label is None:
            raise ConfigError(f"--group-generator static needs a machine for every node of the graph "
                              f"(node {rank} has none): it schedules by a worker's rank on its machine")
        by_label.setdefault(label, []).append(rank)
    return tuple(tuple(ranks) for ranks in by_label.values())


def check_static_schedule(machines: Sequence[str | None]) -> None:
    """Refuse (one-line :class:`ConfigError`) a layout the static schedule cannot serve."""
    layout = machine_layout(machines)
    count = len(layout)
    if count > 1 and count % 2 and any(len(ranks) >= 2 for ranks in layout):
        raise ConfigError(f"--group-generator static needs an even number of machines (got {count}): "
                          "phase 2 pairs each machine's LW1 with the one on the opposite machine of the ring")


def static_phases(machines: Sequence[str | None]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The groups of each of the :data:`PERIOD` phases (groups of one left out)."""
    return tuple(tuple(sorted(set(groups.values()))) for groups in _schedule(tuple(machines)))


def static_group(rank: int, iteration: int, machines: Sequence[str | None]) -> tuple[int, ...] | None:
    """The sorted group ``rank`` averages with in ``iteration``, or None for no sync.

    ``machines`` holds the machine label of every rank (``Graph.machines``)."""
    phases = _schedule(tuple(machines))
    if not 0 <= rank < len(machines):
        raise ValueError(f"rank {rank} out of range (there are {len(machines)} workers)")
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0 (got {iteration})")
    return phases[iteration % PERIOD].get(rank)


@lru_cache(maxsize=16)
def _schedule(machines: tuple[str | None, ...]) -> tuple[dict[int, tuple[int, ...]], ...]:
    check_static_schedule(machines)
    layout = machine_layout(machines)
    count = len(layout)
    phase0: list[list[int]] = [[ranks[0] for ranks in layout]]
    intra: list[list[int]] = [list(ranks) for ranks in layout]
    phase2: list[list[int]] = []
    for n, local in enumerate(layout):
        size = len(local)
        phase0.extend(_pairs(local[2:]))
        if size >= 3:
            phase2.append([local[0], local[-1]])
        opposite = layout[(n + count // 2) % count]
        if size >= 2 and count > 1 and n < count // 2 and len(opposite) >= 2:
            phase2.append([local[1], opposite[1]])
        phase2.extend(_pairs(local[3:size - 1]))
    return tuple(_by_rank(groups) for groups in (phase0, intra, phase2, intra))


def _pairs(ranks: Sequence[int]) -> list[list[int]]:
    return [[ranks[k], ranks[k + 1]] for k in range(0, len(ranks) - 1, 2)]


def _by_rank(groups: list[list[int]]) -> dict[int, tuple[int, ...]]:
    out: dict[int, tuple[int, ...]] = {}
    for group in groups:
        if len(group) < 2:
            continue
        members = tuple(sorted(group))
        for rank in members:
            assert rank not in out, f"static schedule: rank {rank} in two groups of one phase"
            out[rank] = members
    return out
