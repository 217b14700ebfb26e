"""The Node's watch over its neighbours, on transports whose peers can die unannounced
(``transport.heartbeats``): the task that feeds :class:`~hopnet.runtime.liveness.Liveness` the
clock, sends beats to quiet links and hands the node the neighbours that stayed silent.

The node notes, as messages arrive, who it heard from (``heard``) and whose messages the
transport holds back for its protocol (``holding``); the watch reads both when it looks."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from hopnet.runtime.liveness import Liveness
from hopnet.wire import Message

if TYPE_CHECKING:
    from hopnet.runtime.node import Node


class PeerWatch:
    """Beats to quiet links, and declares neighbours that stay silent dead (``node.peer_dead``)."""

    def __init__(self, node: Node[Any], liveness: Liveness, *, heard: set[int], holding: set[int]) -> None:
        self.node = node
        self.liveness = liveness
        self.heard = heard  # peers heard from since the watch last looked (the node adds to it)
        self.holding = holding  # peers whose messages the transport holds back for the protocol
        transport = node.transport
        self._send_nowait = transport.send_nowait if transport.sends_at_once else None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    def rewatch(self, peer: int) -> None:
        """A new process of ``peer``'s rank joined. Declared dead by the coordinator's notice or by a
        rejoin, the old process is still watched here with its last stamp: the new one starts a
        silence of its own (and the watch runs again if it had no one left to watch)."""
        self.liveness.forget(peer)
        self.liveness.watch(peer, self.node.clock.now())
        if self._task is None or self._task.done():
            self.start()

    async def _watch(self) -> None:
        """Beat to quiet links, and declare neighbours that stay silent dead."""
        node, liveness = self.node, self.liveness
        # Look at least once per beat interval: arrivals are stamped when the watch looks,
        # so a silence is measured at most one interval short.
        period = liveness.beat_interval_s
        while liveness.watched:
            now = node.clock.now()
            away = liveness.look(now)
            if away:
                node.record("watch_paused", away_s=round(away, 3), iter=node.protocol.iteration)
            heard = set(self.heard)
            self.heard.clear()
            # A peer whose update this worker holds back waits on this worker, and what it sends
            # meanwhile (beats included) queues behind that update: its silence is ours.
            heard.update(self.holding)
            for peer in heard:
                liveness.heard(peer, now)
            for peer, silent_s in liveness.silent_peers(now):
                node.peer_dead(peer, silent_s)
            iteration = node.protocol.iteration
            for peer in liveness.beat_due(now):
                self._post_beat(Message("beat", node.rank, peer, iteration))
            await asyncio.sleep(max(0.0, min(liveness.next_check(now), now + period) - node.clock.now()))

    def _post_beat(self, msg: Message) -> None:
        """Send a beat; a beat that cannot be sent is not worth failing the worker for."""
        if self._send_nowait is not None:
            self._send_nowait(msg)
            return
        # Express: on a saturated link a beat queued behind updates would arrive too late.
        task = asyncio.get_running_loop().create_task(self.node.transport.send_express(msg))
        task.add_done_callback(ignore_result)


def ignore_result(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it
