"""A graph in JSON (the schema is in the package's docstring and ``docs/reference/graph-schema.md``):
read from a file, a text or a dict into the constructor's arguments, and written back."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hopnet.errors import GraphError
from hopnet.graph.arguments import GraphArgs, is_int, render, render_edge

if TYPE_CHECKING:
    from hopnet.graph.core import Graph

TOP_LEVEL_KEYS = ("name", "nodes", "undirected", "edges", "weights")
WEIGHT_KEY_RE = re.compile(r"^\s*(-?\d+)\s*->\s*(-?\d+)\s*$")


# ------------------------------------------------------------------------- writing
def to_dict(graph: Graph) -> dict[str, Any]:
    """JSON-ready dict: undirected graphs list each edge once, default weights are left out."""
    d: dict[str, Any] = {}
    if graph.name is not None:
        d["name"] = graph.name
    if all(m is None for m in graph.machines):
        d["nodes"] = graph.n
    else:
        d["nodes"] = [{"id": v, "machine": m} if m is not None else {"id": v}
                      for v, m in enumerate(graph.machines)]
    edges = graph.edges
    if graph.is_undirected():
        d["undirected"] = True
        d["edges"] = [[i, j] for i, j in edges if i < j]
    else:
        d["edges"] = [[i, j] for i, j in edges if i != j]
    if not graph.has_default_weights:
        d["weights"] = [[i, j, graph.weight(i, j)] for i, j in edges]
    return d


def to_text(d: Mapping[str, Any]) -> str:
    """A graph's dict as JSON text with several edges per line."""
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
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------- reading
def write_atomic(text: str, path: str | os.PathLike[str]) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and a rename."""
    tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def read(source: str | os.PathLike[str]) -> tuple[str | None, Any]:
    """``(label, data)`` from a JSON text (label None) or a file (label its path)."""
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
        return label, json.loads(text)
    except json.JSONDecodeError as exc:
        msg = f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        raise GraphError(f"{label}: {msg}" if label else msg) from None


def from_dict(data: Mapping[str, Any]) -> GraphArgs:
    """The constructor's arguments a dict of the schema gives (checked as far as JSON goes)."""
    if not isinstance(data, Mapping):
        raise GraphError(f"top level must be a JSON object, got {type(data).__name__}")
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise GraphError(f"unknown key {render(key)} (allowed: {', '.join(TOP_LEVEL_KEYS)})")
    name = data.get("name")
    if name is not None and not isinstance(name, str):
        raise GraphError(f"\"name\" must be a string, got {render(name)}")
    undirected = data.get("undirected", False)
    if not isinstance(undirected, bool):
        raise GraphError(f"\"undirected\" must be true or false, got {render(undirected)}")
    n, machines = _nodes(data)
    edges = _edges(data, undirected)
    weights = _weights(data.get("weights"))
    return GraphArgs(n, edges, weights=weights, machines=machines, name=name)


def _nodes(data: Mapping[str, Any]) -> tuple[int, list[str | None] | None]:
    """The node count, and the machine labels when any node has one."""
    if "nodes" not in data:
        raise GraphError("missing key \"nodes\" (a node count or a list of nodes)")
    nodes = data["nodes"]
    if is_int(nodes):
        n = int(nodes)
        if n < 1:
            raise GraphError(f"\"nodes\": a graph needs at least 1 node, got {n}")
        return n, None
    if not isinstance(nodes, list):
        raise GraphError(f"\"nodes\" must be a node count or a list, got {render(nodes)}")
    if not nodes:
        raise GraphError("\"nodes\": empty list, a graph needs at least 1 node")
    ids: list[int] = []
    labels: dict[int, str | None] = {}
    for k, entry in enumerate(nodes):
        if isinstance(entry, Mapping):
            extra = [x for x in entry if x not in ("id", "machine")]
            if extra:
                raise GraphError(f"nodes[{k}]: unknown key {render(extra[0])} (allowed: id, machine)")
            if "id" not in entry:
                raise GraphError(f"nodes[{k}]: missing \"id\"")
            v, m = entry["id"], entry.get("machine")
            if m is not None and not isinstance(m, str):
                raise GraphError(f"nodes[{k}]: machine must be a string or null, got {render(m)}")
        else:
            v, m = entry, None
        if not is_int(v):
            raise GraphError(f"nodes[{k}]: node id must be an integer, got {render(v)}")
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
        return n, [labels[v] for v in range(n)]
    return n, None


def _edges(data: Mapping[str, Any], undirected: bool) -> list[tuple[int, int]]:
    if "edges" not in data:
        raise GraphError("missing key \"edges\" (a list of [i, j] pairs; [] for a single node)")
    raw_edges = data["edges"]
    if not isinstance(raw_edges, list):
        raise GraphError(f"\"edges\" must be a list of [i, j] pairs, got {render(raw_edges)}")
    edges: list[tuple[int, int]] = []
    for k, e in enumerate(raw_edges):
        if not isinstance(e, list) or len(e) != 2:
            raise GraphError(f"edges[{k}]: expected a pair [i, j], got {render(e)}")
        i, j = e
        if not (is_int(i) and is_int(j)):
            raise GraphError(f"edge {render(e)}: node ids must be integers")
        edges.append((i, j))
        if undirected:
            edges.append((j, i))
    return edges


def _weights(raw: Any) -> dict[tuple[int, int], float] | None:
    """``[[i, j, w], ..]`` or ``{"i->j": w}`` as ``{(i, j): w}`` (the values checked by the class)."""
    if raw is None:
        return None
    weights: dict[tuple[int, int], float] = {}
    if isinstance(raw, list):
        for k, item in enumerate(raw):
            if not isinstance(item, list) or len(item) != 3:
                raise GraphError(f"weights[{k}]: expected [i, j, w], got {render(item)}")
            i, j, w = item
            if not (is_int(i) and is_int(j)):
                raise GraphError(f"weights[{k}]: node ids must be integers, got {render(item)}")
            if (i, j) in weights:
                raise GraphError(f"weight {render_edge(i, j)}: given twice")
            weights[(i, j)] = w
    elif isinstance(raw, Mapping):
        for key, w in raw.items():
            m = WEIGHT_KEY_RE.match(key)
            if not m:
                raise GraphError(f"weights: bad key {render(key)} (expected \"i->j\")")
            ij = (int(m.group(1)), int(m.group(2)))
            if ij in weights:
                raise GraphError(f"weight {render_edge(*ij)}: given twice")
            weights[ij] = w
    else:
        raise GraphError(f"\"weights\" must be a list of [i, j, w] or an object {{\"i->j\": w}}, "
                         f"got {render(raw)}")
    return weights
