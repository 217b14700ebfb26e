"""AD-PSGD's declaration (:mod:`hopnet.protocols.adpsgd` is the algorithm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hopnet.config import ProtocolConfig
from hopnet.config_checks import graph_in_words
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.output_spec import Count, OutputSpec, Wait
from hopnet.protocols.specs.local_steps import LocalStepsOptions
from hopnet.registry import Averages, MessageKind, ProtocolSpec, register

if TYPE_CHECKING:
    import torch

    from hopnet.model_state import ModelState
    from hopnet.params import FlatGradients
    from hopnet.protocols.base import Protocol

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


def _no_notes(_: object) -> list[str]:
    return []


@dataclass(frozen=True)
class AdPsgdOptions(LocalStepsOptions):
    """AD-PSGD's options: with ``--local-steps H`` an active averages every H iterations (and at its
    last); a passive serves whenever asked, as ever."""


def _build(config: ProtocolConfig, options: AdPsgdOptions, model: ModelState | None,
           grads: FlatGradients | torch.Tensor | None) -> Protocol:
    from hopnet.protocols.adpsgd import AdPsgdProtocol

    return AdPsgdProtocol(config, model, options)


AD_PSGD_OUTPUT = OutputSpec(
    waits=(Wait("wait_updates_s", "wait for partner", "wait partner"),),
    counts=(Count("role", "role", "tally"), Count("averagings", "averagings"),
            Count("averagings_served", "averagings served"), Count("averagings_skipped", "averagings skipped")),
    gaps="all")


register(ProtocolSpec(
    name="ad-psgd",
    summary="asynchronous pairwise model averaging (AD-PSGD) on a bipartite graph: active workers average "
            "with one random passive neighbour per iteration.",
    options=AdPsgdOptions,
    build=_build,
    averages=Averages.MODELS,
    uses_graph=True,
    message_kinds=(MessageKind(REQUEST), MessageKind(REPLY)),
    check_graph=lambda config, options, graph: _no_notes(check_bipartite(graph)),
    resumable=True,
    restartable=True,
    output=AD_PSGD_OUTPUT,
))

__all__ = ["REPLY", "REQUEST", "AdPsgdOptions", "check_bipartite"]
