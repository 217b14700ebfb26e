"""In-process transport: every rank lives in this process (tests, the simulator).

Ranks may share one event loop (the simulator runs all of them on one virtual-time
loop) or each have their own loop thread (multi-node tests). Tensors are copied at
send time, as a network would, so a sender may modify its buffer once ``send`` returns.

An optional :class:`LinkModel` delays each delivery by latency plus size over
bandwidth, plus what a lossy or jittery link costs over TCP (:mod:`hopnet.transports.link_faults`,
drawn from the network's seed), with a FIFO per directed link so messages on one link keep their order.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


from hopnet.errors import HopnetError
from hopnet.transports.base import DISCARD, Receiver, Transport
from hopnet.transports.link_faults import RTO_MIN_S, LinkFaults
from hopnet.wire import Message, is_known_kind


@dataclass
class LinkModel:
    """Latency (seconds) and bandwidth (bytes/second; 0 = unlimited) per directed link.

    ``overrides`` maps ``(src, dst)`` to ``(latency_s, bytes_per_s)`` for particular links;
    ``between_machines`` maps a pair of machine labels (``machines[rank]``, None for a rank
    without one) to the parameters of every link from a rank on the first to a rank on the
    second (:mod:`hopnet.sim.links` builds it from a file). The first that names a link wins.
    ``faults`` (loss and jitter, :class:`~hopnet.transports.link_faults.LinkFaults`) applies to
    every link but those ``link_faults`` (per directed link) or ``machine_faults`` (per pair of
    machine labels) name, in that order.
    """

    latency_s: float = 0.0
    bytes_per_s: float = 0.0
    overrides: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    machines: tuple[str | None, ...] = ()
    between_machines: dict[tuple[str | None, str | None], tuple[float, float]] = field(default_factory=dict)
    faults: LinkFaults = field(default_factory=LinkFaults)
    link_faults: dict[tuple[int, int], LinkFaults] = field(default_factory=dict)
    machine_faults: dict[tuple[str | None, str | None], LinkFaults] = field(default_factory=dict)

    @property
    def has_faults(self) -> bool:
        return bool(self.faults) or any(self.link_faults.values()) or any(self.machine_faults.values())

    def faults_of(self, src: int, dst: int) -> LinkFaults:
        found = self.link_faults.get((src, dst))
        if found is not None:
            return found
        machines = self.machines
        if self.machine_faults and 0 <= src < len(machines) and 0 <= dst < len(machines):
            found = self.machine_faults.get((machines[src], machines[dst]))
            if found is not None:
                return found
        return self.faults

    def params(self, src: int, dst: int) -> tuple[float, float]:
        found = self.overrides.get((src, dst))
        if found is not None:
            return found
        if self.between_machines:
            machines = self.machines
            if 0 <= src < len(machines) and 0 <= dst < len(machines):  # not the coordinator's pseudo-rank
                found = self.between_machines.get((machines[src], machines[dst]))
                if found is not None:
                    return found
        return self.latency_s, self.bytes_per_s


@dataclass
class _Due:
    """A message in flight on a lossy or jittery link, and when it is whole at its receiver."""

    due: float
    target: InprocTransport
    msg: Message
    nbytes: int
    tail_lost: bool
    stalled: bool = False
    """It waits for a retransmission timeout."""


class InprocNetwork:
    """The shared medium the in-process transports of one run attach to."""

    def __init__(self, link_model: LinkModel | None = None,
                 virtual_bytes: dict[str, int] | None = None,
                 byte_scale: dict[str, float] | None = None, seed: int = 0) -> None:
        """``seed``: what a lossy or jittery link draws from (one generator per directed link).
        ``virtual_bytes`` charges the link model a size for tensor-less messages of a kind
        (the simulator runs Hop without real parameters but still models their transfer);
        ``byte_scale`` multiplies the size charged for messages of a kind (the simulator
        all-reduces a small stand-in for a large model's gradients)."""
        self.link_model = link_model
        self.virtual_bytes = virtual_bytes or {}
        self.byte_scale = byte_scale or {}
        self._endpoints: dict[int, InprocTransport] = {}
        self._link_free_at: dict[tuple[int, int], float] = {}
        self._in_flight: dict[tuple[int, int], deque[tuple[InprocTransport, Message, int]]] = {}
        self._seed = seed
        self._faulty = link_model is not None and link_model.has_faults
        self._link_rngs: dict[tuple[int, int], random.Random] = {}
        self._due: dict[tuple[int, int], deque[_Due]] = {}
        # Deliveries run in one context of their own: asyncio would copy the sender's for each.
        self._context = contextvars.Context()

    def transport(self, rank: int, allowed_senders: frozenset[int]) -> InprocTransport:
        return InprocTransport(self, rank, allowed_senders)

    def _attach(self, endpoint: InprocTransport) -> None:
        if endpoint.rank in self._endpoints:
            raise HopnetError(f"rank {endpoint.rank} is already attached to this in-process network")
        self._endpoints[endpoint.rank] = endpoint

    def _detach(self, rank: int) -> None:
        self._endpoints.pop(rank, None)

    def _arrival_delay(self, loop: asyncio.AbstractEventLoop, src: int, dst: int, nbytes: int) -> float:
        model = self.link_model
        if model is None:
            return 0.0
        if model.bytes_per_s <= 0 and not model.overrides and not model.between_machines:
            return model.latency_s  # every link alike, and none busy for longer than its latency
        latency, bandwidth = model.params(src, dst)
        if bandwidth <= 0:
            return latency
        now = loop.time()
        start = max(now, self._link_free_at.get((src, dst), now))
        done = start + (nbytes / bandwidth if bandwidth > 0 else 0.0)
        self._link_free_at[(src, dst)] = done
        return done + latency - now

    def _route_faulty(self, loop: asyncio.AbstractEventLoop, msg: Message, nbytes: int,
                      target: InprocTransport) -> None:
        """A message on a link with a model: latency, transfer, and what loss and jitter add; it is
        delivered once due and every message ahead of it on its link was (one TCP stream delivers in
        order, so a retransmission holds back what follows it)."""
        model = self.link_model
        assert model is not None
        link = (msg.src, msg.dst)
        latency, bandwidth = model.params(*link)
        now = loop.time()
        done = now
        if bandwidth > 0:
            done = max(now, self._link_free_at.get(link, now)) + nbytes / bandwidth
            self._link_free_at[link] = done
        extra, tail_lost = 0.0, False
        faults = model.faults_of(*link)
        if faults:
            extra, tail_lost = faults.extra_delay(self._link_rng(link), nbytes, latency)
        queue = self._due.setdefault(link, deque())
        if queue and queue[-1].tail_lost:
            # this message's first segment shows the receiver the hole: the lost tail ahead of it
            # is retransmitted once that news is back, a round trip after the segment arrives
            ahead = queue[-1]
            ahead.tail_lost = False
            resent = faults.resent_delay(self._link_rng(link), latency)
            revealed = now + latency + faults.round_trip(latency) + resent
            if revealed < ahead.due:
                ahead.due, ahead.stalled = revealed, resent > 0
                loop.call_at(revealed, self._deliver_due, loop, queue, context=self._context)
        due = done + latency + extra
        stalled = extra >= RTO_MIN_S
        if queue and queue[0].stalled and faults.lost_any(self._link_rng(link), nbytes):
            # behind a timeout: a loss waits for the next one, doubled (see link_faults)
            due = max(due, queue[0].due + 2 * (faults.round_trip(latency) + RTO_MIN_S))
            stalled, tail_lost = True, False
        entry = _Due(due, target, msg, nbytes, tail_lost, stalled)
        queue.append(entry)
        loop.call_at(entry.due, self._deliver_due, loop, queue, context=self._context)

    def _link_rng(self, link: tuple[int, int]) -> random.Random:
        rng = self._link_rngs.get(link)
        if rng is None:
            rng = self._link_rngs[link] = random.Random(f"{self._seed}:{link[0]}:{link[1]}")
        return rng

    @staticmethod
    def _deliver_due(loop: asyncio.AbstractEventLoop, queue: deque[_Due]) -> None:
        now = loop.time() + 1e-9  # a timer may run a rounding error before the time it was set for
        while queue and queue[0].due <= now:
            entry = queue.popleft()
            entry.target._on_message(entry.msg, entry.nbytes)

    @staticmethod
    def _deliver_oldest(in_flight: deque[tuple[InprocTransport, Message, int]]) -> None:
        target, msg, nbytes = in_flight.popleft()
        target._on_message(msg, nbytes)

    def _route(self, msg: Message, nbytes: int, sender: InprocTransport) -> None:
        target = self._endpoints.get(msg.dst)
        if target is None or target.loop is None:
            return  # like a network: a message to a rank that is gone is lost
        # The running loop: a transport sends on the loop it started on.
        sender_loop, call_soon = sender.loop, sender._call_soon
        if sender_loop is None or call_soon is None:
            raise HopnetError(f"rank {sender.rank}: an in-process transport sends only once started")
        if target.loop is sender_loop and self._faulty:
            self._route_faulty(sender_loop, msg, nbytes, target)
            return
        delay = self._arrival_delay(sender_loop, msg.src, msg.dst, nbytes)
        if target.loop is sender_loop:
            # Arrival times never decrease along a link, but timers due at the same instant may
            # fire in any order (a bye of 0 bytes is due with the update before it). Each timer
            # therefore delivers the oldest message in flight on its link: links stay FIFO.
            link = (msg.src, msg.dst)
            in_flight = self._in_flight.get(link)
            if delay <= 0 and not in_flight:  # nothing ahead of it on its link: due now, in send order
                call_soon(target._on_message, msg, nbytes, context=self._context)
                return
            if in_flight is None:
                in_flight = self._in_flight[link] = deque()
            in_flight.append((target, msg, nbytes))
            if delay > 0:
                sender_loop.call_later(delay, self._deliver_oldest, in_flight, context=self._context)
            else:
                call_soon(self._deliver_oldest, in_flight, context=self._context)
        else:
            target.loop.call_soon_threadsafe(target._on_message, msg, nbytes)


class _CallSoon(Protocol):
    def __call__(self, callback: Callable[..., object], *args: Any,
                 context: contextvars.Context | None = None) -> object: ...


class InprocTransport(Transport):
    sends_at_once = True
    carries_cuda = True  # tensors are cloned on their own device

    def __init__(self, network: InprocNetwork, rank: int, allowed_senders: frozenset[int]) -> None:
        super().__init__(rank, allowed_senders)
        self.network = network
        self.loop: asyncio.AbstractEventLoop | None = None
        self._receiver: Receiver | None = None
        self._call_soon: _CallSoon | None = None

    async def start(self, receiver: Receiver) -> str:
        self.loop = asyncio.get_running_loop()
        # The simulator's loop schedules a burst of deliveries with one handle (same order).
        self._call_soon = getattr(self.loop, "call_soon_in_turn", self.loop.call_soon)
        self._receiver = receiver
        self.network._attach(self)
        return f"inproc://{self.rank}"

    async def connect(self, addresses: Mapping[int, str]) -> None:
        return None

    async def send(self, msg: Message) -> None:
        self.send_nowait(msg)

    def send_nowait(self, msg: Message) -> None:
        """Send without awaiting: in-process sends complete immediately."""
        if msg.tensors:
            msg = Message(msg.kind, msg.src, msg.dst, msg.iter, msg.tag, msg.meta,
                          [t.detach().clone() for t in msg.tensors])
            nbytes = sum(t.numel() * t.element_size() for t in msg.tensors)
            scale = self.network.byte_scale.get(msg.kind)
            if scale is not None:
                nbytes = int(round(nbytes * scale))
        else:
            nbytes = self.network.virtual_bytes.get(msg.kind, 0)
        self.stats.sent_messages += 1
        self.stats.sent_bytes += nbytes
        self.network._route(msg, nbytes, self)

    def _on_message(self, msg: Message, nbytes: int) -> None:
        receiver = self._receiver
        if receiver is None:
            return
        if not is_known_kind(msg.kind):
            self.stats.drop("unknown_kind")
            return
        if msg.dst != self.rank or msg.src not in self.allowed_senders:  # else check_route passes it
            reason = self.check_route(msg.kind, msg.src, msg.dst)
            if reason is not None:
                self.stats.drop(reason)
                return
        if msg.tensors:
            target = receiver.buffers_for(msg.header())
            if target is DISCARD:
                self.stats.drop("discarded")
                return
            if target is not None:
                assert isinstance(target, list)
                for dst_t, src_t in zip(target, msg.tensors):
                    dst_t.copy_(src_t)
                msg.tensors = target
        self.stats.received_messages += 1
        self.stats.received_bytes += nbytes
        receiver.deliver(msg)

    async def close(self) -> None:
        self.network._detach(self.rank)
        self._receiver = None

