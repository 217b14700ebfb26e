"""Prague's declaration (:mod:`hopnet.protocols.prague` is the algorithm): its options, its
Group Generator (the coordinator) and what the static schedule refuses on a graph."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hopnet.config import ProtocolConfig
from hopnet.config_checks import graph_in_words
from hopnet.coordinator.base import Coordinator
from hopnet.coordinator.random_gg import RandomGroupGenerator
from hopnet.coordinator.smart_gg import SmartGroupGenerator
from hopnet.coordinator.static_schedule import check_static_schedule
from hopnet.graph import Graph
from hopnet.options import option
from hopnet.output_spec import Count, OutputSpec, Wait
from hopnet.protocols.specs.local_steps import LocalStepsOptions
from hopnet.registry import Averages, CoordinatorSpec, ProtocolSpec, register

if TYPE_CHECKING:
    import torch

    from hopnet.model_state import ModelState
    from hopnet.params import FlatGradients
    from hopnet.protocols.base import Protocol

DEFAULT_GROUP_SIZE = 3
DEFAULT_SLOW_FILTER = 4


@dataclass(frozen=True)
class PragueOptions(LocalStepsOptions):
    group_size: int = option(DEFAULT_GROUP_SIZE, minimum=2, metavar="N", help="workers per group")
    group_generator: str = option("smart", choices=("random", "smart", "static"),
                                  help="random (a central Group Generator with a lock vector and FIFO queue), "
                                       "smart (Group Buffer, Global Division, Inter-Intra and the slow-worker "
                                       "filter) or static (a conflict-free schedule each worker computes alone)")
    group_buffer: bool = option(True, help="smart GG: switch the Group Buffer off")
    global_division: bool = option(True, help="smart GG: switch Global Division off")
    inter_intra: bool = option(True, help="smart GG: switch the Inter-Intra phases (by the graph's machine "
                                          "field) off")
    slow_filter: int = option(DEFAULT_SLOW_FILTER, minimum=0, metavar="C",
                              help="smart GG: leave out of a Global Division the workers C or more requests "
                                   "behind its initiator; 0 switches the filter off")


def restart_refusal(options: PragueOptions) -> str | None:
    if options.group_generator == "static":
        return ("--protocol prague --group-generator static cannot replace a dead worker (its schedule counts on "
                "every rank in every iteration); use random or smart")
    return None


def make_group_generator(config: ProtocolConfig, options: PragueOptions, graph: Graph) -> Coordinator:
    if options.group_generator == "random":
        return RandomGroupGenerator(graph.n, options.group_size, config.seed)
    return SmartGroupGenerator(graph.n, group_size=options.group_size, group_buffer=options.group_buffer,
                               global_division=options.global_division, inter_intra=options.inter_intra,
                               slow_filter=options.slow_filter, machines=graph.machines, seed=config.seed)


def check_prague_graph(config: ProtocolConfig, options: PragueOptions, graph: Graph) -> list[str]:
    """The static schedule refuses graphs it cannot serve; the smart GG notes an Inter-Intra that is off."""
    if options.group_generator == "static":
        check_static_schedule(graph.machines)
        return []
    if (options.group_generator == "smart" and options.inter_intra and options.global_division
            and any(m is None for m in graph.machines)):
        return [f"Inter-Intra is off: {graph_in_words(graph)} has no machine labels (the graph's "
                "\"machine\" field); groups are drawn over all workers"]
    return []


def _build(config: ProtocolConfig, options: PragueOptions, model: ModelState | None,
           grads: FlatGradients | torch.Tensor | None) -> Protocol:
    from hopnet.protocols.prague import PragueProtocol

    return PragueProtocol(config, options, model)


PRAGUE_OUTPUT = OutputSpec(
    waits=(Wait("wait_updates_s", "wait for group", "wait group"),),
    counts=(Count("own_groups", "own groups"), Count("served_groups", "groups served"), Count("no_sync", "no syncs"),
            Count("mean_group_size", "mean group size", "mean", in_summary=False),
            Count("groups_failed", "groups failed", in_summary=False)),
    coordinator_counts=(Count("groups_formed", "groups formed"), Count("no_syncs", "groups of one"),
                        Count("no_sync", "groups of one"), Count("buffer_hits", "Group Buffer hits"),
                        Count("global_divisions", "global divisions"),
                        Count("filtered_out", "left out by the slow filter"),
                        Count("went_pending", "requests that waited for a member")),
    gaps="all")


register(ProtocolSpec(
    name="prague",
    summary="Prague's Partial All-Reduce: models are averaged in groups a Group Generator forms "
            "(--group-generator).",
    options=PragueOptions,
    build=_build,
    averages=Averages.MODELS,
    uses_graph=True,
    coordinator=CoordinatorSpec(
        build=make_group_generator,
        options=("group_generator", "group_size", "group_buffer", "global_division", "inter_intra", "slow_filter"),
        needed=lambda options: options.group_generator != "static"),
    check_graph=check_prague_graph,
    resumable=True,
    restartable=True,
    restart_refusal=restart_refusal,
    output=PRAGUE_OUTPUT,
))

__all__ = ["DEFAULT_GROUP_SIZE", "DEFAULT_SLOW_FILTER", "PragueOptions", "check_prague_graph", "make_group_generator",
           "restart_refusal"]
