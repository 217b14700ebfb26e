"""``hopnet graph``: validate, inspect and generate communication graphs.

    hopnet graph validate G.json        -> "G.json: ok (N nodes, E edges)"
    hopnet graph show G.json|SPEC [--json]
    hopnet graph make SPEC [-o FILE]    (SPEC like ring:8, torus:2x4, hierarchical:4,4)

Edge counts are directed edges without self-loops. Errors are one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from hopnet.errors import GraphError

if TYPE_CHECKING:
    from hopnet.graph import Graph

NAME = "graph"
HELP = "validate, inspect or generate a communication graph"

SPEC_HELP = ("builder spec: ring:N, ring_based:N, double_ring:N, complete:N, exponential:N, "
             "torus:RxC, hierarchical:A,B,...")


def register(subparsers: Any) -> None:
    """Add the ``graph`` subcommand and its ``validate`` / ``show`` / ``make`` actions."""
    parser = subparsers.add_parser(
        NAME, help=HELP,
        description="Validate, inspect or generate a communication graph (JSON schema: docs/reference/graph-schema.md).",
    )
    sub = parser.add_subparsers(dest="graph_command", metavar="ACTION")
    sub.required = True

    p = sub.add_parser("validate", help="check a graph JSON file",
                       description="Check a graph JSON file; prints 'FILE: ok (N nodes, E edges)'.")
    p.add_argument("file", metavar="G.json")
    p.set_defaults(func=_validate)

    p = sub.add_parser("show", help="print a graph's properties",
                       description="Print nodes, edges, degrees, diameter, spectral gap and machines.")
    p.add_argument("graph", metavar="G.json|SPEC", help=f"a graph JSON file or a {SPEC_HELP}")
    p.add_argument("--json", action="store_true", help="print the properties as JSON")
    p.set_defaults(func=_show)

    p = sub.add_parser("make", help="write a builder's graph as JSON",
                       description=f"Write a built-in graph as JSON. SPEC is a {SPEC_HELP}.")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.set_defaults(func=_make)


def _validate(args: argparse.Namespace) -> int:
    from hopnet.graph import Graph

    g = Graph.load(args.file)
    print(f"{args.file}: ok ({g.n} nodes, {g.num_edges} edges)")
    return 0


def summary(g: Graph) -> dict[str, Any]:
    """Properties shown by ``hopnet graph show`` as a JSON-ready dict."""
    degs = g.degrees()
    machines: dict[str, list[int]] = {}
    for v in g.nodes:
        m = g.machine(v)
        if m is not None:
            machines.setdefault(m, []).append(v)
    return {
        "name": g.name,
        "nodes": g.n,
        "edges": g.num_edges,
        "undirected": g.is_undirected(),
        "in_degree": [d[0] for d in degs],
        "out_degree": [d[1] for d in degs],
        "diameter": g.diameter(),
        "spectral_gap": round(g.spectral_gap(), 6),
        "doubly_stochastic": g.is_doubly_stochastic(),
        "default_weights": g.has_default_weights,
        "machines": machines or None,
    }


def _degree_text(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    if lo == hi:
        return f"{lo} (every node)"
    if len(values) <= 16:
        return " ".join(f"{v}:{d}" for v, d in enumerate(values))
    return f"min {lo}, max {hi}"


def _ranges(ids: list[int]) -> str:
    out: list[str] = []
    start = prev = ids[0]
    for v in [*ids[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(out)


def _show(args: argparse.Namespace) -> int:
    from hopnet.graph import Graph

    g = Graph.load(args.graph)
    s = summary(g)
    if args.json:
        print(json.dumps(s))
        return 0
    lines = []
    if s["name"]:
        lines.append(f"name:              {s['name']}")
    lines += [
        f"nodes:             {s['nodes']}",
        f"edges:             {s['edges']} directed"
        + (f" ({s['edges'] // 2} bidirectional links)" if s["undirected"] else "") + ", self-loops not counted",
        f"in-degree:         {_degree_text(s['in_degree'])}",
        f"out-degree:        {_degree_text(s['out_degree'])}",
        f"diameter:          {s['diameter']}",
        f"spectral gap:      {s['spectral_gap']:.4f}",
        f"doubly stochastic: {'yes' if s['doubly_stochastic'] else 'no'}",
        f"weights:           {'default (1/|N_in(j)|)' if s['default_weights'] else 'custom'}",
    ]
    if s["machines"]:
        lines.append("machines:          " + "; ".join(f"{m}: {_ranges(ids)}" for m, ids in s["machines"].items()))
    print("\n".join(lines))
    return 0


def _make(args: argparse.Namespace) -> int:
    from hopnet.graph import Graph

    g = Graph.by_name(args.spec)
    if args.output:
        try:
            g.to_json(args.output)
        except OSError as exc:
            raise GraphError(f"{args.output}: cannot write file: {exc.strerror or exc}") from None
        print(f"wrote {args.output} ({g.n} nodes, {g.num_edges} edges)", file=sys.stderr)
    else:
        sys.stdout.write(g.to_json())
    return 0
