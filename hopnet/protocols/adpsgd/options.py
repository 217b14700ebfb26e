"""AD-PSGD's options and message kinds: what the algorithm and the declaration (:mod:`.spec`)
both read. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from hopnet.config_checks import graph_in_words
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.protocols.local_steps import LocalStepsOptions

REQUEST = "avg_req"
"""Active -> passive: the active's model, asking for an averaging (``iter``: the active's iteration)."""
REPLY = "avg_reply"
"""Passive -> active: the mean of the two models."""


def check_bipartite(graph: Graph) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The active and passive sets: the graph's two sides. A graph that has none (an odd cycle,
    which would let averagings wait on each other in a circle) or whose edges go one way only
    (a pair must talk both ways) is refused in one line."""
    if not graph.is_undirected():
        raise ConfigError(f"--protocol ad-psgd needs an undirected graph: {graph_in_words(graph)} has "
                          "one-way edges, and an averaging pair talks both ways")
    sides = graph.two_colouring()
    if isinstance(sides, list):
        raise ConfigError(f"{graph_in_words(graph)} is not bipartite: odd cycle {'-'.join(map(str, sides))} "
                          "(--protocol ad-psgd needs active and passive sides with every edge between them)")
    return sides


@dataclass(frozen=True)
class AdPsgdOptions(LocalStepsOptions):
    """AD-PSGD's options: with ``--local-steps H`` an active averages every H iterations (and at its
    last); a passive serves whenever asked, as ever."""


__all__ = ["AdPsgdOptions", "REPLY", "REQUEST", "check_bipartite"]
