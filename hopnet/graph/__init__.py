"""Communication graphs for decentralized training.

A :class:`Graph` is a directed graph over nodes ``0..n-1``. Edge ``(i, j)`` means
*i sends to j*. Every node has a self-loop (added automatically), so the
in-neighbours ``N_in(j)`` of ``j`` include ``j`` itself. Each edge carries a
weight ``W[i][j] >= 0`` used by the receiver: ``x_j = sum_{i in N_in(j)} W[i][j] x_i``,
so every column sums to 1 over the in-edges. The default is Hop's Eq. 1,
``W[i][j] = 1 / |N_in(j)|``. A graph must be strongly connected.

JSON schema (see ``docs/reference/graph-schema.md``)::

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

The package's modules:

- ``core``: the :class:`Graph` class (its structure, its accessors, equality);
- ``arguments``: the constructor's arguments as a value, and how user input shows in errors;
- ``validation``: the constructor's checks (edges, weights, machines, connectivity);
- ``builders``: the named graphs (``ring:8``, ``torus:2x4``, ``hierarchical:4,4``...);
- ``json_io``: the JSON schema, read and written;
- ``analysis``: path lengths, the two-colouring, the spectral gap;
- ``reform``: how each builder re-forms for another number of members;
- ``members``: :class:`MemberGraph`, a graph over a run's member ranks (``Graph.over_members``);
- ``source``: :class:`GraphSource`, what ``--graph`` was (a builder that re-forms, or a fixed graph).
"""

from hopnet.graph.core import Graph
from hopnet.graph.members import MemberGraph
from hopnet.graph.source import GraphSource

__all__ = ["Graph", "GraphSource", "MemberGraph"]
