"""Prague's static conflict-free schedule (Sec. 4.2): the paper's example, and its invariants
over machine layouts of every shape."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hopnet.config import ProtocolConfig
from hopnet.config_checks import check_config_for_graph
from hopnet.protocols.prague.static_schedule import PERIOD, check_static_schedule, static_group, static_phases
from hopnet.errors import ConfigError
from hopnet.graph import Graph

PAPER = [f"node{r // 4}" for r in range(16)]  # 16 workers on 4 machines, 4 local workers each


def test_the_papers_sixteen_workers_on_four_machines() -> None:
    assert static_group(0, 0, PAPER) == (0, 4, 8, 12)
    for k in range(5):
        for rank in (0, 4, 8, 12):
            assert static_group(rank, 4 * k, PAPER) == (0, 4, 8, 12)
        for rank in (2, 6, 10, 14):
            assert static_group(rank, 4 * k + 2, PAPER) is None
        for rank in (1, 5, 9, 13):
            assert static_group(rank, 4 * k, PAPER) is None  # LW1 skips phase 0
    # Fig. 10, rule by rule, on machine 1 (W4..W7)
    assert static_group(6, 0, PAPER) == static_group(7, 0, PAPER) == (6, 7)
    assert all(static_group(r, 1, PAPER) == (4, 5, 6, 7) == static_group(r, 3, PAPER) for r in range(4, 8))
    assert static_group(4, 2, PAPER) == static_group(7, 2, PAPER) == (4, 7)
    assert static_group(5, 2, PAPER) == (5, 13)  # LW1 with LW1 of the opposite node on the ring of 4
    assert static_group(1, 2, PAPER) == (1, 9)


def test_machines_are_found_by_label_not_by_rank_order() -> None:
    machines = ["b", "a", "b", "a", "b", "a", "b", "a"]  # two machines, interleaved ranks
    assert static_group(0, 0, machines) == (0, 1)  # the LW0s: the lowest rank of each machine
    assert static_group(2, 1, machines) == (0, 2, 4, 6)
    assert static_group(3, 2, machines) == (2, 3)  # LW1 of "b" (rank 2) with LW1 of "a" (rank 3)


@st.composite
def layouts(draw: st.DrawFn) -> list[str]:
    count = draw(st.sampled_from([1, 2, 4, 6, 8]))
    sizes = draw(st.lists(st.integers(1, 8), min_size=count, max_size=count))
    labels = [f"m{m}" for m, size in enumerate(sizes) for _ in range(size)]
    random.Random(draw(st.integers(0, 1000))).shuffle(labels)
    return labels


@settings(max_examples=100, deadline=None)
@given(machines=layouts())
def test_every_phase_is_conflict_free_and_a_period_is_connected(machines: list[str]) -> None:
    n = len(machines)
    parent = list(range(n))

    def root(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for iteration in range(2 * PERIOD):
        groups = {rank: static_group(rank, iteration, machines) for rank in range(n)}
        for rank, group in groups.items():
            if group is None:
                continue
            assert rank in group and list(group) == sorted(set(group)) and len(group) >= 2
            for member in group:  # every member computes the same group: so groups are disjoint
                assert groups[member] == group
            for member in group:
                parent[root(member)] = root(group[0])
        assert groups == {r: static_group(r, iteration + PERIOD, machines) for r in range(n)}  # period 4
    assert len({root(v) for v in range(n)}) == 1, "the union of a period's groups is not connected"
    for phase in static_phases(machines):
        flat = [r for g in phase for r in g]
        assert len(flat) == len(set(flat))


@pytest.mark.parametrize("layout, message", [
    ([4, 4, 4], r"needs an even number of machines \(got 3\)"),
    ([2, 1, 1], r"needs an even number of machines \(got 3\)"),
])
def test_odd_machine_counts_are_refused_in_one_line(layout: list[int], message: str) -> None:
    graph = Graph.hierarchical(layout)
    with pytest.raises(ConfigError, match=message) as info:
        check_config_for_graph(ProtocolConfig(protocol="prague", group_generator="static"), graph)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError):
        static_group(0, 0, graph.machines)
    # the smart generator does not care
    check_config_for_graph(ProtocolConfig(protocol="prague"), graph)


def test_layouts_that_need_no_opposite_machine_are_accepted() -> None:
    check_static_schedule(["a", "b", "c"])  # three machines of one worker: phase 2 has no LW1 to pair
    assert static_group(1, 0, ["a", "b", "c"]) == (0, 1, 2)
    check_static_schedule(["a"] * 6)  # one machine
    assert static_group(1, 2, ["a"] * 6) is None  # LW1 has no opposite machine
    assert check_config_for_graph(ProtocolConfig(protocol="prague", group_generator="static"),
                                  Graph.hierarchical([4, 4, 4, 4])) == []


def test_unlabelled_graphs_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"needs a machine for every node of the graph \(node 0 has none\)"):
        check_config_for_graph(ProtocolConfig(protocol="prague", group_generator="static"), Graph.ring(8))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        static_group(16, 0, PAPER)
    with pytest.raises(ValueError):
        static_group(0, -1, PAPER)
