"""A builder spec as a rule that re-forms its graph for any number of members.

``ring:8`` names a ring of 8; as a rule it is "a ring", built again for every member count.
A bare kind (``ring``, ``torus``, ``hierarchical``) names the rule alone. Each kind re-forms:

- ``ring``, ``ring_based``, ``complete``, ``exponential``: over any count (the ``:N`` of the
  spec is the size a run starts with);
- ``double_ring``: over an even count of at least 4, and refuses any other;
- ``torus:RxC``: over R*C only (its shape is fixed) and refuses any other count, naming the one
  it takes; a bare ``torus`` re-forms to the squarest ``RxC`` of the count (rows <= cols, so a
  prime count gives a ``1xN`` ring);
- ``hierarchical``: groups follow the members' machines when they are given (one group per
  machine, groups ordered by their lowest member); without machines ``hierarchical:A,B,...``
  takes A+B+... members only, and a bare ``hierarchical`` refuses.

Every refusal is a one-line :class:`~hopnet.errors.GraphError`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hopnet.errors import GraphError
from hopnet.graph.arguments import GraphArgs, render
from hopnet.graph.builders import BY_NODE_COUNT, SPEC_USAGE, by_name, hierarchical, torus

KINDS = (*BY_NODE_COUNT, "torus", "hierarchical")
"""The builders a spec can name, each of which re-forms over a member list."""


def squarest(n: int) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows * cols == n``, ``rows <= cols`` and rows as large as that allows."""
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return rows, n // rows


def machine_groups(machines: Sequence[str]) -> list[list[int]]:
    """The positions on each machine, one group per machine, ordered by each group's first position."""
    groups: dict[str, list[int]] = {}
    for position, machine in enumerate(machines):
        groups.setdefault(machine, []).append(position)
    return list(groups.values())


@dataclass(frozen=True)
class BuilderSpec:
    """A named builder (``kind``) and its argument as given (``arg``, ``""`` for a bare kind)."""

    kind: str
    arg: str = ""
    nodes: int | None = None
    """The number of nodes the spec names (``ring:8``: 8); None for a bare kind."""

    @classmethod
    def parse(cls, spec: str) -> BuilderSpec:
        """``KIND`` or ``KIND:ARG``; a bad spec raises the one-line error :func:`by_name` gives."""
        if not isinstance(spec, str):
            raise GraphError(f"bad graph spec {render(spec)} ({SPEC_USAGE})")
        kind, colon, arg = spec.partition(":")
        kind = kind.strip().lower().replace("-", "_")
        if colon:
            nodes = by_name(spec).n  # checks the kind and the argument
            return cls(kind, arg.strip().lower().replace(" ", ""), nodes)
        if kind not in KINDS:
            raise GraphError(f"unknown graph kind {render(kind)} ({SPEC_USAGE}, or a kind alone: "
                             f"{', '.join(KINDS)})")
        return cls(kind)

    def __str__(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind

    def args_for(self, n: int, machines: Sequence[str] | None = None) -> GraphArgs:
        """The graph of this kind over ``n`` positions, labelled with ``machines`` (one per position)."""
        if n < 1:
            raise GraphError(f"{self}: a graph needs at least 1 member, got {n}")
        if machines is not None and len(machines) != n:
            raise GraphError(f"{self}: expected {n} machine labels (one per member), got {len(machines)}")
        if self.kind in BY_NODE_COUNT:
            if self.kind == "double_ring" and (n < 4 or n % 2):
                raise GraphError(f"{self} takes an even number of members, at least 4; got {n}")
            args = BY_NODE_COUNT[self.kind](n)
        elif self.kind == "torus":
            args = self._torus(n)
        else:
            args = self._hierarchical(n, machines)
        return args if machines is None else args._replace(machines=list(machines))

    def _torus(self, n: int) -> GraphArgs:
        if not self.arg:
            return torus(*squarest(n))
        rows, cols = (int(d) for d in self.arg.split("x"))
        if rows * cols != n:
            raise GraphError(f"{self} takes {rows * cols} members, got {n} "
                             f"(--graph torus re-forms to the squarest RxC for any count)")
        return torus(rows, cols)

    def _hierarchical(self, n: int, machines: Sequence[str] | None) -> GraphArgs:
        if machines is not None:
            return hierarchical(machine_groups(machines))
        if not self.arg:
            raise GraphError("hierarchical over members needs each member's machine "
                             "(or group sizes, as in hierarchical:4,4)")
        sizes = [int(s) for s in self.arg.split(",")]
        if sum(sizes) != n:
            raise GraphError(f"{self} takes {sum(sizes)} members, got {n} "
                             f"(give each member's machine to group them by machine)")
        return hierarchical(sizes)


__all__ = ["KINDS", "BuilderSpec", "machine_groups", "squarest"]
