"""A graph over a run's members: the ranks alive in a view, not necessarily ``0..n-1``.

Every member computes it alone from the builder spec and the member set (and, for machine
labels, each member's machine), so all of them get the same graph and mixing weights without
exchanging an edge list. The members are placed on the builder's positions in sorted rank
order: after rank 2 leaves and rank 5 joins, members ``[0, 1, 3, 4, 5]`` sit on positions
``0..4`` of the builder's graph of 5 nodes. How each builder re-forms for a new count is in
:mod:`hopnet.graph.reform`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from hopnet.errors import GraphError
from hopnet.graph.arguments import is_int, render
from hopnet.graph.core import Graph
from hopnet.graph.reform import BuilderSpec


def member_ranks(members: Iterable[int]) -> tuple[int, ...]:
    """The members, checked (distinct non-negative integers, at least one) and sorted."""
    ranks = list(members)
    if not ranks:
        raise GraphError("members: a graph needs at least 1 member, got none")
    seen: set[int] = set()
    for rank in ranks:
        if not is_int(rank) or rank < 0:
            raise GraphError(f"members: a rank must be a non-negative integer, got {render(rank)}")
        if rank in seen:
            raise GraphError(f"members: rank {rank} given twice")
        seen.add(int(rank))
    return tuple(sorted(seen))


def machine_labels(ranks: Sequence[int], machines: Mapping[int, str]) -> list[str]:
    """Each member's machine, in rank order (ranks in ``machines`` that are not members are ignored)."""
    labels = []
    for rank in ranks:
        machine = machines.get(rank)
        if not isinstance(machine, str) or not machine:
            raise GraphError(f"machines: no machine for member {rank}" if machine is None
                             else f"machines: member {rank}: machine must be a non-empty string, got {render(machine)}")
        labels.append(machine)
    return labels


class MemberGraph:
    """A :class:`Graph` over positions ``0..n-1`` and the member rank on each position.

    Neighbours, weights and machines are asked for and answered in ranks;
    :meth:`position` and :meth:`rank` map between ranks and the graph's positions
    (``graph.weight_matrix()`` is in position order, which is rank order).
    """

    def __init__(self, graph: Graph, members: Iterable[int]) -> None:
        ranks = member_ranks(members)
        if len(ranks) != graph.n:
            raise GraphError(f"members: {len(ranks)} ranks for a graph of {graph.n} nodes")
        self._graph = graph
        self._ranks = ranks
        self._positions = {rank: position for position, rank in enumerate(ranks)}

    @classmethod
    def build(cls, spec: str | BuilderSpec, members: Iterable[int],
              machines: Mapping[int, str] | None = None) -> MemberGraph:
        """The graph ``spec`` names, re-formed over ``members`` (any order), optionally labelled
        with each member's machine (a rank -> machine mapping)."""
        builder = spec if isinstance(spec, BuilderSpec) else BuilderSpec.parse(spec)
        ranks = member_ranks(members)
        labels = None if machines is None else machine_labels(ranks, machines)
        return cls(Graph._from_args(builder.args_for(len(ranks), labels)), ranks)

    # ---------------------------------------------------------------- the mapping
    @property
    def graph(self) -> Graph:
        """The graph over positions ``0..n-1``."""
        return self._graph

    @property
    def members(self) -> tuple[int, ...]:
        """The member ranks, sorted: ``members[position]`` is the rank on that position."""
        return self._ranks

    @property
    def n(self) -> int:
        return len(self._ranks)

    @property
    def name(self) -> str | None:
        return self._graph.name

    def __contains__(self, rank: object) -> bool:
        return rank in self._positions

    def position(self, rank: int) -> int:
        """The graph position of member ``rank``."""
        try:
            return self._positions[rank]
        except (KeyError, TypeError):
            raise GraphError(f"rank {render(rank)} is not a member ({self._describe_members()})") from None

    def rank(self, position: int) -> int:
        """The member rank on graph ``position``."""
        if not is_int(position) or not 0 <= position < len(self._ranks):
            raise GraphError(f"position {render(position)} out of range (the graph has {len(self._ranks)} nodes)")
        return self._ranks[position]

    def _ranks_of(self, positions: Iterable[int]) -> tuple[int, ...]:
        return tuple(self._ranks[p] for p in positions)  # sorted positions give sorted ranks

    # ------------------------------------------------------------- by rank
    def in_neighbors(self, rank: int) -> tuple[int, ...]:
        """Members that send to ``rank``, sorted, ``rank`` included."""
        return self._ranks_of(self._graph.in_neighbors(self.position(rank)))

    def out_neighbors(self, rank: int) -> tuple[int, ...]:
        """Members ``rank`` sends to, sorted, ``rank`` included."""
        return self._ranks_of(self._graph.out_neighbors(self.position(rank)))

    def in_peers(self, rank: int) -> tuple[int, ...]:
        """Members other than ``rank`` that send to it, sorted."""
        return self._ranks_of(self._graph.in_peers(self.position(rank)))

    def out_peers(self, rank: int) -> tuple[int, ...]:
        """Members other than ``rank`` that it sends to, sorted."""
        return self._ranks_of(self._graph.out_peers(self.position(rank)))

    def peers(self, rank: int) -> tuple[int, ...]:
        """In- and out-peers of ``rank`` together, sorted."""
        return self._ranks_of(self._graph.peers(self.position(rank)))

    def weight(self, sender: int, receiver: int) -> float:
        """``W[sender][receiver]`` by rank; 0.0 where ``sender`` does not send to ``receiver``."""
        return self._graph.weight(self.position(sender), self.position(receiver))

    def in_weights(self, rank: int) -> tuple[float, ...]:
        """The weights ``rank`` gives its :meth:`in_neighbors`, in the same order."""
        return self._graph.in_weights(self.position(rank))

    @property
    def weights(self) -> dict[tuple[int, int], float]:
        """All weights ``{(sender, receiver): W}`` by rank, self-loops included."""
        return {(self._ranks[i], self._ranks[j]): w for (i, j), w in self._graph.weights.items()}

    def machine(self, rank: int) -> str | None:
        """The machine label of member ``rank``, or None."""
        return self._graph.machine(self.position(rank))

    # ------------------------------------------------------------------ equality
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MemberGraph):
            return NotImplemented
        return self._ranks == other._ranks and self._graph == other._graph

    def __hash__(self) -> int:
        return hash((self._ranks, self._graph))

    def __repr__(self) -> str:
        return f"MemberGraph({self._graph.name or 'graph'!r}, members={list(self._ranks)})"

    def _describe_members(self) -> str:
        shown = ", ".join(map(str, self._ranks[:16]))
        return f"members {shown}" + (f", ... ({len(self._ranks)} in all)" if len(self._ranks) > 16 else "")


__all__ = ["MemberGraph", "member_ranks"]
