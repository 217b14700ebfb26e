"""The arguments of Graph's constructor as one value, and how the values a user gave show in
an error message.

The builders and the JSON reader both produce a :class:`GraphArgs`; the class builds it."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np


class GraphArgs(NamedTuple):
    """What ``Graph(n, edges, weights, machines, name)`` is called with."""

    n: int
    edges: Iterable[tuple[int, int]]
    weights: Mapping[tuple[int, int], float] | None = None
    machines: Sequence[str | None] | None = None
    name: str | None = None


def is_int(x: Any) -> bool:
    """An integer of Python or numpy, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_number(x: Any) -> bool:
    """A real number of Python or numpy, not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def render(x: Any) -> str:
    """A value from user input as an error message shows it (JSON-like)."""
    try:
        return json.dumps(x)
    except (TypeError, ValueError):
        return repr(x)


def render_edge(i: Any, j: Any) -> str:
    return f"[{i}, {j}]"
