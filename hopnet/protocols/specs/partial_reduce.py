"""Partial Reduce's declaration (:mod:`hopnet.protocols.partial_reduce` is the algorithm): its
options and its controller (the coordinator)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hopnet.config import ProtocolConfig
from hopnet.coordinator.base import Coordinator
from hopnet.coordinator.partial_reduce import PartialReduceController
from hopnet.coordinator.weights import MISSING_POLICIES, WEIGHT_MODES
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.options import option
from hopnet.output_spec import Count, OutputSpec, Wait
from hopnet.protocols.specs.local_steps import LocalStepsOptions
from hopnet.registry import Averages, CoordinatorSpec, MessageKind, ProtocolSpec, register

if TYPE_CHECKING:
    import torch

    from hopnet.model_state import ModelState
    from hopnet.params import FlatGradients
    from hopnet.protocols.base import Protocol

ABORT = "preduce_abort"
"""Member -> the other members of a group: the group failed; ``meta``: ``gid``, and the
``peer`` to blame with its ``state`` ("dead" or "departed")."""

DEFAULT_GROUP_SIZE = 3
DEFAULT_EMA_DECAY = 0.9


@dataclass(frozen=True)
class PartialReduceOptions(LocalStepsOptions):
    group_size: int = option(DEFAULT_GROUP_SIZE, minimum=2, metavar="N", help="workers per group")
    weights: str = option("const", choices=WEIGHT_MODES,
                          help="const (1/P, keeps the mean) or dynamic (staleness-aware EMA weights, Eq. 9)")
    ema_decay: float = option(DEFAULT_EMA_DECAY, metavar="ALPHA", help="dynamic weights: the EMA decay")
    missing_policy: str = option("oldest", choices=MISSING_POLICIES,
                                 help="dynamic weights: who gets the weight of staleness levels no member holds "
                                      "(oldest is the paper's reading)")
    frozen_window: int | None = option(None, minimum=0, metavar="T",
                                       help="keep the sync graph of the last T groups connected (none: derived "
                                            "from the world and group sizes; 0 switches group-frozen avoidance "
                                            "off)")

    def check(self) -> None:
        if isinstance(self.ema_decay, bool) or not isinstance(self.ema_decay, (int, float)) \
                or not 0 <= self.ema_decay < 1:
            raise ConfigError(f"--ema-decay must be in [0, 1) (got {self.ema_decay!r})")


def make_controller(config: ProtocolConfig, options: PartialReduceOptions, graph: Graph) -> Coordinator:
    """The controller of a run on ``graph`` (its nodes are the workers)."""
    if options.group_size > graph.n:
        raise ConfigError(f"--group-size {options.group_size} is larger than the run's {graph.n} workers")
    return PartialReduceController(graph.n, options.group_size, weights=options.weights,
                                   ema_decay=options.ema_decay, missing_policy=options.missing_policy,
                                   frozen_window=options.frozen_window)


def _build(config: ProtocolConfig, options: PartialReduceOptions, model: ModelState | None,
           grads: FlatGradients | torch.Tensor | None) -> Protocol:
    from hopnet.protocols.partial_reduce import PartialReduceProtocol

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
    output=PARTIAL_REDUCE_OUTPUT,
))

__all__ = ["ABORT", "DEFAULT_EMA_DECAY", "DEFAULT_GROUP_SIZE", "PartialReduceOptions", "make_controller"]
