"""The Node's sends in flight: each posted message is a task on the node's loop, so the protocol
goes on while it leaves, and :meth:`Outbox.flush` waits until all of them have (their tensors
may be modified again then).

A send that fails is raised by the next flush; one that found its peer dead (a
:class:`~hopnet.errors.PeerFailure`) is the node's news of that peer instead (``node.peer_lost``).
Every send counts as a sign of life to its peer in the node's liveness watch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from hopnet.errors import HopnetError, PeerFailure
from hopnet.wire import Message

if TYPE_CHECKING:
    from hopnet.runtime.node import Node

Send = Callable[[Message], Coroutine[Any, Any, None]]


class Outbox:
    """The tasks of a node's posted sends, and the first error among them."""

    def __init__(self, node: Node[Any]) -> None:
        self.node = node
        transport = node.transport
        self.send_nowait = transport.send_nowait if transport.sends_at_once else None
        """The simulator's transport sends at once, one way, in virtual time: no task, no tracking."""
        self._pending: set[asyncio.Task[None]] = set()
        self._error: BaseException | None = None

    def post(self, msg: Message, send: Send) -> asyncio.Task[None] | None:
        """Every post goes through here: the send counts as a sign of life to ``msg.dst``."""
        node = self.node
        if node.liveness is not None:
            node.liveness.sent(msg.dst, node.clock.now())
        if self.send_nowait is not None:  # the simulator's transport: one way, in virtual time
            self.send_nowait(msg)
            return None
        if node.awaiting_addresses:
            # An answer to a message that came during this node's rendezvous (an ad-psgd passive's
            # reply to an active that started first): it leaves once the way to its peer is open.
            task = asyncio.get_running_loop().create_task(self._send_once_connected(msg, send))
        else:
            task = asyncio.get_running_loop().create_task(send(msg))
        self._pending.add(task)
        task.add_done_callback(self._sent)
        return task

    def post_stream(self, msgs: Sequence[Message], window: int) -> None:
        """``msgs`` (to one peer) in order, at most ``window`` of them in the transport at once."""
        if not msgs:
            return
        node = self.node
        if self.send_nowait is not None:
            for msg in msgs:
                self.post(msg, node.transport.send)
            return
        if node.liveness is not None:
            node.liveness.sent(msgs[0].dst, node.clock.now())
        task = asyncio.get_running_loop().create_task(self._stream(msgs, window))
        self._pending.add(task)
        task.add_done_callback(self._sent)

    async def _stream(self, msgs: Sequence[Message], window: int) -> None:
        node = self.node
        if node.awaiting_addresses:
            await node.connect_to([msgs[0].dst])
        loop = asyncio.get_running_loop()
        sending: set[asyncio.Task[None]] = set()
        try:
            for msg in msgs:
                while len(sending) >= window:
                    done, sending = await asyncio.wait(sending, return_when=asyncio.FIRST_COMPLETED)
                    for finished in done:
                        finished.result()
                sending.add(loop.create_task(node.transport.send(msg)))
            await asyncio.gather(*sending)
        finally:
            for task in sending:
                task.cancel()

    async def _send_once_connected(self, msg: Message, send: Send) -> None:
        await self.node.connect_to([msg.dst])  # waits for the rendezvous first
        await send(msg)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._pending.discard(task)
        if task.cancelled() or (error := task.exception()) is None:
            return
        if isinstance(error, PeerFailure) and error.peer is not None and error.peer_state == "dead":
            self.node.peer_lost(error)
            return
        if self._error is None:
            self._error = error

    async def flush(self) -> None:
        """Wait until every posted message has left; raise the first send's error since the last flush."""
        while self._pending:
            await asyncio.wait(list(self._pending))
        if self._error is not None:
            error, self._error = self._error, None
            raise HopnetError(f"rank {self.node.rank}: sending failed: {error}") from error

    def cancel(self) -> None:
        """Give up the sends still in flight (a worker closing that cannot wait for them)."""
        for task in list(self._pending):
            task.cancel()
