"""Coordinators: the small central services some protocols need (Prague's Group Generator,
Partial Reduce's controller).

Each one is a sans-IO state machine (:class:`~hopnet.coordinator.base.Coordinator`): it
takes a worker's message and returns the messages to send, and never sees a socket or a
clock. The same object runs behind ZeroMQ under ``hopnet launch`` (:mod:`.server`, a
process of its own) and on the simulator's virtual loop (:mod:`.sim`); workers reach it
through :class:`~hopnet.coordinator.client.CoordinatorClient` (``node.coordinator``). Its
messages are a few bytes; no tensor ever passes through it. Which protocol needs which
coordinator is part of the protocol's declaration (:class:`hopnet.registry.CoordinatorSpec`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.coordinator.base import BadCoordinatorMessage, Coordinator, Send

if TYPE_CHECKING:
    from hopnet.config import ProtocolConfig
    from hopnet.graph import Graph

RUN_OPTIONS_OF_COORDINATORS = ("protocol", "seed", "peer_timeout_s")
"""Run-wide settings every coordinator is built or hosted with (the seed; the liveness of its host)."""


def needs_coordinator(config: ProtocolConfig) -> bool:
    """Whether ``config``'s protocol runs with a coordinator (see :func:`make_coordinator`)."""
    return config.spec.needs_coordinator(config.options)


def coordinator_options(config: ProtocolConfig) -> tuple[str, ...]:
    """The options the coordinator of ``config``'s protocol is built from (none without one)."""
    spec = config.spec.coordinator
    return RUN_OPTIONS_OF_COORDINATORS + spec.options if spec is not None else ()


def make_coordinator(config: ProtocolConfig, graph: Graph) -> Coordinator | None:
    """The state machine ``config`` needs for a run on ``graph``, or ``None`` when it needs none."""
    spec = config.spec.coordinator
    if spec is None or not needs_coordinator(config):
        return None
    return spec.build(config, config.options, graph)


__all__ = ["BadCoordinatorMessage", "Coordinator", "Send", "coordinator_options", "make_coordinator",
           "needs_coordinator"]
