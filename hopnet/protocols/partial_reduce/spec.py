"""Partial Reduce's declaration (:mod:`hopnet.protocols.partial_reduce.protocol` is the algorithm): its
options and its controller (the coordinator)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.config import ProtocolConfig
from hopnet.coordinator.base import Coordinator
from hopnet.protocols.partial_reduce.controller import PartialReduceController
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.output_spec import Count, OutputSpec, Wait
from hopnet.registry import Averages, CoordinatorSpec, MessageKind, ProtocolSpec, register
from hopnet.protocols.partial_reduce.options import ABORT, PartialReduceOptions

if TYPE_CHECKING:
    import torch

    from hopnet.model_state import ModelState
    from hopnet.params import FlatGradients
    from hopnet.protocols.base import Protocol


def make_controller(config: ProtocolConfig, options: PartialReduceOptions, graph: Graph) -> Coordinator:
    """The controller of a run on ``graph`` (its nodes are the workers)."""
    if options.group_size > graph.n:
        raise ConfigError(f"--group-size {options.group_size} is larger than the run's {graph.n} workers")
    return PartialReduceController(graph.n, options.group_size, weights=options.weights,
                                   ema_decay=options.ema_decay, missing_policy=options.missing_policy,
                                   frozen_window=options.frozen_window)


def _build(config: ProtocolConfig, options: PartialReduceOptions, model: ModelState | None,
           grads: FlatGradients | torch.Tensor | None) -> Protocol:
    from hopnet.protocols.partial_reduce.protocol import PartialReduceProtocol

    return PartialReduceProtocol(config, options, model)


PARTIAL_REDUCE_OUTPUT = OutputSpec(
    waits=(Wait("wait_updates_s", "wait for group", "wait group"),),
    counts=(Count("groups", "groups"), Count("groups_alone", "groups alone", in_summary=False),
            Count("groups_failed", "groups failed", in_summary=False)),
    coordinator_counts=(Count("groups_formed", "groups formed"), Count("repairs", "frozen-group repairs"),
                        Count("frozen_accepted", "frozen groups accepted"), Count("shrunk_groups", "groups shrunk")),
    gaps="all")


register(ProtocolSpec(
    name="partial-reduce",
    between_replicas=True,
    summary="Partial Reduce: models are averaged in groups of the first --group-size ready workers a "
            "controller forms (--weights).",
    options=PartialReduceOptions,
    build=_build,
    averages=Averages.MODELS,
    uses_graph=False,
    coordinator=CoordinatorSpec(build=make_controller,
                                options=("group_size", "weights", "ema_decay", "missing_policy", "frozen_window")),
    message_kinds=(MessageKind(ABORT, any_rank=True),),
    resumable=True,
    restartable=True,
    restarts_replicas=True,
    output=PARTIAL_REDUCE_OUTPUT,
))

