"""Coordinators: the small central services some protocols need (Prague's Group Generator,
Partial Reduce's controller).

Each one is a sans-IO state machine (:class:`~hopnet.coordinator.base.Coordinator`): it
takes a worker's message and returns the messages to send, and never sees a socket or a
clock. The same object runs behind ZeroMQ under ``hopnet launch`` and on the simulator's
virtual loop. Its messages are a few bytes; no tensor ever passes through it.
"""

from hopnet.coordinator.base import BadCoordinatorMessage, Coordinator, Send

__all__ = ["BadCoordinatorMessage", "Coordinator", "Send"]
