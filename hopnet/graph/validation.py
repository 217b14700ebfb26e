"""The checks Graph's constructor makes, each returning what it checked in the form the class keeps.

Each problem is a one-line :class:`~hopnet.errors.GraphError` naming the node or edge."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hopnet.errors import GraphError
from hopnet.graph.analysis import reach
from hopnet.graph.arguments import is_int, is_number, render, render_edge

NORM_TOL = 1e-6  # how far a node's in-weights may sum from 1

Neighbours = tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class Adjacency:
    """A graph's edges, self-loops included, and each node's neighbours, all sorted."""

    edges: tuple[tuple[int, int], ...]
    ins: Neighbours  # senders to each node, itself included
    outs: Neighbours  # receivers from each node, itself included
    in_peers: Neighbours  # ins without the node itself
    out_peers: Neighbours
    peers: Neighbours  # in_peers and out_peers together
    in_sets: tuple[frozenset[int], ...]
    out_sets: tuple[frozenset[int], ...]


@dataclass(frozen=True, slots=True)
class MixingWeights:
    """``W[i][j]`` per receiver j, in the order of its in-neighbours."""

    by_receiver: tuple[dict[int, float], ...]  # receiver j -> {sender i: W[i][j]}
    per_receiver: tuple[tuple[float, ...], ...]
    all_default: bool  # every weight is Hop's 1 / |N_in(j)|


def node_count(n: Any) -> int:
    if not is_int(n):
        raise GraphError(f"number of nodes must be an integer, got {render(n)}")
    n = int(n)
    if n < 1:
        raise GraphError(f"a graph needs at least 1 node, got {n}")
    return n


def check_name(name: Any) -> None:
    if name is not None and not isinstance(name, str):
        raise GraphError(f"graph name must be a string, got {render(name)}")


def adjacency(n: int, edges: Iterable[tuple[int, int]]) -> Adjacency:
    """The edges checked, self-loops added, and sorted into each node's neighbours."""
    # Edges are kept as codes i * n + j while validating (fast for 1M-edge graphs).
    codes: set[int] = set(range(0, n * n, n + 1))  # self-loops
    add = codes.add
    for e in edges:
        try:
            i, j = e
        except (TypeError, ValueError):
            raise GraphError(f"edge {render(e)}: expected a pair [i, j]") from None
        if type(i) is int and type(j) is int and 0 <= i < n and 0 <= j < n:
            add(i * n + j)
            continue
        for v in (i, j):
            if not is_int(v):
                raise GraphError(f"edge {render_edge(render(i), render(j))}: node id {render(v)} is not an integer")
            if not 0 <= v < n:
                raise GraphError(f"edge {render_edge(i, j)}: node {v} out of range (graph has {n} nodes)")
        add(int(i) * n + int(j))
    arr = np.fromiter(codes, dtype=np.int64, count=len(codes))
    arr.sort()
    src, dst = arr // n, arr % n
    cuts = np.cumsum(np.bincount(src, minlength=n))[:-1]
    outs = tuple(tuple(x.tolist()) for x in np.split(dst, cuts))
    order = np.lexsort((src, dst))
    cuts = np.cumsum(np.bincount(dst, minlength=n))[:-1]
    ins = tuple(tuple(x.tolist()) for x in np.split(src[order], cuts))
    in_peers = tuple(tuple(u for u in ins[v] if u != v) for v in range(n))
    out_peers = tuple(tuple(u for u in outs[v] if u != v) for v in range(n))
    return Adjacency(
        edges=tuple(zip(src.tolist(), dst.tolist())),
        ins=ins,
        outs=outs,
        in_peers=in_peers,
        out_peers=out_peers,
        peers=tuple(tuple(sorted(set(in_peers[v]).union(out_peers[v]))) for v in range(n)),
        in_sets=tuple(frozenset(x) for x in ins),
        out_sets=tuple(frozenset(x) for x in outs),
    )


def _given_weights(n: int, adj: Adjacency, weights: Any) -> dict[tuple[int, int], float]:
    """The weights a user gave, each on an existing edge, finite and non-negative."""
    given: dict[tuple[int, int], float] = {}
    if weights is None:
        return given
    if not isinstance(weights, Mapping):
        raise GraphError(f"weights must be a mapping {{(i, j): w}}, got {type(weights).__name__}")
    for key, w in weights.items():
        try:
            i, j = key
        except (TypeError, ValueError):
            raise GraphError(f"weight key {render(key)}: expected a pair (i, j)") from None
        if not (is_int(i) and is_int(j)):
            raise GraphError(f"weight {render_edge(render(i), render(j))}: node ids must be integers")
        i, j = int(i), int(j)
        if not (0 <= j < n and i in adj.in_sets[j]):
            for v in (i, j):
                if not 0 <= v < n:
                    raise GraphError(f"weight {render_edge(i, j)}: node {v} out of range (graph has {n} nodes)")
            raise GraphError(f"weight {render_edge(i, j)}: no such edge")
        if not is_number(w) or not math.isfinite(float(w)):
            raise GraphError(f"weight {render_edge(i, j)}: weight must be a finite number, got {render(w)}")
        if w < 0:
            raise GraphError(f"weight {render_edge(i, j)}: negative weight {w}")
        given[(i, j)] = float(w)
    return given


def mixing_weights(n: int, adj: Adjacency, weights: Mapping[tuple[int, int], float] | None) -> MixingWeights:
    """Each receiver's weights: all given (summing to 1) or all Hop's default ``1 / |N_in(j)|``."""
    given = _given_weights(n, adj, weights)
    custom = [False] * n
    for (_, j) in given:
        custom[j] = True
    by_receiver: list[dict[int, float]] = []
    per_receiver: list[tuple[float, ...]] = []
    for j in range(n):
        if custom[j]:
            missing = [i for i in adj.ins[j] if (i, j) not in given]
            if missing:
                raise GraphError(
                    f"node {j}: weights given for some in-edges but not for edge "
                    f"{render_edge(missing[0], j)} (give all or none of a node's in-weights, self-loop included)"
                )
            ws = tuple(given[(i, j)] for i in adj.ins[j])
            total = math.fsum(ws)
            if abs(total - 1.0) > NORM_TOL:
                raise GraphError(f"node {j}: in-weights sum to {total:.6g}, not 1")
        else:
            d = 1.0 / len(adj.ins[j])
            ws = (d,) * len(adj.ins[j])
        per_receiver.append(ws)
        by_receiver.append(dict(zip(adj.ins[j], ws)))
    all_default = not any(custom) or all(w == 1.0 / len(ws) for ws in per_receiver for w in ws)
    return MixingWeights(tuple(by_receiver), tuple(per_receiver), all_default)


def machine_labels(n: int, machines: Sequence[str | None] | None) -> tuple[str | None, ...]:
    """One machine label (or None) per node."""
    if machines is None:
        return (None,) * n
    labels = tuple(machines)
    if len(labels) != n:
        raise GraphError(f"machines: expected {n} labels (one per node), got {len(labels)}")
    for v, m in enumerate(labels):
        if m is not None and not isinstance(m, str):
            raise GraphError(f"node {v}: machine must be a string or null, got {render(m)}")
    return labels


def check_strongly_connected(n: int, adj: Adjacency) -> None:
    fwd = reach(0, adj.outs)
    if len(fwd) < n:
        bad = min(set(range(n)) - fwd)
        raise GraphError(f"graph is not strongly connected: node {bad} cannot be reached from node 0")
    bwd = reach(0, adj.ins)
    if len(bwd) < n:
        bad = min(set(range(n)) - bwd)
        raise GraphError(f"graph is not strongly connected: node {bad} cannot reach node 0")
