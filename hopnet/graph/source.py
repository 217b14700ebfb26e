"""What a run's ``--graph`` was: a builder that re-forms over any member list, or a fixed graph.

A builder spec (``ring``, ``ring:8``, ``torus``, ``hierarchical:4,4``...) re-forms when members
join or leave (:mod:`hopnet.graph.reform`). A JSON file, or a :class:`Graph` handed over as an
object, is the graph of its own nodes only: it serves the members ``0..n-1`` it was written for
and refuses any other member set with one line."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hopnet.errors import ConfigError, GraphError
from hopnet.graph.core import Graph
from hopnet.graph.members import MemberGraph, member_ranks
from hopnet.graph.reform import KINDS, BuilderSpec

DEFAULT_KIND = "ring"
"""The builder of a run given no ``--graph``."""


def _names_a_file(text: str) -> bool:
    """Whether ``--graph TEXT`` is a JSON file, as :meth:`Graph.load` decides (a bare kind aside)."""
    if os.path.exists(text) or text.endswith(".json"):
        return True
    return ":" not in text and text.strip().lower().replace("-", "_") not in KINDS


@dataclass(frozen=True)
class GraphSource:
    """A run's graph as given: ``builder`` when it re-forms, else the ``fixed`` graph.

    ``label`` is how the user gave it (``--graph ring.json``), for messages.
    """

    label: str
    builder: BuilderSpec | None = None
    fixed: Graph | None = None

    @classmethod
    def from_argument(cls, graph: Graph | str | os.PathLike[str] | None) -> GraphSource:
        """``--graph`` (or ``graph=``): None is a ring, a :class:`Graph` or a JSON path is fixed,
        a spec (``ring``, ``ring:8``, ``torus:2x4``...) is a builder. Errors are one line."""
        if graph is None:
            return cls(f"--graph {DEFAULT_KIND}", builder=BuilderSpec.parse(DEFAULT_KIND))
        if isinstance(graph, Graph):
            return cls(f"the graph {graph.name}" if graph.name else "the graph given", fixed=graph)
        text = os.fspath(graph)
        if _names_a_file(text):
            return cls(f"--graph {text}", fixed=Graph.load(text))
        return cls(f"--graph {text}", builder=BuilderSpec.parse(text))

    @property
    def resizable(self) -> bool:
        """Whether members may join and leave (the graph re-forms over them)."""
        return self.builder is not None

    @property
    def nodes(self) -> int | None:
        """The size the graph names: a fixed graph's, a sized spec's (``ring:8``); None for a bare kind."""
        return self.fixed.n if self.fixed is not None else self.builder.nodes if self.builder else None

    def for_members(self, members: Iterable[int], machines: Mapping[int, str] | None = None) -> MemberGraph:
        """The graph over ``members`` (any order), with each member's machine if given.

        A fixed graph takes only its own nodes ``0..n-1`` (its machines are its own); any
        other member set raises :class:`ConfigError`.
        """
        if self.builder is not None:
            return MemberGraph.build(self.builder, members, machines)
        assert self.fixed is not None
        ranks = member_ranks(members)
        if ranks != tuple(range(self.fixed.n)):
            raise ConfigError(f"{self.label} is a fixed graph of {self.fixed.n} nodes: it cannot take "
                              f"members joining or leaving (use a builder such as --graph {self._suggested_kind()})")
        return MemberGraph(self.fixed, ranks)

    def _suggested_kind(self) -> str:
        """The builder the fixed graph's name says it came from (``ring:4``: ring), else a ring."""
        assert self.fixed is not None
        try:
            return BuilderSpec.parse(self.fixed.name).kind if self.fixed.name else DEFAULT_KIND
        except GraphError:
            return DEFAULT_KIND


__all__ = ["DEFAULT_KIND", "GraphSource"]
