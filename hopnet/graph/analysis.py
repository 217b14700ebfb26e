"""What a graph's shape implies: reachability, path lengths, a two-colouring, the spectral gap.

Functions of a graph's neighbour lists (or its weight matrix); :class:`~hopnet.graph.Graph`
calls them and caches what they return."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

Neighbours = Sequence[Sequence[int]]

DENSE_MIN_NODES = 64  # above this many nodes and ...
DENSE_MIN_EDGES_PER_NODE = 16  # ... this many edges per node, path lengths come from matrix products


def reach(src: int, adj: Neighbours) -> set[int]:
    """The nodes reachable from ``src`` along ``adj`` (``src`` included)."""
    seen = {src}
    stack = [src]
    while stack:
        u = stack.pop()
        for v in adj[u]:
            if v not in seen:
                seen.add(v)
                stack.append(v)
    return seen


def two_colouring(n: int, peers: Neighbours) -> tuple[tuple[int, ...], tuple[int, ...]] | list[int]:
    """Two sides with every edge between them, or an odd cycle (see ``Graph.two_colouring``)."""
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
            for v in peers[u]:
                if colour[v] is None:
                    colour[v], parent[v], depth[v] = 1 - colour[u], u, depth[u] + 1  # type: ignore[operator]
                    queue.append(v)
                elif colour[v] == colour[u]:
                    return odd_cycle(u, v, parent, depth)
    side_a = tuple(v for v in range(n) if colour[v] == 0)
    side_b = tuple(v for v in range(n) if colour[v] == 1)
    return side_a, side_b


def odd_cycle(u: int, v: int, parent: list[int], depth: list[int]) -> list[int]:
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


def path_lengths(n: int, edges: Sequence[tuple[int, int]], out_peers: Neighbours) -> np.ndarray:
    """``n x n`` hop counts from i to j; by matrix products on a large dense graph, else by BFS."""
    if len(edges) > DENSE_MIN_EDGES_PER_NODE * n and n > DENSE_MIN_NODES:
        return path_lengths_dense(n, edges)
    return path_lengths_bfs(n, out_peers)


def path_lengths_bfs(n: int, out_peers: Neighbours) -> np.ndarray:
    rows = []
    for s in range(n):
        dist = [-1] * n
        dist[s] = 0
        q = deque((s,))
        pop, push = q.popleft, q.append
        while q:
            u = pop()
            du = dist[u] + 1
            for v in out_peers[u]:
                if dist[v] < 0:
                    dist[v] = du
                    push(v)
        rows.append(dist)
    return np.array(rows, dtype=np.int64)


def path_lengths_dense(n: int, edges: Sequence[tuple[int, int]]) -> np.ndarray:
    # Level-synchronous BFS from all sources at once: frontier @ adjacency.
    adj = np.zeros((n, n), dtype=np.float32)
    idx = np.array(edges, dtype=np.int64)
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


def back_lengths_bfs(n: int, in_peers: Neighbours, out_peers: Neighbours) -> dict[tuple[int, int], int]:
    """For each edge (u, v) between two workers, the hop count from v back to u: a BFS from
    each node that stops once it has reached all its in-neighbours."""
    back: dict[tuple[int, int], int] = {}
    for s in range(n):
        wanted = set(in_peers[s])
        dist = {s: 0}
        q = deque((s,))
        while wanted:
            u = q.popleft()
            du = dist[u] + 1
            for v in out_peers[u]:
                if v not in dist:
                    dist[v] = du
                    q.append(v)
                    if v in wanted:
                        back[(v, s)] = du
                        wanted.discard(v)
    return back


def spectral_gap(weights: np.ndarray) -> float:
    """``|lambda_1| - |lambda_2|`` of a weight matrix, eigenvalues ordered by modulus (1.0 for 1 x 1)."""
    if len(weights) == 1:
        return 1.0
    mods = np.sort(np.abs(np.linalg.eigvals(weights)))[::-1]
    return float(mods[0] - mods[1])


def is_doubly_stochastic(weights: np.ndarray, tol: float) -> bool:
    return bool(
        np.all(np.abs(weights.sum(axis=0) - 1.0) <= tol) and np.all(np.abs(weights.sum(axis=1) - 1.0) <= tol)
    )
