"""What every protocol offers its Node, and what it may ask of it.

A protocol is pure algorithm: it reacts to messages the Node hands it and sends
through the Node. It never sees a socket, so the same object runs over ZeroMQ, over
the in-process transport, and inside the virtual-time simulator.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hopnet.wire import Header, Message

if TYPE_CHECKING:
    from hopnet.runtime.node import Node

ApplyFn = Callable[[], None]


class Protocol(abc.ABC):
    """A training protocol bound to one worker."""

    name: str = "protocol"
    node: Node

    def __init__(self) -> None:
        self.iteration = 0
        self.final_iteration: int | None = None  # set by the trainer when it knows where it stops

    def bind(self, node: Node) -> None:
        """Called once by the Node before :meth:`start`; set up per-rank state here."""
        self.node = node

    @abc.abstractmethod
    async def start(self) -> None:
        """Enter iteration 0 (send what must be sent, grant what must be granted)."""

    @abc.abstractmethod
    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        """Finish the current iteration: exchange, mix, call ``apply`` (the optimizer step)
        where the protocol says, and unless ``last``, enter the next iteration."""

    async def stop(self) -> None:
        """Leave: tell the peers this worker sends nothing after its current iteration."""

    @abc.abstractmethod
    def buffers_for(self, header: Header) -> Any:
        """See :meth:`hopnet.transports.base.Receiver.buffers_for`."""

    @abc.abstractmethod
    def on_message(self, msg: Message) -> None:
        """A validated message from a neighbour, on the event loop."""

    def on_peer_departed(self, peer: int, last_iteration: int) -> None:
        """``peer`` will send nothing for iterations after ``last_iteration``."""

    def on_peer_dead(self, peer: int) -> None:
        """``peer`` went silent and was declared dead: it will send nothing more.

        By default a departure after the previous iteration; a protocol that knows what it
        last received from the peer says so instead."""
        self.on_peer_departed(peer, self.iteration - 1)

    def snapshot(self) -> dict[str, Any]:
        """Small state summary for each iteration's record (queue depth, tokens...)."""
        return {}

    def summary(self) -> dict[str, Any]:
        """End-of-run counters for the ``stop`` record (high-water marks, skips...)."""
        return {}
