"""A transport that loses, holds back or cuts off chosen messages of a real one.

:class:`FaultyTransport` wraps any :class:`hopnet.transports.base.Transport` and applies
rules to the messages passing through it, so peer failures can be staged inside one
process and in a fraction of a second:

- ``silence()`` on rank R's transport: R says and hears nothing any more, as if its process
  had died without a word (its neighbours' heartbeat watch must declare it dead);
- ``drop(kinds={"update"})``: R still beats but owes its updates (a stalled, not dead, peer);
- ``drop(kinds={"bye"})``: R leaves without its goodbye reaching anyone;
- ``cut(peer)``: the link between R and ``peer`` fails both ways, and only that link;
- ``delay(seconds, ...)``: R's messages leave late, in their order (a slow link).

Rules apply from when they are added until :meth:`FaultyTransport.heal`. What they took is
counted in ``injected`` (by rule action and kind), apart from the transport's own ``stats``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from hopnet.transports.base import DISCARD, Receiver, Transport
from hopnet.wire import Header, Message

Direction = Literal["out", "in", "both"]


@dataclass(frozen=True)
class Rule:
    """Which messages a fault applies to: to or from ``peers`` (None: every peer), of
    ``kinds`` (None: every kind), going ``direction`` as seen from the wrapped rank."""

    action: Literal["drop", "delay"]
    peers: frozenset[int] | None = None
    kinds: frozenset[str] | None = None
    direction: Direction = "both"
    delay_s: float = 0.0

    def matches(self, peer: int, kind: str, direction: Literal["out", "in"]) -> bool:
        return ((self.direction == "both" or self.direction == direction)
                and (self.peers is None or peer in self.peers)
                and (self.kinds is None or kind in self.kinds))


class FaultyTransport(Transport):
    """``inner`` with faults injected on the way out (before it sends) and in (before the
    receiver sees a message). Everything else is ``inner``'s own behaviour."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner.rank, inner.allowed_senders)
        self.inner = inner
        self.stats = inner.stats
        self.heartbeats = inner.heartbeats
        self.holds_back = inner.holds_back
        self.rules: list[Rule] = []
        self.injected: Counter[tuple[str, str]] = Counter()
        self._link_locks: dict[int, asyncio.Lock] = {}

    # ---------------------------------------------------------------- faults
    def drop(self, *, peers: Collection[int] | None = None, kinds: Collection[str] | None = None,
             direction: Direction = "both") -> Rule:
        return self._add(Rule("drop", _frozen(peers), _frozen(kinds), direction))

    def delay(self, seconds: float, *, peers: Collection[int] | None = None,
              kinds: Collection[str] | None = None) -> Rule:
        """Hold each matching outbound message ``seconds`` before it is sent (the sender waits,
        as behind a congested link); later messages to the same peer wait behind it, so a
        link's order is kept."""
        return self._add(Rule("delay", _frozen(peers), _frozen(kinds), "out", delay_s=seconds))

    def cut(self, peer: int) -> Rule:
        return self.drop(peers={peer})

    def silence(self) -> Rule:
        return self.drop()

    def heal(self, rule: Rule | None = None) -> None:
        """Remove ``rule``, or every rule."""
        self.rules = [] if rule is None else [r for r in self.rules if r is not rule]

    def _add(self, rule: Rule) -> Rule:
        self.rules.append(rule)
        return rule

    def _rule_for(self, peer: int, kind: str, direction: Literal["out", "in"]) -> Rule | None:
        return next((r for r in self.rules if r.matches(peer, kind, direction)), None)

    # ---------------------------------------------------------------- the Transport interface
    def admit_run(self, world_size: int) -> None:
        super().admit_run(world_size)
        self.inner.admit_run(world_size)

    async def start(self, receiver: Receiver) -> str:
        return await self.inner.start(_FilteredReceiver(self, receiver))

    async def connect(self, addresses: Mapping[int, str]) -> None:
        await self.inner.connect(addresses)

    async def send(self, msg: Message) -> None:
        await self._outbound(msg, self.inner.send)

    async def send_latest(self, msg: Message) -> None:
        await self._outbound(msg, self.inner.send_latest)

    async def send_express(self, msg: Message) -> None:
        await self._outbound(msg, self.inner.send_express)

    async def drain(self) -> None:
        await self.inner.drain()

    def forget_peer(self, rank: int) -> None:
        self.inner.forget_peer(rank)

    def take_in_held(self) -> None:
        self.inner.take_in_held()

    async def close(self) -> None:
        await self.inner.close()

    async def _outbound(self, msg: Message, send: Callable[[Message], Awaitable[None]]) -> None:
        rule = self._rule_for(msg.dst, msg.kind, "out")
        if rule is not None and rule.action == "drop":
            self.injected["drop", msg.kind] += 1
            return
        lock = self._link_locks.setdefault(msg.dst, asyncio.Lock())
        if rule is None and not lock.locked():
            await send(msg)
            return
        if rule is not None:  # the caller may reuse its tensors once send returns: keep a copy
            msg = Message(msg.kind, msg.src, msg.dst, msg.iter, msg.tag, msg.meta,
                          [t.detach().clone() for t in msg.tensors])
        async with lock:
            if rule is not None:
                self.injected["delay", msg.kind] += 1
                await asyncio.sleep(rule.delay_s)
            await send(msg)


class _FilteredReceiver:
    """The receiver ``inner`` hands inbound messages to: drops what an inbound rule matches."""

    def __init__(self, faulty: FaultyTransport, receiver: Receiver) -> None:
        self.faulty = faulty
        self.receiver = receiver

    def _dropped(self, src: int, kind: str) -> bool:
        rule = self.faulty._rule_for(src, kind, "in")
        return rule is not None and rule.action == "drop"

    def buffers_for(self, header: Header) -> list[torch.Tensor] | None | object:
        if self._dropped(header.src, header.kind):
            self.faulty.injected["drop", header.kind] += 1
            return DISCARD  # the bytes must still be read off the wire; the receiver reserves nothing
        return self.receiver.buffers_for(header)

    def hold(self, header: Header) -> bool:
        return not self._dropped(header.src, header.kind) and self.receiver.hold(header)

    def deliver(self, msg: Message) -> None:
        if self._dropped(msg.src, msg.kind):
            self.faulty.injected["drop", msg.kind] += 1
            return
        self.receiver.deliver(msg)


def _frozen(items: Collection[int] | Collection[str] | None) -> frozenset | None:
    return None if items is None else frozenset(items)
