"""Hop's part in replacing a dead worker (``--max-restarts``; the node's part is
:mod:`hopnet.runtime.replacement`).

On a live worker: a neighbour's replacement is counted in again and welcomed with the iteration this
worker is in (and the update of it the dead process got). In the replacement: it hears each
neighbour's welcome, starts at the furthest in-neighbour's iteration, and sends every out-neighbour
behind it what the dead process owed. A worker whose iteration needs a dead in-neighbour's update
waits for its replacement."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from hopnet.errors import ConfigError, ProtocolError
from hopnet.protocols.hop.failures import peer_failure
from hopnet.protocols.hop.options import WELCOME, restart_refusal
from hopnet.protocols.hop.queues import Update
from hopnet.protocols.hop.state import CREDIT, HopState
from hopnet.wire import Message


class HopRejoin(HopState):
    """Welcomes a replaced neighbour, and brings a replacement in step with its neighbours."""

    def _check_restartable(self) -> None:
        refusal = restart_refusal(self.options, self.config.protocol)
        if refusal is not None:
            raise ConfigError(f"--max-restarts: {refusal}")

    def on_peer_rejoined(self, peer: int) -> None:
        """A neighbour's replacement joined: count it in again as if it were in this worker's iteration
        (its own grants correct that), and tell it where this worker is, with the update of this
        iteration that the dead process got (the model has not changed since: the reduce comes at
        the end of the iteration)."""
        self._check_restartable()
        if peer not in self.peers:
            return
        k = self.round
        self.departed_after.pop(peer, None)
        self._joined_late.add(peer)
        if peer in self._out_peer_set:
            # as if it were about to enter this iteration: its entry (begin) grants that token itself
            self.tokens.readmit(peer, entered=k)
            self.acks[peer] = k - 1
        if peer in self._in_peer_set:
            self.last_used[peer] = min(self.last_used[peer], k - 1)
        tensors = list(self.flats) if peer in self._out_peer_set and self.flats else []
        self.node.post(Message(WELCOME, self.rank, peer, k, tensors=tensors))
        self.queue.wake()

    def rejoin_at(self, iteration: int, state: Mapping[str, Any]) -> None:
        self._check_restartable()
        super().rejoin_at(iteration, state)
        self._rejoin_from = iteration

    def _on_welcome(self, msg: Message) -> None:
        if msg.src not in self.peers:
            self.node.count_drop("unexpected_welcome")
            return
        self.welcomes[msg.src] = msg.iter
        if msg.tensors and msg.src in self._in_peer_set:
            try:
                self._store(Update(msg.iter, msg.src, msg.tensors))
            except ProtocolError:  # neighbours further apart than the queue reaches: this one is not needed
                self.node.count_drop("welcome_beyond_window")
                self._release(msg.tensors)
            else:
                self.newest_received[msg.src] = max(self.newest_received[msg.src], msg.iter)
        elif msg.tensors:
            self._release(msg.tensors)
        if self._started_at is not None:  # late: it gets its fillers now
            self._fill(msg.src, msg.iter, self._started_at)
        if self._welcomed is not None:
            self._welcomed.set()

    async def after_rejoin(self) -> None:
        """The replacement hears where each neighbour is (``--peer-timeout`` at most), starts at the
        furthest in-neighbour's iteration, so that every in-neighbour still sends it that iteration's
        update, and sends each out-neighbour behind it what the dead process owed: its model as the
        updates of the iterations between (with their tokens)."""
        node = self.node
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.peer_timeout_s
        while True:
            live = [p for p in self.peers if p not in node.dead and p not in node.departed]
            missing = [p for p in live if p not in self.welcomes]
            if not missing or loop.time() >= deadline:
                break
            self._welcomed = asyncio.Event()
            try:
                await asyncio.wait_for(self._welcomed.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                break
        self._welcomed = None
        ahead = [self.welcomes[p] for p in self.in_peers if p in self.welcomes]
        start = max([self._rejoin_from, *ahead])
        if node.lanes is not None:  # each lane heard its own welcomes: the replica starts where the furthest says
            start = -await node.lanes.least(-start)
        self.iteration = start
        # Welcomes of earlier iterations must not hold the queue's slots: the neighbours' updates of the
        # iterations ahead arrive before the trainer's loop begins.
        self._discard_older_than(start - (self.staleness or 0))
        self.acks = {j: start - 1 for j in self.acks}
        self.last_used = {j: start - 1 for j in self.last_used}
        self.newest_received = {j: max(start - 1, self.newest_received[j]) for j in self.newest_received}
        self.tokens.restart_at(start, {p: self.welcomes[p] + 1 for p in self.out_peers if p in self.welcomes})
        for peer in self.peers:
            if peer not in self.welcomes:
                self.departed_after[peer] = start - 1  # gone, or silent: handled as gone until it speaks
        self._started_at = start
        for peer, at in self.welcomes.items():
            self._fill(peer, at, start)
        node.record("hop_rejoined", iter=start, welcomes={str(p): k for p, k in sorted(self.welcomes.items())})

    async def _leave_together(self) -> None:
        """Under ``--max-restarts``, the lanes of a replica leave a wait on the other replicas together (a
        barrier: one all-reduce), and are a handover point until then. A replica whose process died is
        otherwise seen an iteration apart by a neighbour's lanes (its members sent their last tokens and
        updates at different moments): one lane blocked on the replacement, the other past it, held in the
        replica's own collective, where it cannot hand its state over, so the replacement waited for it."""
        lanes = self.node.lanes
        if lanes is not None and self.node.max_restarts:
            with self._handover_point():
                await lanes.least(0)

    @contextlib.contextmanager
    def _handover_point(self) -> Iterator[None]:
        """Waiting inside, the model is consistent (the reduce comes after): a neighbour's replacement may
        take it, as in :meth:`~hopnet.protocols.hop.protocol.HopProtocol._wait`."""
        self.node.handover_point()
        try:
            yield
        finally:
            self.node.handover_point(False)

    def _fill(self, peer: int, at: int, start: int) -> None:
        """Send ``peer`` (in iteration ``at``) this worker's updates of ``at .. start - 1`` and the tokens of
        the iterations between, so that neither waits for what the dead process would have sent."""
        if at >= start:
            return
        if self.notify_ack and peer in self._in_peer_set:  # it enters an iteration once this one acked the last
            self.node.post(Message("ack", self.rank, peer, start - 1))
        # The neighbour counted this worker as about to enter ``at`` (on_peer_rejoined); the entry into
        # ``start`` grants its own token (begin): these are the ones of the iterations between.
        credit = start - at if self.use_tokens else 0
        if peer in self._out_peer_set:
            first = max(at, start - self.num_slots + 1)
            for tag in range(first, start):
                meta = {CREDIT: credit} if credit and peer in self._in_peer_set and tag == first else None
                self.node.post(Message("update", self.rank, peer, tag, meta=meta, tensors=list(self.flats)))
        elif credit and peer in self._in_peer_set:
            self.node.post(Message("token", self.rank, peer, start - 1, meta={CREDIT: credit}))

    async def _await_replacements(self, k: int, need: int) -> None:
        """Iteration ``k`` needs the update of a dead in-neighbour: under ``--max-restarts`` wait for its
        replacement (``--timeout`` at most), which sends what the dead process owed; else fail naming it."""
        dead = [j for j in self.in_peers if j in self.node.dead]
        if not self.node.max_restarts or not dead:
            raise peer_failure(self, k, need)
        self.node.handover_point()
        try:
            await self.node.wait_for_rejoins(f"rank {self.rank}'s updates of iteration {k}")
        finally:
            self.node.handover_point(False)
