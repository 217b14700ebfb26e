"""The :class:`Graph` class: a graph's structure, its accessors and equality.

Its checks, named builders, JSON form and analysis live in the package's other modules
(see the package docstring); the class keeps what they return and caches the analysis."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hopnet.errors import GraphError
from hopnet.graph import analysis, builders, json_io, validation
from hopnet.graph.arguments import GraphArgs

if TYPE_CHECKING:
    from hopnet.graph.members import MemberGraph

__all__ = ["Graph"]


class Graph:
    """A directed communication graph with self-loops and per-edge mixing weights.

    Args:
        n: number of nodes (ids ``0..n-1``), at least 1.
        edges: pairs ``(i, j)``, meaning i sends to j. Self-loops are added.
        weights: optional ``{(i, j): w}`` on existing edges; per receiver, all or none.
        machines: optional machine label (or None) per node.
        name: optional human-readable name (not part of equality).

    Raises:
        GraphError: on any invalid input (one line naming the node or edge).
    """

    def __init__(
        self,
        n: int,
        edges: Iterable[tuple[int, int]],
        weights: Mapping[tuple[int, int], float] | None = None,
        machines: Sequence[str | None] | None = None,
        name: str | None = None,
    ) -> None:
        n = validation.node_count(n)
        validation.check_name(name)
        adj = validation.adjacency(n, edges)
        mixing = validation.mixing_weights(n, adj, weights)
        self._machines = validation.machine_labels(n, machines)
        validation.check_strongly_connected(n, adj)

        self._n = n
        self._name = name
        self._edges = adj.edges
        self._in, self._out = adj.ins, adj.outs
        self._in_peers, self._out_peers, self._peers = adj.in_peers, adj.out_peers, adj.peers
        self._in_set, self._out_set = adj.in_sets, adj.out_sets
        self._w_by_dst = mixing.by_receiver  # receiver j -> {sender i: W[i][j]}
        self._in_weights = mixing.per_receiver
        self._default_weights = mixing.all_default

        self._spl: np.ndarray | None = None
        self._back: dict[tuple[int, int], int] | None = None
        self._gap: float | None = None
        self._hash: int | None = None

    @classmethod
    def _from_args(cls, args: GraphArgs) -> Graph:
        return cls(args.n, args.edges, weights=args.weights, machines=args.machines, name=args.name)

    # ------------------------------------------------------------------ basics
    @property
    def n(self) -> int:
        """Number of nodes."""
        return self._n

    @property
    def size(self) -> int:
        """Alias of :attr:`n`."""
        return self._n

    def __len__(self) -> int:
        return self._n

    @property
    def name(self) -> str | None:
        """Human-readable name (e.g. ``"ring:8"``), or None."""
        return self._name

    @property
    def nodes(self) -> range:
        """Node ids ``0..n-1``."""
        return range(self._n)

    @property
    def edges(self) -> list[tuple[int, int]]:
        """All directed edges ``(i, j)``, sorted, self-loops included."""
        return list(self._edges)

    @property
    def num_edges(self) -> int:
        """Number of directed edges, self-loops not counted."""
        return len(self._edges) - self._n

    def has_edge(self, i: int, j: int) -> bool:
        """Whether i sends to j (true for i == j)."""
        return 0 <= j < self._n and i in self._in_set[j]

    def in_neighbors(self, i: int) -> tuple[int, ...]:
        """Nodes that send to ``i``, sorted, ``i`` included."""
        return self._in[i]

    def out_neighbors(self, i: int) -> tuple[int, ...]:
        """Nodes that ``i`` sends to, sorted, ``i`` included."""
        return self._out[i]

    def in_peers(self, i: int) -> tuple[int, ...]:
        """Nodes other than ``i`` that send to ``i``, sorted."""
        return self._in_peers[i]

    def out_peers(self, i: int) -> tuple[int, ...]:
        """Nodes other than ``i`` that ``i`` sends to, sorted."""
        return self._out_peers[i]

    def peers(self, i: int) -> tuple[int, ...]:
        """Union of in- and out-peers of ``i`` (``i`` excluded), sorted."""
        return self._peers[i]

    def in_neighbor_set(self, i: int) -> frozenset[int]:
        """:meth:`in_neighbors` as a frozenset (fast membership)."""
        return self._in_set[i]

    def out_neighbor_set(self, i: int) -> frozenset[int]:
        """:meth:`out_neighbors` as a frozenset (fast membership)."""
        return self._out_set[i]

    def weight(self, i: int, j: int) -> float:
        """``W[i][j]``: the weight receiver j gives to i's value; 0.0 if (i, j) is not an edge."""
        try:
            return self._w_by_dst[j].get(i, 0.0)
        except (IndexError, TypeError):
            return 0.0

    def in_weights(self, j: int) -> tuple[float, ...]:
        """Weights ``W[i][j]`` for ``i`` in :meth:`in_neighbors` ``(j)``, same order."""
        return self._in_weights[j]

    @property
    def weights(self) -> dict[tuple[int, int], float]:
        """A copy of all weights ``{(i, j): W[i][j]}``, self-loops included."""
        return {(i, j): w for j, ins in enumerate(self._in) for i, w in zip(ins, self._in_weights[j])}

    @property
    def has_default_weights(self) -> bool:
        """Whether every weight is Hop's default ``1 / |N_in(j)|``."""
        return self._default_weights

    def weight_matrix(self) -> np.ndarray:
        """Dense ``n x n`` float64 matrix with ``W[i][j]`` (columns sum to 1)."""
        w = np.zeros((self._n, self._n), dtype=np.float64)
        for j, (ins, ws) in enumerate(zip(self._in, self._in_weights)):
            w[ins, j] = ws
        return w

    def machine(self, i: int) -> str | None:
        """Machine label of node ``i``, or None."""
        return self._machines[i]

    @property
    def machines(self) -> tuple[str | None, ...]:
        """Machine label (or None) per node."""
        return self._machines

    def degrees(self) -> list[tuple[int, int]]:
        """``(in_degree, out_degree)`` per node, self-loops not counted."""
        return [(len(self._in_peers[v]), len(self._out_peers[v])) for v in range(self._n)]

    def is_undirected(self) -> bool:
        """Whether every edge (i, j) has its reverse (j, i)."""
        ins = self._in_set
        return all(j in ins[i] for i, j in self._edges)

    # ----------------------------------------------------------------- equality
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Graph):
            return NotImplemented
        return (
            self._n == other._n
            and self._edges == other._edges
            and self._machines == other._machines
            and self._in_weights == other._in_weights
        )

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((self._n, self._edges, self._machines))
        return self._hash

    def __repr__(self) -> str:
        label = f"{self._name!r}, " if self._name else ""
        return f"Graph({label}n={self._n}, edges={self.num_edges})"

    # ----------------------------------------------------------------- analysis
    def two_colouring(self) -> tuple[tuple[int, ...], tuple[int, ...]] | list[int]:
        """Split the nodes into two sides with every edge between them (edge directions ignored).

        Returns ``(side_a, side_b)``, each sorted, with node 0 in ``side_a`` (breadth-first from
        the lowest node of each component, so the split is deterministic); or, when the graph
        is not bipartite, an odd cycle as a closed node list ``[v0, v1, ..., v0]``.
        """
        return analysis.two_colouring(self._n, self._peers)

    def is_strongly_connected(self) -> bool:
        """Always true for a constructed graph (checked in ``__init__``); kept for clarity."""
        n = self._n
        return len(analysis.reach(0, self._out)) == n and len(analysis.reach(0, self._in)) == n

    def shortest_path_lengths(self) -> np.ndarray:
        """``n x n`` int matrix of hop counts from i to j along directed edges (0 on the diagonal).

        Cached; the returned array is read-only.
        """
        if self._spl is None:
            d = analysis.path_lengths(self._n, self._edges, self._out_peers)
            d.flags.writeable = False
            self._spl = d
        return self._spl

    def back_lengths(self) -> Mapping[tuple[int, int], int]:
        """For each edge ``(u, v)`` between two workers (no self-loop): the hop count of a
        shortest path back, from v to u.

        What Hop's checks and slot counts need, without the ``n x n`` matrix: a BFS from each
        worker that stops once it has reached all its in-neighbours (one step on a symmetric
        graph). Cached.
        """
        if self._back is None:
            if self._spl is not None:
                d = self._spl
                self._back = {(u, v): int(d[v, u]) for v in range(self._n) for u in self._in_peers[v]}
            else:
                self._back = analysis.back_lengths_bfs(self._n, self._in_peers, self._out_peers)
        return self._back

    def path_length(self, i: int, j: int) -> int:
        """Number of hops on a shortest directed path from i to j."""
        return int(self.shortest_path_lengths()[i, j])

    def diameter(self) -> int:
        """Longest shortest directed path, in hops."""
        return int(self.shortest_path_lengths().max())

    def spectral_gap(self) -> float:
        """Spectral gap ``|lambda_1(W)| - |lambda_2(W)|`` of the weight matrix W.

        Definition from Hop (Luo et al., "Hop: Heterogeneity-aware Decentralized
        Training", Sec. 7.3.6, footnote 2): "the difference between the norms of the
        largest 2 eigenvalues of the weighted adjacency matrix W". Eigenvalues are
        ordered by modulus; for a single node the gap is 1.0 (|lambda_1| = 1, no
        lambda_2). Cached. Note: with Eq. 1 weights ``ring_based(8)`` has gap 0.5;
        the paper's 0.6667 for its Fig. 21(a) is not reproduced by this definition.
        """
        if self._gap is None:
            self._gap = analysis.spectral_gap(self.weight_matrix())
        return self._gap

    def is_doubly_stochastic(self, tol: float = 1e-9) -> bool:
        """Whether rows as well as columns of W sum to 1 (within ``tol``)."""
        return analysis.is_doubly_stochastic(self.weight_matrix(), tol)

    # ----------------------------------------------------------------- builders
    @classmethod
    def ring(cls, n: int) -> Graph:
        """Bidirectional ring: i <-> i+1 (mod n)."""
        return cls._from_args(builders.ring(n))

    @classmethod
    def ring_based(cls, n: int) -> Graph:
        """Ring plus a chord to the most distant node: i <-> i+1 and i <-> i + n//2 (mod n).

        Hop Fig. 11(2). Regular: every node has degree 3 for even n >= 6 and 4 for odd n >= 5.
        """
        return cls._from_args(builders.ring_based(n))

    @classmethod
    def double_ring(cls, n: int) -> Graph:
        """Two ring-based graphs of n/2 nodes each (0..n/2-1 and n/2..n-1), joined node to node.

        Hop Fig. 11(3): node i <-> node i + n/2. Requires even n >= 4.
        """
        return cls._from_args(builders.double_ring(n))

    @classmethod
    def complete(cls, n: int) -> Graph:
        """Every node sends to every other node."""
        return cls._from_args(builders.complete(n))

    @classmethod
    def torus(cls, rows: int, cols: int) -> Graph:
        """2-D wrap-around grid; node ``r * cols + c`` links to its 4 grid neighbours, both ways."""
        return cls._from_args(builders.torus(rows, cols))

    @classmethod
    def exponential(cls, n: int) -> Graph:
        """Directed exponential graph: i -> i + 2^k (mod n) for every 2^k < n."""
        return cls._from_args(builders.exponential(n))

    @classmethod
    def hierarchical(cls, groups: Sequence[int] | Sequence[Sequence[int]]) -> Graph:
        """Complete graph inside each group (machine), ring between groups (Hop Fig. 21).

        ``groups`` is a list of group sizes (``[4, 4]``: nodes 0-3 and 4-7) or a list of
        lists of node ids covering ``0..n-1`` exactly once. The first node of each group
        is its representative; representatives of consecutive groups are linked both
        ways (a ring over groups). Node machines are labelled ``"m0"``, ``"m1"``, ...
        """
        return cls._from_args(builders.hierarchical(groups))

    @classmethod
    def by_name(cls, spec: str) -> Graph:
        """Build from a spec: ``ring:8``, ``ring_based:16``, ``double_ring:8``, ``complete:5``,
        ``torus:2x4``, ``exponential:8``, ``hierarchical:4,4``."""
        return cls._from_args(builders.by_name(spec))

    @staticmethod
    def over_members(spec: str, members: Iterable[int],
                     machines: Mapping[int, str] | None = None) -> MemberGraph:
        """The graph a builder spec names (``ring``, ``ring:8``, ``torus``, ``hierarchical``...),
        re-formed over the run's member ranks (any order, not necessarily ``0..n-1``) and
        labelled with each member's machine when ``machines`` (rank -> machine) is given.

        The same spec and member set give the same graph on every member; over ``range(n)``
        it equals :meth:`by_name` for ``n`` nodes. See :class:`~hopnet.graph.members.MemberGraph`.
        """
        from hopnet.graph.members import MemberGraph  # members builds on this module

        return MemberGraph.build(spec, members, machines)

    @classmethod
    def load(cls, source: str | os.PathLike[str]) -> Graph:
        """A JSON file if ``source`` exists, ends in ``.json`` or has no ``:``; else a builder spec."""
        text = os.fspath(source)
        if os.path.exists(text) or text.endswith(".json") or ":" not in text:
            try:
                return cls.from_json(Path(text))
            except OSError as exc:  # from_json converts the usual ones; anything else too
                raise GraphError(f"{text}: cannot read file: {exc.strerror or exc}") from None
        return cls.by_name(text)

    # ---------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (see the package docstring for the schema)."""
        return json_io.to_dict(self)

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """Serialise to JSON text (several edges per line); also write it to ``path`` if given, whole or
        not at all (a reader of a running launch's directory never sees half a file)."""
        text = json_io.to_text(self.to_dict())
        if path is not None:
            json_io.write_atomic(text, path)
        return text

    @classmethod
    def from_json(cls, source: str | os.PathLike[str] | Mapping[str, Any]) -> Graph:
        """Load a graph from a file path, a JSON text (starting with ``{``), or a dict.

        Errors are one-line :class:`GraphError`; for files they start with the path.
        """
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        label, data = json_io.read(source)
        try:
            return cls.from_dict(data)
        except GraphError as exc:
            if label:
                raise GraphError(f"{label}: {exc}") from None
            raise

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Graph:
        """Build from a dict following the JSON schema (see the package docstring)."""
        return cls._from_args(json_io.from_dict(data))
