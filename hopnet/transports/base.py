"""The transport interface: how a Node moves messages, and nothing else.

A transport lives on its node's event loop. Protocols never see it; they talk to the
Node. Inbound messages are validated and handed to a :class:`Receiver`, which first
gets a chance to supply the tensors the bytes should land in (a preallocated slot of
an update queue), so steady-state training allocates nothing.
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from hopnet.errors import PeerFailure
from hopnet.wire import Header, Message, is_any_rank_kind

DISCARD = object()
"""Returned by :meth:`Receiver.buffers_for` to say: read the bytes, then drop the message."""


class Receiver(Protocol):
    def buffers_for(self, header: Header) -> list[torch.Tensor] | None | object:
        """Tensors (matching ``header.specs``) to receive into, ``None`` to let the transport
        allocate, or :data:`DISCARD` to drop the message (a late update, say)."""

    def deliver(self, msg: Message) -> None:
        """Called on the event loop with each valid inbound message."""

    def hold(self, header: Header) -> bool:
        """Whether a message whose payload has not been read yet should stay unread for now
        (a model-averaging protocol's update of an iteration after the one it still has to mix:
        reading it would take a buffer of the model's size). Asked, before :meth:`buffers_for`,
        only by a transport that ``holds_back``; True keeps the message, and every later one from
        the same sender, unread until :meth:`Transport.take_in_held` (the sender's send waits)."""

    def peer_lost(self, failure: PeerFailure) -> None:
        """The transport found ``failure.peer`` gone without a ``bye`` (the torch plane's pair
        connection closed or reset: its process ended), outside any send of this receiver's; a send
        that finds it raises ``failure`` instead. Called on the event loop, at most once per peer."""


EventHook = Callable[..., None]
"""``record(event, **fields)``: writes a record to the rank's event log."""


def event_hook(receiver: object) -> EventHook | None:
    """The receiver's ``record(event, **fields)``, if it has one: the Node's (its event log), or a
    composed transport's that passes it on. Where a transport reports what it found on a link
    (``link_gap``) without another method on :class:`Receiver`."""
    record = getattr(receiver, "record", None)
    return record if callable(record) else None


class TransportStats:
    """Counters a transport keeps: messages and bytes each way, and drops by reason."""

    def __init__(self) -> None:
        self.sent_messages = 0
        self.sent_bytes = 0
        self.received_messages = 0
        self.received_bytes = 0
        self.dropped: Counter[str] = Counter()

    def drop(self, reason: str) -> None:
        self.dropped[reason] += 1

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def as_dict(self) -> dict[str, object]:
        return {
            "sent_messages": self.sent_messages,
            "sent_bytes": self.sent_bytes,
            "received_messages": self.received_messages,
            "received_bytes": self.received_bytes,
            "dropped": dict(self.dropped),
        }


class Transport(abc.ABC):
    """Moves :class:`Message` objects between ranks.

    Lifecycle, all on the node's event loop: ``await start(receiver)`` (binds, returns the
    address peers should use), ``await connect(addresses)`` (addresses of the peers this
    rank talks to), any number of ``await send(msg)``, then ``await close()``.
    """

    heartbeats: bool = False
    """Whether peers on this transport can die unannounced, so the Node must watch them with
    heartbeats (a network transport). In-process peers cannot: they leave with ``bye``."""

    carries_cuda: bool = False
    """Whether it moves CUDA tensors (the torch bulk plane); the others move CPU tensors only."""

    holds_back: bool = False
    """Whether it asks :meth:`Receiver.hold` before reading a payload (the torch bulk plane, whose
    payloads move only once the receiver posts their receive): the others read every message as it
    comes."""

    sends_at_once: bool = False
    """Whether a send is complete the moment it is handed over (the in-process transport):
    the Node then calls :meth:`send_nowait` instead of awaiting :meth:`send` in a task."""

    def __init__(self, rank: int, allowed_senders: frozenset[int]) -> None:
        self.rank = rank
        self.allowed_senders = allowed_senders
        self.world_size: int | None = None
        self.stats = TransportStats()

    def admit_run(self, world_size: int) -> None:
        """Accept messages of the any-rank kinds (:func:`hopnet.wire.register_kind`) from
        every rank ``0 <= r < world_size``; other kinds still only from ``allowed_senders``."""
        self.world_size = world_size

    @abc.abstractmethod
    async def start(self, receiver: Receiver) -> str:
        """Begin receiving; return this rank's address."""

    @abc.abstractmethod
    async def connect(self, addresses: Mapping[int, str]) -> None:
        """Open the ways to the given peers."""

    @abc.abstractmethod
    async def send(self, msg: Message) -> None:
        """Send ``msg``. Returns once the caller may modify ``msg.tensors`` again."""

    def send_nowait(self, msg: Message) -> None:
        """Send ``msg`` at once, without awaiting; only on a transport that ``sends_at_once``."""
        raise NotImplementedError(f"{type(self).__name__} does not send at once (sends_at_once is False)")

    async def send_latest(self, msg: Message) -> None:
        """Send ``msg``, or let a later ``send_latest`` to the same peer replace it.

        For messages a receiver only ever uses the newest of (Hop's bounded staleness): while
        earlier tensors to ``msg.dst`` have not left this process, the transport keeps a copy of the
        newest such message and sends it once the link is free; one it replaces is dropped
        (``superseded`` in ``stats.dropped``). A held message may be overtaken by later
        :meth:`send` calls; :meth:`drain` waits until none is held. Returns once the caller
        may modify ``msg.tensors`` again. By default, the same as :meth:`send`."""
        await self.send(msg)

    async def send_express(self, msg: Message) -> None:
        """Send a control message (no tensors) that must not wait behind tensors to the same
        peer: it may overtake messages sent before it. By default, the same as :meth:`send`."""
        await self.send(msg)

    async def drain(self) -> None:
        """Wait until every message :meth:`send_latest` holds has been sent or dropped."""

    def take_in_held(self) -> None:
        """Ask :meth:`Receiver.hold` again for the messages held back (in each sender's order),
        and read those it no longer holds. Nothing to do on a transport that does not hold back."""

    def forget_peer(self, rank: int) -> None:
        """``rank`` left for good: drop what is still queued for it and send it nothing more.

        Messages sent to it later are dropped and counted (``peer_left``), not errors: a
        send may already be on its way when the news of the departure arrives."""

    def readmit_peer(self, rank: int, address: str | None) -> None:
        """``rank``, forgotten before, came back as a new process (a replacement the launcher
        started): send to it again, at ``address`` when given (now, without waiting: messages
        that follow may be answered at once), else once :meth:`connect` gives it."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop receiving and release sockets. Idempotent."""

    def check_header(self, header: Header) -> str | None:
        """The common validation every transport applies. Returns a drop reason or None."""
        return self.check_route(header.kind, header.src, header.dst)

    def check_route(self, kind: str, src: int, dst: int) -> str | None:
        """:meth:`check_header` on a header's parts (a transport that has them without a header)."""
        if dst != self.rank:
            return "wrong_dst"
        if src not in self.allowed_senders:
            size = self.world_size
            if not (size is not None and is_any_rank_kind(kind) and 0 <= src < size and src != self.rank):
                return "not_neighbor"
        return None


class Rounds:
    """Runs a pass over what a transport held back, again while anything asks for another.

    A take-in delivers, and what it delivers may ask for a take-in (Hop's reduce frees a buffer):
    a call made while a pass runs does not nest, it makes the running pass go round once more."""

    def __init__(self) -> None:
        self._running = False
        self._again = False

    def run(self, one_pass: Callable[[], None]) -> None:
        if self._running:
            self._again = True
            return
        self._running = True
        try:
            self._again = True
            while self._again:
                self._again = False
                one_pass()
        finally:
            self._running = False
