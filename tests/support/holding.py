"""An in-process transport that holds messages back the way the torch bulk plane does.

:class:`HoldingTransport` wraps a rank's :class:`~hopnet.transports.inproc.InprocTransport` (each rank
of :func:`support.threaded.run_ranks` has its own loop thread). A message with tensors is taken in
only when its receiver's ``hold(header)`` says no; until then it waits unread, with every later
message of the same sender, and its sender's ``send`` waits too (gloo's send completes only once
the receiver posted the matching receive). ``take_in_held()`` asks again. So a protocol's holding
back, and the waits it causes on the sending side, can be tested in one process, in a fraction of
a second.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Mapping

import torch

from hopnet.transports.base import DISCARD, Receiver, Rounds, Transport
from hopnet.wire import Header, Message


class HoldingLinks:
    """Shared by the ranks of one run: per directed link, the senders waiting for their message to
    be taken in, oldest first (links are FIFO, so the receiver's n-th take-in is the n-th send)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[tuple[int, int], deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}

    def expect(self, src: int, dst: int) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._waiting.setdefault((src, dst), deque()).append((loop, fut))
        return fut

    def taken(self, src: int, dst: int) -> None:
        with self._lock:
            waiting = self._waiting.get((src, dst))
            if not waiting:
                return
            loop, fut = waiting.popleft()
        loop.call_soon_threadsafe(_settle, fut)


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class HoldingTransport(Transport):
    """``inner`` (in-process), with messages held back as the torch bulk plane holds them."""

    holds_back = True

    def __init__(self, inner: Transport, links: HoldingLinks) -> None:
        super().__init__(inner.rank, inner.allowed_senders)
        self.inner = inner
        self.links = links
        self.stats = inner.stats
        self.heartbeats = inner.heartbeats
        self._receiver: Receiver | None = None
        self._held: dict[int, deque[Message]] = {}
        self._take_in_rounds = Rounds()
        self.taken_in: list[tuple[int, int]] = []
        """(sender, iteration) of every message with tensors, in the order it was taken in."""

    def admit_run(self, world_size: int) -> None:
        super().admit_run(world_size)
        self.inner.admit_run(world_size)

    async def start(self, receiver: Receiver) -> str:
        self._receiver = receiver
        return await self.inner.start(_Intake(self))

    async def connect(self, addresses: Mapping[int, str]) -> None:
        await self.inner.connect(addresses)

    async def send(self, msg: Message) -> None:
        if not msg.tensors:
            await self.inner.send(msg)
            return
        taken = self.links.expect(msg.src, msg.dst)
        await self.inner.send(msg)  # copies the tensors
        await taken

    def forget_peer(self, rank: int) -> None:
        self.inner.forget_peer(rank)
        for msg in self._held.pop(rank, deque()):
            if msg.tensors:
                self.links.taken(rank, self.rank)

    def take_in_held(self) -> None:
        self._take_in_rounds.run(self._take_in_held_once)

    def _take_in_held_once(self) -> None:
        for src in list(self._held):
            held = self._held.get(src)
            while held and self._receiver is not None and not (
                    held[0].tensors and self._receiver.hold(held[0].header())):
                self._take_in(held.popleft(), self._receiver)
            if not held and self._held.get(src) is held:
                del self._held[src]

    async def close(self) -> None:
        for src, held in self._held.items():
            for msg in held:
                if msg.tensors:
                    self.links.taken(src, self.rank)
        self._held.clear()
        self._receiver = None
        await self.inner.close()

    def _arrived(self, msg: Message) -> None:
        receiver = self._receiver
        if receiver is None:
            return
        held = self._held.get(msg.src)
        if held is not None:
            held.append(msg)
        elif msg.tensors and receiver.hold(msg.header()):
            self._held[msg.src] = deque([msg])
        else:
            self._take_in(msg, receiver)

    def _take_in(self, msg: Message, receiver: Receiver) -> None:
        if not msg.tensors:
            receiver.deliver(msg)
            return
        self.links.taken(msg.src, self.rank)
        self.taken_in.append((msg.src, msg.iter))
        target = receiver.buffers_for(msg.header())
        if target is DISCARD:
            return
        if isinstance(target, list):
            for dst, src in zip(target, msg.tensors):
                dst.copy_(src)
            msg.tensors = target
        receiver.deliver(msg)


class _Intake:
    """What the inner transport delivers to: everything goes through :meth:`HoldingTransport._arrived`."""

    def __init__(self, outer: HoldingTransport) -> None:
        self.outer = outer

    def buffers_for(self, header: Header) -> list[torch.Tensor] | None | object:
        return None  # the inner transport's copy is kept until the message is taken in

    def hold(self, header: Header) -> bool:
        return False

    def deliver(self, msg: Message) -> None:
        self.outer._arrived(msg)
