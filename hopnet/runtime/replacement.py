"""The Node's part in replacing a dead worker (the messages and the handover's form are in
:mod:`hopnet.runtime.rejoin`).

On every worker: a ``rejoin`` from a new process of a peer's rank ends the old process here,
if that had not happened yet, and takes the rank back; a ``handover_req`` is queued for the
trainer's thread, which answers it where the model is consistent (``handover_now``).
In the replacement: :meth:`Replacements.rejoin` says ``rejoin`` to the ranks it exchanges
with and takes the state of the first neighbour that hands it over. A live worker a resync
found behind takes a neighbour's state the same way (:meth:`Replacements.fetch_state`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from hopnet.errors import HopnetError, PeerFailure
from hopnet.runtime.rejoin import HANDOVER, HANDOVER_REQUEST, REJOIN, Handover, read_handover
from hopnet.wire import Message

if TYPE_CHECKING:
    from hopnet.runtime.node import Node


class _DonorGone(Exception):
    """The neighbour asked for a handover was declared dead, or left."""


class Replacements:
    """A node's replacements: the rejoins and handover requests it receives, the handover it waits for."""

    def __init__(self, node: Node[Any]) -> None:
        self.node = node
        self.at_handover_point = False  # the protocol is blocked where its model is consistent
        self._rejoined: asyncio.Event | None = None  # set at each readmission (wait_for_rejoins)
        self._handover: asyncio.Future[Handover] | None = None
        self._handover_from: int | None = None
        self._due_at: dict[int, int] = {}
        """Requests to answer at a step boundary no earlier than an iteration (``at``; a replica's lanes
        taking their states at one iteration, :mod:`hopnet.replica.handover`)."""

    def donor_gone(self, peer: int) -> None:
        """``peer`` died or left: a handover asked of it will not come."""
        if peer == self._handover_from and self._handover is not None and not self._handover.done():
            self._handover.set_exception(_DonorGone())

    # ------------------------------------------------------------------ on every worker
    def on_message(self, msg: Message) -> None:
        """A ``rejoin``, ``handover_req`` or ``handover`` arrived."""
        node = self.node
        meta = msg.meta or {}
        if msg.kind == HANDOVER:
            waiter = self._handover
            if waiter is None or waiter.done() or msg.src != self._handover_from:
                node.count_drop("unexpected_handover")
                return
            try:
                waiter.set_result(read_handover(msg))
            except HopnetError as exc:
                waiter.set_exception(exc)
            return
        restart = meta.get("restart")
        if msg.kind == HANDOVER_REQUEST and node.max_restarts and meta.get("epoch") == node.epoch:
            self._requested(msg.src, meta)  # a live peer catching up in a resync (fetch_state)
            return
        if node.max_restarts == 0 or not isinstance(restart, int) or restart < 1:
            node.count_drop("unexpected_rejoin")
            return
        if msg.kind == HANDOVER_REQUEST:
            if node.restarts_seen.get(msg.src, 0) != restart:  # its rejoin comes first on the same link
                node.count_drop("handover_request_before_rejoin")
                return
            self._requested(msg.src, meta)
            return
        address = meta.get("address")
        if not isinstance(address, str) or node.restarts_seen.get(msg.src, 0) >= restart:
            node.count_drop("stale_rejoin")
            return
        self._readmit(msg.src, restart, address)

    def _requested(self, peer: int, meta: Mapping[str, Any]) -> None:
        node = self.node
        at = meta.get("at")
        if isinstance(at, int):
            self._due_at[peer] = at
        if peer not in node.handover_requests:
            node.handover_requests.append(peer)
            node.record("handover_requested", peer=peer, iter=node.protocol.iteration,
                        **{k: v for k, v in meta.items() if k in ("restart", "epoch", "at")})
        if self.at_handover_point or node.quiesced:  # blocked where the model is consistent, or done training
            if node.handover_now is not None:
                node.handover_now(self.take_handover_requests())

    def _readmit(self, peer: int, restart: int, address: str) -> None:
        """A new process of ``peer``'s rank joined: end the old one here, if that had not happened
        yet, then take the rank back (its address, the liveness watch, the protocol)."""
        node = self.node
        if peer not in node.dead and peer not in node.departed:
            silence = node.liveness.silence(peer, node.clock.now()) if node.liveness is not None else None
            node.peer_dead(peer, silence or 0.0)
        node.restarts_seen[peer] = restart
        node.dead.pop(peer, None)
        node.death_causes.pop(peer, None)
        node.departed.pop(peer, None)
        node.final_iterations.pop(peer, None)
        node.done_peers.pop(peer, None)
        if node.addresses is not None:
            node.addresses[peer] = address
        # Connected at once: the messages right behind the rejoin may need an answer.
        node.transport.readmit_peer(peer, address if peer in node.connected else None)
        node.mailbox.peer_rejoined(peer)
        if node.watch is not None and peer in node.graph.peers(node.rank):
            node.watch.rewatch(peer)
        # A round it was a member of cannot finish: its predecessor's part is lost, and the new process
        # takes up no round it did not start.
        node.mailbox.break_rounds_with(peer, "was replaced")
        node.record("peer_rejoined", peer=peer, restart=restart, iter=node.protocol.iteration)
        node.events.flush()
        if self._rejoined is not None:
            self._rejoined.set()
        node.protocol.on_peer_rejoined(peer)
        if node.quiesced and peer in node.graph.peers(node.rank):
            node.post(Message("done", node.rank, peer, node.protocol.iteration))  # it must not wait on this one

    async def wait_for_rejoins(self, what: str) -> None:
        """Wait until every peer declared dead has been replaced (``--timeout`` at most)."""
        node = self.node
        while node.dead:
            self._rejoined = event = asyncio.Event()
            missing = sorted(node.dead)
            await node.clock.wait(event.wait(), f"{what}: the replacement of rank(s) {missing}",
                                  peer=missing[0], iteration=node.protocol.iteration)

    def handover_point(self, reached: bool = True) -> None:
        """The protocol is blocked where its model is consistent (``reached``) or goes on: answer the
        replacements waiting for this worker's state now, rather than at the next step boundary."""
        self.at_handover_point = reached
        if reached and self.node.handover_requests and self.node.handover_now is not None:
            self.node.handover_now(self.take_handover_requests())

    def take_handover_requests(self, iteration: int | None = None) -> list[int]:
        """The replacements waiting for this worker's state (each is answered once): at a step boundary
        before ``iteration``, those that did not ask for a later one; else (blocked, or done) all."""
        node = self.node
        due = [r for r in node.handover_requests if iteration is None or self._due_at.get(r, iteration) <= iteration]
        node.handover_requests = [r for r in node.handover_requests if r not in due]
        for peer in due:
            self._due_at.pop(peer, None)
        return [r for r in due if r not in node.dead and r not in node.departed]

    # ------------------------------------------------------------------ in the worker taking a state
    async def rejoin(self, restart: int, ranks: Iterable[int], donors: Iterable[int], wait_s: float) -> Handover:
        """This process replaces its rank's dead worker: say ``rejoin`` to ``ranks`` and take the state of
        the first of ``donors`` that hands it over within ``wait_s`` (a donor this node declares dead
        meanwhile is passed over at once)."""
        node = self.node
        node.restart = restart
        ranks = [r for r in ranks if r != node.rank]
        await node.connect_to(ranks)
        for rank in ranks:
            node.post(Message(REJOIN, node.rank, rank, node.protocol.iteration,
                              meta={"restart": restart, "address": node.address}))
        await node.flush()
        tried = []
        neighbours = set(node.graph.peers(node.rank))
        for donor in donors:
            if donor == node.rank or donor in node.dead or donor in node.departed:
                continue
            tried.append(donor)
            # A neighbour is watched: one that died, or left, is passed over after --peer-timeout. Another
            # rank is not: it gets twice that, not the whole --timeout.
            wait = wait_s if donor in neighbours or node.peer_timeout_s is None else min(wait_s, 2 * node.peer_timeout_s)
            handover = await self._ask_for_state(donor, {"restart": restart}, wait)
            if handover is not None:
                return handover
        raise HopnetError(f"rank {node.rank}: restart {restart}: no neighbour handed its state over "
                          f"(asked {tried})")

    async def ask_again(self, restart: int, donor: int, at: int, wait_s: float) -> Handover:
        """This replacement, rejoined, asks ``donor`` again: for its state at the step boundary before
        iteration ``at`` (or at the first after it; at once where the donor is blocked or done)."""
        handover = await self._ask_for_state(donor, {"restart": restart, "at": at}, wait_s)
        if handover is None:
            raise HopnetError(f"rank {self.node.rank}: restart {restart}: rank {donor} did not hand its state "
                              f"over again (asked for iteration {at})")
        return handover

    async def fetch_state(self, donor: int, wait_s: float) -> Handover:
        """Take ``donor``'s state as a replacement would, this worker being live (a resync found it a
        step behind ``donor``, who answers while it waits in the same resync)."""
        node = self.node
        handover = await self._ask_for_state(donor, {"epoch": node.epoch}, wait_s)
        if handover is None:
            raise PeerFailure(f"rank {node.rank}: rank {donor} did not hand its state over (in resync {node.epoch})",
                              peer=donor, peer_state=node.peer_state(donor))
        return handover

    async def _ask_for_state(self, donor: int, meta: dict[str, Any], wait_s: float) -> Handover | None:
        node = self.node
        await node.connect_to([donor])
        self._handover = asyncio.get_running_loop().create_future()
        self._handover_from = donor
        node.post(Message(HANDOVER_REQUEST, node.rank, donor, node.protocol.iteration, meta=meta))
        try:
            async with asyncio.timeout(wait_s):
                return await self._handover
        except TimeoutError:
            node.record("handover_missing", peer=donor, waited_s=wait_s)
        except _DonorGone:
            node.record("handover_missing", peer=donor, state=node.peer_state(donor))
        finally:
            self._handover = None
            self._handover_from = None
        return None
