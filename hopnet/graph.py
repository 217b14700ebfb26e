"""Communication graphs for decentralized training.

A :class:`Graph` is a directed graph over nodes ``0..n-1``. Edge ``(i, j)`` means
*i sends to j*. Every node has a self-loop (added automatically), so the
in-neighbours ``N_in(j)`` of ``j`` include ``j`` itself. Each edge carries a
weight ``W[i][j] >= 0`` used by the receiver: ``x_j = sum_{i in N_in(j)} W[i][j] x_i``,
so every column sums to 1 over the in-edges. The default is Hop's Eq. 1,
``W[i][j] = 1 / |N_in(j)|``. A graph must be strongly connected.

JSON schema (see ``docs/graph-schema.md``)::

    {
      "name": "ring:8",                    # optional string
      "nodes": 8,                          # required: a count N, or a list of
                                           #   ids [0, .., N-1], or a list of
                                           #   {"id": 0, "machine": "host-a"}
      "undirected": true,                  # optional, default false: each edge
                                           #   is added in both directions
      "edges": [[0, 1], [1, 2]],           # required: [i, j] means i sends to j
      "weights": [[0, 1, 0.5]]             # optional: [[i, j, w], ..] or {"i->j": w}
    }

Self-loops are implicit (listing one is accepted). When weights are given for
some in-edge of a node ``j``, they must be given for *all* in-edges of ``j``
(self-loop included); nodes with no listed weight get the default. Unknown
top-level keys are rejected. Every problem is reported as a one-line
:class:`~hopnet.errors.GraphError`, prefixed with the file name when the graph
was read from a file.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hopnet.errors import GraphError

__all__ = ["Graph"]

_NORM_TOL = 1e-6
_TOP_LEVEL_KEYS = ("name", "nodes", "undirected", "edges", "weights")
_WEIGHT_KEY_RE = re.compile(r"^\s*(-?\d+)\s*->\s*(-?\d+)\s*$")


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _fmt(x: Any) -> str:
    """Render a value from user input for an error message (JSON-like)."""
    try:
        return json.dumps(x)
    except (TypeError, ValueError):
        return repr(x)


def _fmt_edge(i: Any, j: Any) -> str:
    return f"[{i}, {j}]"


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
        if not _is_int(n):
            raise GraphError(f"number of nodes must be an integer, got {_fmt(n)}")
        n = int(n)
        if n < 1:
            raise GraphError(f"a graph needs at least 1 node, got {n}")
        if name is not None and not isinstance(name, str):
            raise GraphError(f"graph name must be a string, got {_fmt(name)}")

        # -- edges ------------------------------------------------------------
        # Edges are kept as codes i * n + j while validating (fast for 1M-edge graphs).
        codes: set[int] = set(range(0, n * n, n + 1))  # self-loops
        add = codes.add
        for e in edges:
            try:
                i, j = e
            except (TypeError, ValueError):
                raise GraphError(f"edge {_fmt(e)}: expected a pair [i, j]") from None
            if type(i) is int and type(j) is int and 0 <= i < n and 0 <= j < n:
                add(i * n + j)
                continue
            for v in (i, j):
                if not _is_int(v):
                    raise GraphError(f"edge {_fmt_edge(_fmt(i), _fmt(j))}: node id {_fmt(v)} is not an integer")
                if not 0 <= v < n:
                    raise GraphError(f"edge {_fmt_edge(i, j)}: node {v} out of range (graph has {n} nodes)")
            add(int(i) * n + int(j))
        self._n = n
        arr = np.fromiter(codes, dtype=np.int64, count=len(codes))
        arr.sort()
        src, dst = arr // n, arr % n
        self._edges: tuple[tuple[int, int], ...] = tuple(zip(src.tolist(), dst.tolist()))
        cuts = np.cumsum(np.bincount(src, minlength=n))[:-1]
        self._out = tuple(tuple(x.tolist()) for x in np.split(dst, cuts))
        order = np.lexsort((src, dst))
        cuts = np.cumsum(np.bincount(dst, minlength=n))[:-1]
        self._in = tuple(tuple(x.tolist()) for x in np.split(src[order], cuts))
        self._in_peers = tuple(tuple(u for u in self._in[v] if u != v) for v in range(n))
        self._out_peers = tuple(tuple(u for u in self._out[v] if u != v) for v in range(n))
        self._peers = tuple(
            tuple(sorted(set(self._in_peers[v]).union(self._out_peers[v]))) for v in range(n)
        )
        self._in_set = tuple(frozenset(x) for x in self._in)
        self._out_set = tuple(frozenset(x) for x in self._out)

        # -- weights -------------------------------------------------------------
        given: dict[tuple[int, int], float] = {}
        if weights is not None:
            if not isinstance(weights, Mapping):
                raise GraphError(f"weights must be a mapping {{(i, j): w}}, got {type(weights).__name__}")
            for key, w in weights.items():
                try:
                    i, j = key
                except (TypeError, ValueError):
                    raise GraphError(f"weight key {_fmt(key)}: expected a pair (i, j)") from None
                if not (_is_int(i) and _is_int(j)):
                    raise GraphError(f"weight {_fmt_edge(_fmt(i), _fmt(j))}: node ids must be integers")
                i, j = int(i), int(j)
                if not (0 <= j < n and i in self._in_set[j]):
                    for v in (i, j):
                        if not 0 <= v < n:
                            raise GraphError(f"weight {_fmt_edge(i, j)}: node {v} out of range (graph has {n} nodes)")
                    raise GraphError(f"weight {_fmt_edge(i, j)}: no such edge")
                if not _is_number(w) or not math.isfinite(float(w)):
                    raise GraphError(f"weight {_fmt_edge(i, j)}: weight must be a finite number, got {_fmt(w)}")
                if w < 0:
                    raise GraphError(f"weight {_fmt_edge(i, j)}: negative weight {w}")
                given[(i, j)] = float(w)
        w_maps: list[dict[int, float]] = []
        in_weights: list[tuple[float, ...]] = []
        custom = [False] * n
        for (i, j) in given:
            custom[j] = True
        for j in range(n):
            if custom[j]:
                missing = [i for i in self._in[j] if (i, j) not in given]
                if missing:
                    raise GraphError(
                        f"node {j}: weights given for some in-edges but not for edge "
                        f"{_fmt_edge(missing[0], j)} (give all or none of a node's in-weights, self-loop included)"
                    )
                ws = tuple(given[(i, j)] for i in self._in[j])
                total = math.fsum(ws)
                if abs(total - 1.0) > _NORM_TOL:
                    raise GraphError(f"node {j}: in-weights sum to {total:.6g}, not 1")
            else:
                d = 1.0 / len(self._in[j])
                ws = (d,) * len(self._in[j])
            in_weights.append(ws)
            w_maps.append(dict(zip(self._in[j], ws)))
        self._w_by_dst = tuple(w_maps)  # receiver j -> {sender i: W[i][j]}
        self._in_weights = tuple(in_weights)
        self._default_weights = not any(custom) or all(
            w == 1.0 / len(ws) for ws in in_weights for w in ws
        )

        # -- machines ---------------------------------------------------------------
        if machines is None:
            self._machines: tuple[str | None, ...] = (None,) * n
        else:
            ms = tuple(machines)
            if len(ms) != n:
                raise GraphError(f"machines: expected {n} labels (one per node), got {len(ms)}")
            for v, m in enumerate(ms):
                if m is not None and not isinstance(m, str):
                    raise GraphError(f"node {v}: machine must be a string or null, got {_fmt(m)}")
            self._machines = ms
        self._name = name

        # -- connectivity ------------------------------------------------------------
        fwd = self._reach(0, self._out)
        if len(fwd) < n:
            bad = min(set(range(n)) - fwd)
            raise GraphError(f"graph is not strongly connected: node {bad} cannot be reached from node 0")
        bwd = self._reach(0, self._in)
        if len(bwd) < n:
            bad = min(set(range(n)) - bwd)
            raise GraphError(f"graph is not strongly connected: node {bad} cannot reach node 0")

        self._spl: np.ndarray | None = None
        self._back: dict[tuple[int, int], int] | None = None
        self._gap: float | None = None
        self._hash: int | None = None

    @staticmethod
    def _reach(src: int, adj: tuple[tuple[int, ...], ...]) -> set[int]:
        seen = {src}
        stack = [src]
        while stack:
            u = stack.pop()
            for v in adj[u]:
                if v not in seen:
                    seen.add(v)
                    stack.append(v)
        return seen

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

    def two_colouring(self) -> tuple[tuple[int, ...], tuple[int, ...]] | list[int]:
        """Split the nodes into two sides with every edge between them (edge directions ignored).

        Returns ``(side_a, side_b)``, each sorted, with node 0 in ``side_a`` (breadth-first from
        the lowest node of each component, so the split is deterministic); or, when the graph
        is not bipartite, an odd cycle as a closed node list ``[v0, v1, ..., v0]``.
        """
        n = self._n
        colour: list[int | None] = [None] * n
        parent: list[int] = list(range(n))
        depth = [0] * n
        for root in range(n):
            if colour[root] is not None:
                continue
            colour[root] = 0
            queue = deque([root])
            while queue:
                u = queue.popleft()
                for v in self._peers[u]:
                    if colour[v] is None:
                        colour[v], parent[v], depth[v] = 1 - colour[u], u, depth[u] + 1  # type: ignore[operator]
                        queue.append(v)
                    elif colour[v] == colour[u]:
                        return self._odd_cycle(u, v, parent, depth)
        side_a = tuple(v for v in range(n) if colour[v] == 0)
        side_b = tuple(v for v in range(n) if colour[v] == 1)
        return side_a, side_b

    @staticmethod
    def _odd_cycle(u: int, v: int, parent: list[int], depth: list[int]) -> list[int]:
        """The cycle closed by edge u-v between two nodes of one BFS colour: both tree paths up
        to their lowest common ancestor, joined by the edge (an odd number of edges)."""
        up_u, up_v = [u], [v]
        while depth[up_u[-1]] > depth[up_v[-1]]:
            up_u.append(parent[up_u[-1]])
        while depth[up_v[-1]] > depth[up_u[-1]]:
            up_v.append(parent[up_v[-1]])
        while up_u[-1] != up_v[-1]:
            up_u.append(parent[up_u[-1]])
            up_v.append(parent[up_v[-1]])
        cycle = up_u[::-1] + up_v[:-1]  # ancestor .. u, v .. (child of ancestor)
        start = cycle.index(min(cycle))
        cycle = cycle[start:] + cycle[:start]
        if len(cycle) > 2 and cycle[-1] < cycle[1]:
            cycle = [cycle[0]] + cycle[1:][::-1]
        return cycle + [cycle[0]]

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
    def is_strongly_connected(self) -> bool:
        """Always true for a constructed graph (checked in ``__init__``); kept for clarity."""
        n = self._n
        return len(self._reach(0, self._out)) == n and len(self._reach(0, self._in)) == n

    def shortest_path_lengths(self) -> np.ndarray:
        """``n x n`` int matrix of hop counts from i to j along directed edges (0 on the diagonal).

        Cached; the returned array is read-only.
        """
        if self._spl is None:
            n = self._n
            if len(self._edges) > 16 * n and n > 64:
                d = self._spl_dense()
            else:
                d = self._spl_bfs()
            d.flags.writeable = False
            self._spl = d
        return self._spl

    def _spl_bfs(self) -> np.ndarray:
        n = self._n
        out = self._out_peers
        rows = []
        for s in range(n):
            dist = [-1] * n
            dist[s] = 0
            q = deque((s,))
            pop, push = q.popleft, q.append
            while q:
                u = pop()
                du = dist[u] + 1
                for v in out[u]:
                    if dist[v] < 0:
                        dist[v] = du
                        push(v)
            rows.append(dist)
        return np.array(rows, dtype=np.int64)

    def _spl_dense(self) -> np.ndarray:
        # Level-synchronous BFS from all sources at once: frontier @ adjacency.
        n = self._n
        adj = np.zeros((n, n), dtype=np.float32)
        idx = np.array(self._edges, dtype=np.int64)
        adj[idx[:, 0], idx[:, 1]] = 1.0
        adj[np.arange(n), np.arange(n)] = 0.0
        dist = np.full((n, n), -1, dtype=np.int64)
        np.fill_diagonal(dist, 0)
        frontier = np.eye(n, dtype=np.float32)
        level = 0
        while True:
            level += 1
            nxt = (frontier @ adj) > 0
            nxt &= dist < 0
            if not nxt.any():
                break
            dist[nxt] = level
            frontier = nxt.astype(np.float32)
        return dist

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
                self._back = self._back_bfs()
        return self._back

    def _back_bfs(self) -> dict[tuple[int, int], int]:
        out = self._out_peers
        back: dict[tuple[int, int], int] = {}
        for s in range(self._n):
            wanted = set(self._in_peers[s])
            dist = {s: 0}
            q = deque((s,))
            while wanted:
                u = q.popleft()
                du = dist[u] + 1
                for v in out[u]:
                    if v not in dist:
                        dist[v] = du
                        q.append(v)
                        if v in wanted:
                            back[(v, s)] = du
                            wanted.discard(v)
        return back

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
            if self._n == 1:
                self._gap = 1.0
            else:
                mods = np.sort(np.abs(np.linalg.eigvals(self.weight_matrix())))[::-1]
                self._gap = float(mods[0] - mods[1])
        return self._gap

    def is_doubly_stochastic(self, tol: float = 1e-9) -> bool:
        """Whether rows as well as columns of W sum to 1 (within ``tol``)."""
        w = self.weight_matrix()
        return bool(
            np.all(np.abs(w.sum(axis=0) - 1.0) <= tol) and np.all(np.abs(w.sum(axis=1) - 1.0) <= tol)
        )

    # ----------------------------------------------------------------- builders
    @classmethod
    def _undirected(cls, n: int, pairs: Iterable[tuple[int, int]], name: str,
                    machines: Sequence[str | None] | None = None) -> Graph:
        edges: set[tuple[int, int]] = set()
        for i, j in pairs:
            if i != j:
                edges.add((i, j))
                edges.add((j, i))
        return cls(n, edges, machines=machines, name=name)

    @staticmethod
    def _check_n(kind: str, n: Any, minimum: int = 1) -> int:
        if not _is_int(n):
            raise GraphError(f"{kind}: number of nodes must be an integer, got {_fmt(n)}")
        if n < minimum:
            raise GraphError(f"{kind}: needs at least {minimum} node{'s' if minimum > 1 else ''}, got {n}")
        return int(n)

    @classmethod
    def ring(cls, n: int) -> Graph:
        """Bidirectional ring: i <-> i+1 (mod n)."""
        n = cls._check_n("ring", n)
        return cls._undirected(n, ((i, (i + 1) % n) for i in range(n)), f"ring:{n}")

    @classmethod
    def ring_based(cls, n: int) -> Graph:
        """Ring plus a chord to the most distant node: i <-> i+1 and i <-> i + n//2 (mod n).

        Hop Fig. 11(2). Regular: every node has degree 3 for even n >= 6 and 4 for odd n >= 5.
        """
        n = cls._check_n("ring_based", n)
        pairs = [(i, (i + 1) % n) for i in range(n)] + [(i, (i + n // 2) % n) for i in range(n)]
        return cls._undirected(n, pairs, f"ring_based:{n}")

    @classmethod
    def double_ring(cls, n: int) -> Graph:
        """Two ring-based graphs of n/2 nodes each (0..n/2-1 and n/2..n-1), joined node to node.

        Hop Fig. 11(3): node i <-> node i + n/2. Requires even n >= 4.
        """
        n = cls._check_n("double_ring", n, 4)
        if n % 2:
            raise GraphError(f"double_ring: needs an even number of nodes, got {n}")
        h = n // 2
        half = cls.ring_based(h)
        pairs = [(i, j) for i, j in half._edges if i != j]
        pairs += [(i + h, j + h) for i, j in pairs]
        pairs += [(i, i + h) for i in range(h)]
        return cls._undirected(n, pairs, f"double_ring:{n}")

    @classmethod
    def complete(cls, n: int) -> Graph:
        """Every node sends to every other node."""
        n = cls._check_n("complete", n)
        edges = [(i, j) for i in range(n) for j in range(n) if i != j]
        return cls(n, edges, name=f"complete:{n}")

    @classmethod
    def torus(cls, rows: int, cols: int) -> Graph:
        """2-D wrap-around grid; node ``r * cols + c`` links to its 4 grid neighbours, both ways."""
        rows = cls._check_n("torus rows", rows)
        cols = cls._check_n("torus cols", cols)
        pairs = []
        for r in range(rows):
            for c in range(cols):
                v = r * cols + c
                pairs.append((v, r * cols + (c + 1) % cols))
                pairs.append((v, ((r + 1) % rows) * cols + c))
        return cls._undirected(rows * cols, pairs, f"torus:{rows}x{cols}")

    @classmethod
    def exponential(cls, n: int) -> Graph:
        """Directed exponential graph: i -> i + 2^k (mod n) for every 2^k < n."""
        n = cls._check_n("exponential", n)
        edges = []
        for i in range(n):
            k = 1
            while k < n:
                edges.append((i, (i + k) % n))
                k *= 2
        return cls(n, edges, name=f"exponential:{n}")

    @classmethod
    def hierarchical(cls, groups: Sequence[int] | Sequence[Sequence[int]]) -> Graph:
        """Complete graph inside each group (machine), ring between groups (Hop Fig. 21).

        ``groups`` is a list of group sizes (``[4, 4]``: nodes 0-3 and 4-7) or a list of
        lists of node ids covering ``0..n-1`` exactly once. The first node of each group
        is its representative; representatives of consecutive groups are linked both
        ways (a ring over groups). Node machines are labelled ``"m0"``, ``"m1"``, ...
        """
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
            raise GraphError(f"hierarchical: groups must be a non-empty list, got {_fmt(groups)}")
        members: list[list[int]] = []
        sizes = [g for g in groups if isinstance(g, (int, np.integer)) and _is_int(g)]
        if len(sizes) == len(groups):
            start = 0
            for k, size in enumerate(sizes):
                if size < 1:
                    raise GraphError(f"hierarchical: group {k} has size {size}, needs at least 1")
                members.append(list(range(start, start + int(size))))
                start += int(size)
        else:
            for k, g in enumerate(groups):
                if isinstance(g, (str, bytes)) or not isinstance(g, Sequence) or not g:
                    raise GraphError(f"hierarchical: group {k} must be a size or a non-empty list of node ids, "
                                     f"got {_fmt(g)}")
                if not all(_is_int(v) for v in g):
                    raise GraphError(f"hierarchical: group {k}: node ids must be integers, got {_fmt(list(g))}")
                members.append([int(v) for v in g])
            flat = [v for g in members for v in g]
            seen: set[int] = set()
            for v in flat:
                if v in seen:
                    raise GraphError(f"hierarchical: node {v} is in more than one group")
                seen.add(v)
            n_ = len(flat)
            for v in flat:
                if not 0 <= v < n_:
                    raise GraphError(f"hierarchical: node {v} out of range (groups have {n_} nodes, ids 0..{n_ - 1})")
        n = sum(len(g) for g in members)
        machines: list[str | None] = [None] * n
        pairs: list[tuple[int, int]] = []
        for k, g in enumerate(members):
            for v in g:
                machines[v] = f"m{k}"
            pairs += [(a, b) for a in g for b in g if a < b]
        reps = [g[0] for g in members]
        if len(reps) > 1:
            pairs += [(reps[k], reps[(k + 1) % len(reps)]) for k in range(len(reps))]
        if all(_is_int(g) for g in groups):
            name = "hierarchical:" + ",".join(str(len(g)) for g in members)
        else:
            name = "hierarchical"
        return cls._undirected(n, pairs, name, machines=machines)


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

    @classmethod
    def by_name(cls, spec: str) -> Graph:
        """Build from a spec: ``ring:8``, ``ring_based:16``, ``double_ring:8``, ``complete:5``,
        ``torus:2x4``, ``exponential:8``, ``hierarchical:4,4``."""
        usage = "expected one of ring:N, ring_based:N, double_ring:N, complete:N, exponential:N, " \
                "torus:RxC, hierarchical:A,B,..."
        if not isinstance(spec, str) or ":" not in spec:
            raise GraphError(f"bad graph spec {_fmt(spec)} ({usage})")
        kind, _, arg = spec.partition(":")
        kind = kind.strip().lower().replace("-", "_")
        arg = arg.strip()

        def ints(text: str, sep: str) -> list[int]:
            parts = text.split(sep)
            if not all(re.fullmatch(r"\d+", p.strip()) for p in parts):
                raise GraphError(f"bad graph spec {_fmt(spec)} ({usage})")
            return [int(p) for p in parts]

        if kind in ("ring", "ring_based", "double_ring", "complete", "exponential"):
            if not re.fullmatch(r"\d+", arg):
                raise GraphError(f"bad graph spec {_fmt(spec)} ({kind} needs a node count, e.g. {kind}:8)")
            return getattr(cls, kind)(int(arg))
        if kind == "torus":
            dims = ints(arg.lower(), "x")
            if len(dims) != 2:
                raise GraphError(f"bad graph spec {_fmt(spec)} (torus needs ROWSxCOLS, e.g. torus:2x4)")
            return cls.torus(dims[0], dims[1])
        if kind == "hierarchical":
            return cls.hierarchical(ints(arg, ","))
        raise GraphError(f"unknown graph kind {_fmt(kind)} in spec {_fmt(spec)} ({usage})")

    # ---------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (see module docstring for the schema)."""
        d: dict[str, Any] = {}
        if self._name is not None:
            d["name"] = self._name
        if all(m is None for m in self._machines):
            d["nodes"] = self._n
        else:
            d["nodes"] = [{"id": v, "machine": m} if m is not None else {"id": v}
                          for v, m in enumerate(self._machines)]
        if self.is_undirected():
            d["undirected"] = True
            d["edges"] = [[i, j] for i, j in self._edges if i < j]
        else:
            d["edges"] = [[i, j] for i, j in self._edges if i != j]
        if not self._default_weights:
            d["weights"] = [[i, j, self._w_by_dst[j][i]] for i, j in self._edges]
        return d

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """Serialise to JSON text (several edges per line); also write it to ``path`` if given."""
        d = self.to_dict()
        lines = ["{"]
        items = list(d.items())
        for k, (key, val) in enumerate(items):
            comma = "," if k < len(items) - 1 else ""
            if isinstance(val, list):
                per_line = 1 if key == "nodes" else (4 if key == "weights" else 8)
                atoms = [json.dumps(x).replace(",", ", ").replace(",  ", ", ") if key != "nodes"
                         else json.dumps(x) for x in val]
                if not atoms:
                    lines.append(f"  {json.dumps(key)}: []{comma}")
                    continue
                lines.append(f"  {json.dumps(key)}: [")
                chunks = [atoms[s:s + per_line] for s in range(0, len(atoms), per_line)]
                for c, chunk in enumerate(chunks):
                    tail = "," if c < len(chunks) - 1 else ""
                    lines.append("    " + ", ".join(chunk) + tail)
                lines.append(f"  ]{comma}")
            else:
                lines.append(f"  {json.dumps(key)}: {json.dumps(val)}{comma}")
        lines.append("}")
        text = "\n".join(lines) + "\n"
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, source: str | os.PathLike[str] | Mapping[str, Any]) -> Graph:
        """Load a graph from a file path, a JSON text (starting with ``{``), or a dict.

        Errors are one-line :class:`GraphError`; for files they start with the path.
        """
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        if isinstance(source, str) and source.lstrip().startswith(("{", "[")):
            label, text = None, source
        elif isinstance(source, (str, os.PathLike)):
            label = os.fspath(source)
            try:
                with open(source, encoding="utf-8") as f:
                    text = f.read()
            except FileNotFoundError:
                raise GraphError(f"{label}: no such file") from None
            except IsADirectoryError:
                raise GraphError(f"{label}: is a directory, not a graph file") from None
            except UnicodeDecodeError as exc:
                raise GraphError(f"{label}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
            except OSError as exc:
                raise GraphError(f"{label}: cannot read file: {exc.strerror or exc}") from None
        else:
            raise GraphError(f"cannot load a graph from {type(source).__name__}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            msg = f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            raise GraphError(f"{label}: {msg}" if label else msg) from None
        try:
            return cls.from_dict(data)
        except GraphError as exc:
            if label:
                raise GraphError(f"{label}: {exc}") from None
            raise

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Graph:
        """Build from a dict following the JSON schema (see module docstring)."""
        if not isinstance(data, Mapping):
            raise GraphError(f"top level must be a JSON object, got {type(data).__name__}")
        for key in data:
            if key not in _TOP_LEVEL_KEYS:
                raise GraphError(f"unknown key {_fmt(key)} (allowed: {', '.join(_TOP_LEVEL_KEYS)})")
        name = data.get("name")
        if name is not None and not isinstance(name, str):
            raise GraphError(f"\"name\" must be a string, got {_fmt(name)}")
        undirected = data.get("undirected", False)
        if not isinstance(undirected, bool):
            raise GraphError(f"\"undirected\" must be true or false, got {_fmt(undirected)}")

        # nodes
        if "nodes" not in data:
            raise GraphError("missing key \"nodes\" (a node count or a list of nodes)")
        nodes = data["nodes"]
        machines: list[str | None] | None = None
        if _is_int(nodes):
            n = int(nodes)
            if n < 1:
                raise GraphError(f"\"nodes\": a graph needs at least 1 node, got {n}")
        elif isinstance(nodes, list):
            if not nodes:
                raise GraphError("\"nodes\": empty list, a graph needs at least 1 node")
            ids: list[int] = []
            labels: dict[int, str | None] = {}
            for k, entry in enumerate(nodes):
                if isinstance(entry, Mapping):
                    extra = [x for x in entry if x not in ("id", "machine")]
                    if extra:
                        raise GraphError(f"nodes[{k}]: unknown key {_fmt(extra[0])} (allowed: id, machine)")
                    if "id" not in entry:
                        raise GraphError(f"nodes[{k}]: missing \"id\"")
                    v, m = entry["id"], entry.get("machine")
                    if m is not None and not isinstance(m, str):
                        raise GraphError(f"nodes[{k}]: machine must be a string or null, got {_fmt(m)}")
                else:
                    v, m = entry, None
                if not _is_int(v):
                    raise GraphError(f"nodes[{k}]: node id must be an integer, got {_fmt(v)}")
                v = int(v)
                if v < 0:
                    raise GraphError(f"nodes[{k}]: node id {v} out of range (ids must be 0..{len(nodes) - 1})")
                if v in labels:
                    raise GraphError(f"nodes[{k}]: duplicate node id {v}")
                labels[v] = m
                ids.append(v)
            n = len(ids)
            missing = sorted(set(range(n)) - set(ids))
            if missing:
                raise GraphError(
                    f"\"nodes\": node {missing[0]} is missing (ids must be 0..{n - 1} without gaps; "
                    f"got {', '.join(map(str, sorted(ids)))})"[:300]
                )
            if any(m is not None for m in labels.values()):
                machines = [labels[v] for v in range(n)]
        else:
            raise GraphError(f"\"nodes\" must be a node count or a list, got {_fmt(nodes)}")

        # edges
        if "edges" not in data:
            raise GraphError("missing key \"edges\" (a list of [i, j] pairs; [] for a single node)")
        raw_edges = data["edges"]
        if not isinstance(raw_edges, list):
            raise GraphError(f"\"edges\" must be a list of [i, j] pairs, got {_fmt(raw_edges)}")
        edges: list[tuple[int, int]] = []
        for k, e in enumerate(raw_edges):
            if not isinstance(e, list) or len(e) != 2:
                raise GraphError(f"edges[{k}]: expected a pair [i, j], got {_fmt(e)}")
            i, j = e
            if not (_is_int(i) and _is_int(j)):
                raise GraphError(f"edge {_fmt(e)}: node ids must be integers")
            edges.append((i, j))
            if undirected:
                edges.append((j, i))

        # weights
        weights: dict[tuple[int, int], float] | None = None
        raw_w = data.get("weights")
        if raw_w is not None:
            weights = {}
            if isinstance(raw_w, list):
                for k, item in enumerate(raw_w):
                    if not isinstance(item, list) or len(item) != 3:
                        raise GraphError(f"weights[{k}]: expected [i, j, w], got {_fmt(item)}")
                    i, j, w = item
                    if not (_is_int(i) and _is_int(j)):
                        raise GraphError(f"weights[{k}]: node ids must be integers, got {_fmt(item)}")
                    if (i, j) in weights:
                        raise GraphError(f"weight {_fmt_edge(i, j)}: given twice")
                    weights[(i, j)] = w
            elif isinstance(raw_w, Mapping):
                for key, w in raw_w.items():
                    m_ = _WEIGHT_KEY_RE.match(key)
                    if not m_:
                        raise GraphError(f"weights: bad key {_fmt(key)} (expected \"i->j\")")
                    ij = (int(m_.group(1)), int(m_.group(2)))
                    if ij in weights:
                        raise GraphError(f"weight {_fmt_edge(*ij)}: given twice")
                    weights[ij] = w
            else:
                raise GraphError(f"\"weights\" must be a list of [i, j, w] or an object {{\"i->j\": w}}, "
                                 f"got {_fmt(raw_w)}")
        return cls(n, edges, weights=weights, machines=machines, name=name)
