"""The Node: one worker's runtime, living on an event loop.

It owns the rank, the graph, the transport, the clock and the event log, and stands
between the transport and the protocol: inbound messages are validated (by the
transport, then by kind here), departures of peers are noticed, sends are tracked so
the protocol can wait until its buffers are free again. Everything here runs on the
node's event loop; :class:`hopnet.api.Worker` drives it from a trainer's thread.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from hopnet.errors import HopnetError
from hopnet.graph import Graph
from hopnet.protocols.base import Protocol
from hopnet.runtime.clock import Clock
from hopnet.runtime.events import EventLog, JsonlEventLog
from hopnet.runtime.mailbox import COLLECTIVE_KINDS, Mailbox
from hopnet.transports.base import Transport
from hopnet.wire import Header, Message

if TYPE_CHECKING:
    from hopnet.collectives.base import Collective

AddressExchange = Callable[[str], Awaitable[Mapping[int, str]]]
EnterObserver = Callable[[int, int], None]
CollectiveFactory = Callable[["Node"], "Collective"]


class Node:
    def __init__(self, rank: int, graph: Graph, transport: Transport, protocol: Protocol, *,
                 clock: Clock, events: EventLog | None = None,
                 on_enter: EnterObserver | None = None,
                 collective_factory: CollectiveFactory | None = None) -> None:
        if not 0 <= rank < graph.n:
            raise HopnetError(f"rank {rank} is out of range for a graph of {graph.n} nodes")
        self.rank = rank
        self.graph = graph
        self.transport = transport
        self.protocol = protocol
        self.clock = clock
        self.events = events if events is not None else EventLog(keep=False)
        self.dropped: Counter[str] = Counter()
        self._on_enter = on_enter
        self._log_entries = isinstance(self.events, JsonlEventLog)
        self._send_nowait = getattr(transport, "send_nowait", None)
        self._pending: set[asyncio.Task[None]] = set()
        self._send_error: BaseException | None = None
        self._pending_metrics: dict[str, Any] = {}
        self._t0 = 0.0
        self.address: str | None = None
        self.departed: dict[int, int] = {}
        self.mailbox = Mailbox(COLLECTIVE_KINDS, clock)
        self._mailbox_kinds = self.mailbox.kinds
        self.addresses: dict[int, str] | None = None  # every rank's, once the rendezvous answered
        self._connected: set[int] = set()
        self._collective_factory = collective_factory
        self._collective: Collective | None = None
        protocol.bind(self)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, exchange: AddressExchange | None = None) -> None:
        """Bind, learn the neighbours' addresses, connect, and enter iteration 0."""
        await self.open(exchange)
        await self.protocol.start()

    async def open(self, exchange: AddressExchange | None = None) -> None:
        """Bind, learn the neighbours' addresses and connect, without entering iteration 0."""
        self._t0 = self.clock.now()
        self.transport.admit_run(self.graph.n)
        self.address = await self.transport.start(self)
        if exchange is not None:
            addresses = await exchange(self.address)
            missing = [p for p in self.graph.peers(self.rank) if p not in addresses]
            if missing:
                raise HopnetError(f"rank {self.rank}: no address for peer(s) {missing} after the rendezvous")
            self.addresses = {int(r): a for r, a in addresses.items()}
            await self.connect_to(self.graph.peers(self.rank))
        self.record("start", address=self.address)

    async def connect_to(self, ranks: Iterable[int]) -> None:
        """Open the ways to ``ranks`` (any rank of the run, not only graph neighbours).

        Connections are made once, on first need: a collective calls this for the members it
        sends to. Without a rendezvous (the in-process transport, or a caller that connected
        the transport itself) there is nothing to do."""
        new = [r for r in ranks if r != self.rank and r not in self._connected]
        if not new or self.addresses is None:
            return
        unknown = [r for r in new if r not in self.addresses]
        if unknown:
            raise HopnetError(f"rank {self.rank}: no address for rank(s) {unknown} (not in the rendezvous)")
        await self.transport.connect({r: self.addresses[r] for r in new})
        self._connected.update(new)

    @property
    def collective(self) -> Collective:
        """The all-reduce every group protocol uses: built on first use by the node's
        collective factory (default: :class:`hopnet.collectives.ring.RingCollective`)."""
        if self._collective is None:
            factory = self._collective_factory
            if factory is None:
                from hopnet.collectives.ring import RingCollective
                self._collective = RingCollective(self)
            else:
                self._collective = factory(self)
        return self._collective

    async def close(self, *, leave: bool = True) -> None:
        """Tell the neighbours this worker is leaving (unless ``leave`` is False), then shut down."""
        try:
            if leave:
                await self.protocol.stop()
            await self.flush()
            if self._collective is not None:
                await self._collective.close()
        finally:
            self.record("stop", iter=self.protocol.iteration, dropped=dict(self.dropped_all()),
                        **self.protocol.summary())
            await self.transport.close()
            self.events.close()

    # ------------------------------------------------------------------ the Receiver side
    def buffers_for(self, header: Header) -> Any:
        if header.kind in self._mailbox_kinds:
            return self.mailbox.buffers_for(header)
        if header.kind == "bye":
            return None
        return self.protocol.buffers_for(header)

    def deliver(self, msg: Message) -> None:
        if msg.kind in self._mailbox_kinds:
            self.mailbox.deliver(msg)
            return
        if msg.kind == "bye":
            if msg.src not in self.departed:
                self.departed[msg.src] = msg.iter
                self.record("peer_left", peer=msg.src, last_iter=msg.iter)
                self.protocol.on_peer_departed(msg.src, msg.iter)
                self.mailbox.peer_departed(msg.src, f"left after iteration {msg.iter}")
                self.transport.forget_peer(msg.src)
            return
        self.protocol.on_message(msg)

    def count_drop(self, reason: str) -> None:
        self.dropped[reason] += 1

    def dropped_all(self) -> Counter[str]:
        """Drops counted by the transport and by the protocol together."""
        total = Counter(self.transport.stats.dropped)
        total.update(self.dropped)
        return total

    # ------------------------------------------------------------------ what protocols call
    def post(self, msg: Message) -> None:
        """Send without waiting; :meth:`flush` waits until every posted send is done."""
        if self._send_nowait is not None:
            self._send_nowait(msg)
            return
        task = asyncio.get_running_loop().create_task(self.transport.send(msg))
        self._pending.add(task)
        task.add_done_callback(self._sent)

    def post_tracked(self, msg: Message) -> asyncio.Task[None] | None:
        """Like :meth:`post`, and return what to await before ``msg.tensors`` may be
        modified again (``None``: the transport already let go of them)."""
        if self._send_nowait is not None:
            self._send_nowait(msg)
            return None
        task = asyncio.get_running_loop().create_task(self.transport.send(msg))
        self._pending.add(task)
        task.add_done_callback(self._sent)
        return task

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None and self._send_error is None:
            self._send_error = task.exception()

    async def flush(self) -> None:
        """Wait until every posted message has left, so its tensors may be modified again."""
        while self._pending:
            await asyncio.wait(list(self._pending))
        if self._send_error is not None:
            error, self._send_error = self._send_error, None
            raise HopnetError(f"rank {self.rank}: sending failed: {error}") from error

    def entered(self, iteration: int, protocol: Protocol) -> None:
        """The protocol entered ``iteration`` (called before it sends anything for it)."""
        if self._on_enter is not None:
            self._on_enter(self.rank, iteration)
        if self._log_entries:
            # The system's monotonic clock is shared by the processes of one machine, so logs of
            # different ranks merge into one timeline (the gap checks replay it). Not loop.time():
            # uvloop caches it per loop turn at millisecond resolution.
            self.record("enter", iter=iteration, mono=time.monotonic())

    def report(self, **metrics: Any) -> None:
        """Attach metrics (loss, accuracy...) to the next iteration record."""
        self._pending_metrics.update(metrics)

    def iteration_done(self, iteration: int, protocol: Protocol) -> None:
        record = {"iter": iteration, **protocol.snapshot()}
        if self._pending_metrics:
            record.update(self._pending_metrics)
            self._pending_metrics = {}
        self.record("iteration", **record)

    def record(self, event: str, **fields: Any) -> None:
        if self.events.keep or self._log_entries:
            self.events.write({"event": event, "rank": self.rank,
                               "t": round(self.clock.now() - self._t0, 6), **fields})
