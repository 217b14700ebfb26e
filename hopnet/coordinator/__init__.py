"""Coordinators: the small central services some protocols need (Prague's Group Generator,
Partial Reduce's controller).

Each one is a sans-IO state machine (:class:`~hopnet.coordinator.base.Coordinator`): it
takes a worker's message and returns the messages to send, and never sees a socket or a
clock. The same object runs behind ZeroMQ under ``hopnet launch`` (:mod:`.server`, a
process of its own) and on the simulator's virtual loop (:mod:`.sim`); workers reach it
through :class:`~hopnet.coordinator.client.CoordinatorClient` (``node.coordinator``). Its
messages are a few bytes; no tensor ever passes through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.coordinator.base import BadCoordinatorMessage, Coordinator, Send

if TYPE_CHECKING:
    from hopnet.config import ProtocolConfig
    from hopnet.graph import Graph


CONFIG_FIELDS = ("protocol", "group_generator", "group_size", "group_buffer", "global_division", "inter_intra",
                 "slow_filter", "weights", "ema_decay", "missing_policy", "frozen_window", "seed", "peer_timeout_s")
"""The options a coordinator is built from (:func:`make_coordinator`, and the liveness of the host)."""


def needs_coordinator(config: ProtocolConfig) -> bool:
    """Whether ``config``'s protocol runs with a coordinator (see :func:`make_coordinator`)."""
    if config.protocol == "prague":
        return config.group_generator != "static"
    return config.protocol == "partial-reduce"


def make_coordinator(config: ProtocolConfig, graph: Graph) -> Coordinator | None:
    """The state machine ``config`` needs for a run on ``graph``, or ``None`` when it needs none
    (every protocol but prague and partial-reduce, and prague's static schedule)."""
    from hopnet.errors import ConfigError

    if config.protocol == "prague":
        if config.group_generator == "random":
            from hopnet.coordinator.random_gg import RandomGroupGenerator
            return RandomGroupGenerator(graph.n, config.group_size, config.seed)
        if config.group_generator == "smart":
            from hopnet.coordinator.smart_gg import SmartGroupGenerator
            return SmartGroupGenerator.from_config(config, graph)
        return None
    if config.protocol == "partial-reduce":
        try:
            from hopnet.coordinator import partial_reduce
        except ImportError:
            raise ConfigError("--protocol partial-reduce is not available in this build") from None
        return partial_reduce.make_controller(config, graph)  # preduce's module
    return None


__all__ = ["CONFIG_FIELDS", "BadCoordinatorMessage", "Coordinator", "Send", "make_coordinator", "needs_coordinator"]
