"""Coordinators: the small central services some protocols need (Prague's Group Generator,
Partial Reduce's controller).

Each one is a sans-IO state machine (:class:`~hopnet.coordinator.base.Coordinator`): it
takes a worker's message and returns the messages to send, and never sees a socket or a
clock. The same object runs behind ZeroMQ under ``hopnet launch`` and on the simulator's
virtual loop. Its messages are a few bytes; no tensor ever passes through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.coordinator.base import BadCoordinatorMessage, Coordinator, Send

if TYPE_CHECKING:
    from hopnet.config import ProtocolConfig
    from hopnet.graph import Graph

__all__ = ["BadCoordinatorMessage", "Coordinator", "Send", "make_coordinator"]


def make_coordinator(config: ProtocolConfig, graph: Graph) -> Coordinator | None:
    """The coordinator ``config``'s protocol needs on ``graph``, or None when it needs none."""
    if config.protocol == "prague" and config.group_generator == "smart":
        from hopnet.coordinator.smart_gg import SmartGroupGenerator
        return SmartGroupGenerator.from_config(config, graph)
    return None
