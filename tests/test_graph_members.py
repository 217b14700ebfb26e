"""Tests of graphs over a changing member list: Graph.over_members, MemberGraph and GraphSource."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hopnet.errors import ConfigError, GraphError
from hopnet.graph import Graph, GraphSource, MemberGraph
from hopnet.graph.reform import squarest

ANY_COUNT_KINDS = ["ring", "ring_based", "complete", "exponential", "torus"]
"""Kinds that re-form over any member count (double_ring needs an even count, hierarchical machines)."""

member_sets = st.sets(st.integers(0, 300), min_size=1, max_size=24)


def today(kind: str, n: int) -> Graph:
    """What today's builder gives for ``n`` nodes (a bare torus: the squarest RxC)."""
    if kind == "torus":
        rows, cols = squarest(n)
        return Graph.torus(rows, cols)
    return Graph.by_name(f"{kind}:{n}")


def check_valid(g: MemberGraph, members: set[int]) -> None:
    """Neighbours, weights and reachability by rank agree with the graph over positions."""
    assert set(g.members) == members and list(g.members) == sorted(members)
    for rank in g.members:
        assert g.rank(g.position(rank)) == rank
        assert set(g.in_neighbors(rank)) <= members and rank in g.in_neighbors(rank)
        assert set(g.out_peers(rank)) <= members and rank not in g.out_peers(rank)
        assert sum(g.in_weights(rank)) == pytest.approx(1.0)
        for sender, w in zip(g.in_neighbors(rank), g.in_weights(rank)):
            assert g.weight(sender, rank) == w == g.graph.weight(g.position(sender), g.position(rank))
    reached, frontier = {g.members[0]}, [g.members[0]]
    while frontier:
        nxt = [v for u in frontier for v in g.out_peers(u) if v not in reached]
        reached.update(nxt)
        frontier = nxt
    assert reached == members  # strongly connected: every member reached along out-edges...
    assert g.graph.is_strongly_connected()  # ...and back


# ------------------------------------------------------------------ range(n) is today's builder
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 12, 16])
@pytest.mark.parametrize("kind", ANY_COUNT_KINDS)
def test_over_range_n_is_todays_builder(kind: str, n: int) -> None:
    g = Graph.over_members(kind, range(n))
    assert g.graph == today(kind, n)
    assert g.weights == today(kind, n).weights
    assert g.graph.spectral_gap() == pytest.approx(today(kind, n).spectral_gap())


@pytest.mark.parametrize("spec", ["ring:8", "ring_based:16", "double_ring:4", "double_ring:8", "complete:5",
                                  "exponential:16", "torus:1x4", "torus:2x4", "torus:3x3",
                                  "hierarchical:4,4", "hierarchical:3,3,2"])
def test_a_sized_spec_over_its_own_nodes_is_todays_graph(spec: str) -> None:
    expected = Graph.by_name(spec)
    assert Graph.over_members(spec, range(expected.n)).graph == expected
    assert GraphSource.from_argument(spec).nodes == expected.n


@pytest.mark.parametrize("sizes", [[1], [4], [4, 4], [3, 3, 2], [2, 1, 3, 2]])
def test_hierarchical_with_todays_machines_is_todays_builder(sizes: list[int]) -> None:
    machines = {}
    for k, size in enumerate(sizes):
        machines.update({rank: f"m{k}" for rank in range(len(machines), len(machines) + size)})
    g = Graph.over_members("hierarchical", range(sum(sizes)), machines)
    assert g.graph == Graph.hierarchical(sizes)


def test_the_count_of_a_spec_is_where_a_run_starts() -> None:
    assert Graph.over_members("ring:8", [0, 1, 3, 4, 5]).graph == Graph.ring(5)
    assert Graph.over_members("double_ring:8", range(6)).graph == Graph.double_ring(6)


def test_a_bare_torus_takes_the_squarest_shape() -> None:
    assert [squarest(n) for n in (1, 2, 6, 7, 8, 9, 12, 16)] == [
        (1, 1), (1, 2), (2, 3), (1, 7), (2, 4), (3, 3), (3, 4), (4, 4)]
    assert Graph.over_members("torus", range(8)).graph == Graph.by_name("torus:2x4")


# ------------------------------------------------------------------------------ properties
@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(ANY_COUNT_KINDS), members=member_sets, seed=st.integers(0, 2**32 - 1))
def test_the_order_of_the_members_does_not_matter(kind: str, members: set[int], seed: int) -> None:
    ordered = sorted(members)
    shuffled = list(members)
    random.Random(seed).shuffle(shuffled)
    a, b = Graph.over_members(kind, ordered), Graph.over_members(kind, shuffled)
    assert a == b and a.weights == b.weights and a.members == tuple(ordered)


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(ANY_COUNT_KINDS), members=member_sets)
def test_members_sit_in_rank_order_on_todays_graph(kind: str, members: set[int]) -> None:
    g = Graph.over_members(kind, members)
    reference = today(kind, len(members))
    assert g.graph == reference
    assert g.graph.is_doubly_stochastic() == reference.is_doubly_stochastic()
    for i, j in reference.edges:
        assert g.weight(g.rank(i), g.rank(j)) == reference.weight(i, j)
    check_valid(g, members)


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(ANY_COUNT_KINDS), members=member_sets, data=st.data())
def test_one_leaves_and_another_joins(kind: str, members: set[int], data: st.DataObject) -> None:
    before = Graph.over_members(kind, members)
    leaver = data.draw(st.sampled_from(sorted(members)), label="leaver")
    joiner = data.draw(st.integers(0, 400).filter(lambda r: r not in members), label="joiner")
    after_members = (members - {leaver}) | {joiner}
    after = Graph.over_members(kind, after_members)
    check_valid(after, after_members)
    assert leaver not in after and joiner in after and after.n == before.n
    shrunk = members - {leaver}
    if shrunk:
        check_valid(Graph.over_members(kind, shrunk), shrunk)


@settings(max_examples=40, deadline=None)
@given(members=st.lists(st.integers(0, 300), min_size=4, max_size=24, unique=True).filter(lambda m: len(m) % 2 == 0))
def test_a_double_ring_reforms_over_an_even_count(members: list[int]) -> None:
    g = Graph.over_members("double_ring", members)
    assert g.graph == Graph.double_ring(len(members))
    check_valid(g, set(members))


@settings(max_examples=60, deadline=None)
@given(assignment=st.dictionaries(st.integers(0, 300), st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=20),
       seed=st.integers(0, 2**32 - 1))
def test_hierarchical_groups_follow_the_machines(assignment: dict[int, str], seed: int) -> None:
    shuffled = list(assignment)
    random.Random(seed).shuffle(shuffled)
    g = Graph.over_members("hierarchical", shuffled, assignment)
    assert g == Graph.over_members("hierarchical", sorted(assignment), assignment)
    check_valid(g, set(assignment))
    for rank, machine in assignment.items():
        assert g.machine(rank) == machine
        same_machine = {r for r, m in assignment.items() if m == machine and r != rank}
        assert same_machine <= set(g.peers(rank))  # complete inside a machine
    firsts = sorted(min(r for r, m in assignment.items() if m == machine) for machine in set(assignment.values()))
    across = {(i, j) for i, j in g.weights if assignment[i] != assignment[j]}
    assert {r for edge in across for r in edge} <= set(firsts)  # machines meet through their first members


def test_machines_label_any_builder_and_ranks_outside_the_members_are_ignored() -> None:
    g = Graph.over_members("ring", [0, 1, 3], {0: "a", 1: "a", 2: "gone", 3: "b"})
    assert g.graph.machines == ("a", "a", "b") and g.machine(3) == "b"
    assert Graph.over_members("ring", [0, 1, 3]).machine(3) is None


# ---------------------------------------------------------------------------- the mapping
def test_ranks_and_positions_map_both_ways() -> None:
    g = Graph.over_members("ring", [5, 0, 3, 1, 4])
    assert g.members == (0, 1, 3, 4, 5)
    assert [g.position(r) for r in g.members] == [0, 1, 2, 3, 4]
    assert [g.rank(p) for p in range(5)] == [0, 1, 3, 4, 5]
    assert g.in_peers(5) == (0, 4) and g.out_peers(0) == (1, 5)
    assert g.weight(4, 5) == pytest.approx(1 / 3) and g.weight(1, 5) == 0.0
    assert repr(g) == "MemberGraph('ring:5', members=[0, 1, 3, 4, 5])"


# --------------------------------------------------------------------------------- sources
def test_a_json_graph_refuses_other_members(tmp_path: Path) -> None:
    path = tmp_path / "ring.json"
    Graph.ring(4).to_json(path)
    source = GraphSource.from_argument(str(path))
    assert not source.resizable and source.nodes == 4
    assert source.for_members([3, 1, 0, 2]).graph == Graph.ring(4)  # its own nodes, in any order
    for members in ([0, 1, 2, 3, 4], [0, 1, 3], [0, 1, 2, 5]):
        with pytest.raises(ConfigError) as info:
            source.for_members(members)
        assert str(info.value) == (f"--graph {path} is a fixed graph of 4 nodes: it cannot take members "
                                   "joining or leaving (use a builder such as --graph ring)")


def test_a_graph_object_is_fixed_and_names_its_builder() -> None:
    source = GraphSource.from_argument(Graph.torus(2, 2))
    assert not source.resizable
    with pytest.raises(ConfigError, match=r"^the graph torus:2x2 is a fixed graph of 4 nodes: .* --graph torus\)$"):
        source.for_members(range(5))


@pytest.mark.parametrize(("argument", "kind", "nodes"), [
    (None, "ring", None), ("ring", "ring", None), ("ring:8", "ring", 8), ("Ring-Based", "ring_based", None),
    ("torus:2x4", "torus", 8), ("hierarchical", "hierarchical", None), ("hierarchical:4,4", "hierarchical", 8)])
def test_a_builder_spec_is_resizable(argument: str | None, kind: str, nodes: int | None) -> None:
    source = GraphSource.from_argument(argument)
    assert source.resizable and source.builder is not None and source.builder.kind == kind
    assert source.nodes == nodes


def test_a_builder_source_is_graph_over_members() -> None:
    machines = {0: "a", 2: "a", 7: "b"}
    source = GraphSource.from_argument("hierarchical:2,1")
    assert source.for_members([7, 2, 0], machines) == Graph.over_members("hierarchical", [0, 2, 7], machines)


# ------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize(("spec", "members", "message"), [
    ("torus:2x4", range(7), "torus:2x4 takes 8 members, got 7 (--graph torus re-forms to the squarest RxC "
                            "for any count)"),
    ("double_ring", range(5), "double_ring takes an even number of members, at least 4; got 5"),
    ("double_ring:8", range(2), "double_ring:8 takes an even number of members, at least 4; got 2"),
    ("hierarchical:4,4", range(7), "hierarchical:4,4 takes 8 members, got 7 (give each member's machine to "
                                   "group them by machine)"),
    ("hierarchical", range(3), "hierarchical over members needs each member's machine (or group sizes, as in "
                               "hierarchical:4,4)"),
    ("ring", [], "members: a graph needs at least 1 member, got none"),
    ("ring", [0, 2, 0], "members: rank 0 given twice"),
    ("ring", [0, -1], "members: a rank must be a non-negative integer, got -1"),
    ("ring", [0, True], "members: a rank must be a non-negative integer, got true"),
    ("ring:x", [0], "bad graph spec \"ring:x\" (ring needs a node count, e.g. ring:8)"),
])
def test_refusals_are_one_line(spec: str, members: list[int], message: str) -> None:
    with pytest.raises(GraphError) as info:
        Graph.over_members(spec, members)
    assert str(info.value) == message


def test_unknown_kinds_missing_files_and_missing_machines_are_one_line() -> None:
    errors = []
    for call in (lambda: Graph.over_members("bogus", [0]),
                 lambda: GraphSource.from_argument("no-such-graph"),
                 lambda: Graph.over_members("ring", [0, 1], {0: "a"}),
                 lambda: Graph.over_members("ring", [0], {0: ""})):
        with pytest.raises(GraphError) as info:
            call()
        errors.append(str(info.value))
    assert errors[0].startswith("unknown graph kind \"bogus\" (expected one of ring:N")
    assert errors[1] == "no-such-graph: no such file"
    assert errors[2] == "machines: no machine for member 1"
    assert errors[3] == "machines: member 0: machine must be a non-empty string, got \"\""
    assert all("\n" not in e for e in errors)


def test_a_rank_that_is_not_a_member_is_named() -> None:
    g = Graph.over_members("ring", [0, 1, 3])
    with pytest.raises(GraphError, match=r"^rank 2 is not a member \(members 0, 1, 3\)$"):
        g.in_peers(2)
    with pytest.raises(GraphError, match=r"^position 3 out of range \(the graph has 3 nodes\)$"):
        g.rank(3)
