"""Prague's declaration (:mod:`hopnet.protocols.prague.protocol` is the algorithm): its options, its
Group Generator (the coordinator) and what the static schedule refuses on a graph."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.config import ProtocolConfig
from hopnet.config_checks import graph_in_words
from hopnet.coordinator.base import Coordinator
from hopnet.protocols.prague.random_gg import RandomGroupGenerator
from hopnet.protocols.prague.smart_gg import SmartGroupGenerator
from hopnet.protocols.prague.static_schedule import check_static_schedule
from hopnet.graph import Graph
from hopnet.output_spec import Count, OutputSpec, Wait
from hopnet.registry import Averages, CoordinatorSpec, ProtocolSpec, register
from hopnet.protocols.prague.options import PragueOptions, restart_refusal

if TYPE_CHECKING:
    import torch

    from hopnet.model_state import ModelState
    from hopnet.params import FlatGradients
    from hopnet.protocols.base import Protocol


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
    from hopnet.protocols.prague.protocol import PragueProtocol

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
    between_replicas=True,
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
    restarts_replicas=True,
    output=PRAGUE_OUTPUT,
))

