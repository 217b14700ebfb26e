"""The named graphs (ring, ring-based, double ring, complete, torus, exponential, hierarchical)
and the ``KIND:ARG`` specs that name them (``ring:8``, ``torus:2x4``, ``hierarchical:4,4``).

Each builder returns the constructor's arguments; ``Graph.ring(8)`` and the others build them."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from hopnet.errors import GraphError
from hopnet.graph.arguments import GraphArgs, is_int, render

SPEC_USAGE = ("expected one of ring:N, ring_based:N, double_ring:N, complete:N, exponential:N, "
              "torus:RxC, hierarchical:A,B,...")


def node_count(kind: str, n: Any, minimum: int = 1) -> int:
    if not is_int(n):
        raise GraphError(f"{kind}: number of nodes must be an integer, got {render(n)}")
    if n < minimum:
        raise GraphError(f"{kind}: needs at least {minimum} node{'s' if minimum > 1 else ''}, got {n}")
    return int(n)


def undirected(n: int, pairs: Iterable[tuple[int, int]], name: str,
               machines: Sequence[str | None] | None = None) -> GraphArgs:
    """Each pair as edges both ways (a pair of a node with itself is left to the self-loop)."""
    edges: set[tuple[int, int]] = set()
    for i, j in pairs:
        if i != j:
            edges.add((i, j))
            edges.add((j, i))
    return GraphArgs(n, edges, machines=machines, name=name)


def ring(n: int) -> GraphArgs:
    n = node_count("ring", n)
    return undirected(n, ((i, (i + 1) % n) for i in range(n)), f"ring:{n}")


def ring_based(n: int) -> GraphArgs:
    n = node_count("ring_based", n)
    pairs = [(i, (i + 1) % n) for i in range(n)] + [(i, (i + n // 2) % n) for i in range(n)]
    return undirected(n, pairs, f"ring_based:{n}")


def double_ring(n: int) -> GraphArgs:
    n = node_count("double_ring", n, 4)
    if n % 2:
        raise GraphError(f"double_ring: needs an even number of nodes, got {n}")
    h = n // 2
    pairs = list(ring_based(h).edges)
    pairs += [(i + h, j + h) for i, j in pairs]
    pairs += [(i, i + h) for i in range(h)]
    return undirected(n, pairs, f"double_ring:{n}")


def complete(n: int) -> GraphArgs:
    n = node_count("complete", n)
    return GraphArgs(n, [(i, j) for i in range(n) for j in range(n) if i != j], name=f"complete:{n}")


def torus(rows: int, cols: int) -> GraphArgs:
    rows = node_count("torus rows", rows)
    cols = node_count("torus cols", cols)
    pairs = []
    for r in range(rows):
        for c in range(cols):
            v = r * cols + c
            pairs.append((v, r * cols + (c + 1) % cols))
            pairs.append((v, ((r + 1) % rows) * cols + c))
    return undirected(rows * cols, pairs, f"torus:{rows}x{cols}")


def exponential(n: int) -> GraphArgs:
    n = node_count("exponential", n)
    edges = []
    for i in range(n):
        k = 1
        while k < n:
            edges.append((i, (i + k) % n))
            k *= 2
    return GraphArgs(n, edges, name=f"exponential:{n}")


def _group_members(groups: Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
    """The node ids of each group, from group sizes or from lists covering 0..n-1 once."""
    members: list[list[int]] = []
    sizes = [g for g in groups if isinstance(g, (int, np.integer)) and is_int(g)]
    if len(sizes) == len(groups):
        start = 0
        for k, size in enumerate(sizes):
            if size < 1:
                raise GraphError(f"hierarchical: group {k} has size {size}, needs at least 1")
            members.append(list(range(start, start + int(size))))
            start += int(size)
        return members
    for k, g in enumerate(groups):
        if isinstance(g, (str, bytes)) or not isinstance(g, Sequence) or not g:
            raise GraphError(f"hierarchical: group {k} must be a size or a non-empty list of node ids, "
                             f"got {render(g)}")
        if not all(is_int(v) for v in g):
            raise GraphError(f"hierarchical: group {k}: node ids must be integers, got {render(list(g))}")
        members.append([int(v) for v in g])
    flat = [v for g in members for v in g]
    seen: set[int] = set()
    for v in flat:
        if v in seen:
            raise GraphError(f"hierarchical: node {v} is in more than one group")
        seen.add(v)
    n = len(flat)
    for v in flat:
        if not 0 <= v < n:
            raise GraphError(f"hierarchical: node {v} out of range (groups have {n} nodes, ids 0..{n - 1})")
    return members


def hierarchical(groups: Sequence[int] | Sequence[Sequence[int]]) -> GraphArgs:
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise GraphError(f"hierarchical: groups must be a non-empty list, got {render(groups)}")
    members = _group_members(groups)
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
    if all(is_int(g) for g in groups):
        name = "hierarchical:" + ",".join(str(len(g)) for g in members)
    else:
        name = "hierarchical"
    return undirected(n, pairs, name, machines=machines)


BY_NODE_COUNT: dict[str, Callable[[int], GraphArgs]] = {
    "ring": ring,
    "ring_based": ring_based,
    "double_ring": double_ring,
    "complete": complete,
    "exponential": exponential,
}


def by_name(spec: str) -> GraphArgs:
    """The graph a ``KIND:ARG`` spec names."""
    if not isinstance(spec, str) or ":" not in spec:
        raise GraphError(f"bad graph spec {render(spec)} ({SPEC_USAGE})")
    kind, _, arg = spec.partition(":")
    kind = kind.strip().lower().replace("-", "_")
    arg = arg.strip()

    def ints(text: str, sep: str) -> list[int]:
        parts = text.split(sep)
        if not all(re.fullmatch(r"\d+", p.strip()) for p in parts):
            raise GraphError(f"bad graph spec {render(spec)} ({SPEC_USAGE})")
        return [int(p) for p in parts]

    if kind in BY_NODE_COUNT:
        if not re.fullmatch(r"\d+", arg):
            raise GraphError(f"bad graph spec {render(spec)} ({kind} needs a node count, e.g. {kind}:8)")
        return BY_NODE_COUNT[kind](int(arg))
    if kind == "torus":
        dims = ints(arg.lower(), "x")
        if len(dims) != 2:
            raise GraphError(f"bad graph spec {render(spec)} (torus needs ROWSxCOLS, e.g. torus:2x4)")
        return torus(dims[0], dims[1])
    if kind == "hierarchical":
        return hierarchical(ints(arg, ","))
    raise GraphError(f"unknown graph kind {render(kind)} in spec {render(spec)} ({SPEC_USAGE})")
