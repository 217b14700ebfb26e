"""Hop's receiving side: the buffers an update lands in (a pooled model-sized buffer, or one region
of the model for a streamed chunk), the updates held back unread so memory stays bounded, and the
chunks and credits that arrive."""

from __future__ import annotations

from typing import Any

from hopnet.finite import all_finite_in
from hopnet.protocols.hop.mix_sums import Region
from hopnet.protocols.hop.options import WELCOME
from hopnet.protocols.hop.queues import Update
from hopnet.protocols.hop.state import ANY_SENDER, CREDIT, PART, HopState
from hopnet.transports.base import DISCARD
from hopnet.wire import Header, Message


class HopReceiving(HopState):
    """Where updates land, which ones wait unread, and what chunks and credits do on arrival."""

    def buffers_for(self, header: Header) -> Any:
        if header.kind == WELCOME and not header.specs:
            return None
        if header.kind not in ("update", WELCOME):
            return None
        if header.src not in self._in_peer_set:
            self.node.count_drop("update_from_non_in_neighbor")
            return DISCARD
        if not self.specs:
            if header.specs:
                self.node.count_drop("bad_payload")
                return DISCARD
            return None
        part = header.meta.get(PART) if header.meta else None
        if part is not None:
            if not (self.streaming and header.kind == "update" and type(part) is int
                    and 0 <= part < len(self.regions) and header.specs == (self.regions[part].spec,)):
                self.node.count_drop("bad_payload")
                return DISCARD
            return [self.region_pool.take(self.regions[part])]
        if header.specs != self.specs:
            self.node.count_drop("bad_payload")
            return DISCARD
        if self.streaming:
            return None  # a whole update of a streamed model (a welcome): added as it is
        if self.summing:  # each tensor is one region: it becomes its part, or is pooled again
            return [self.region_pool.take(region) for region in self.regions]
        return self.pool.acquire(ANY_SENDER)

    def hold(self, header: Header) -> bool:
        """Hold back an update of an iteration after the one this worker mixes next: taking it in would
        allocate a sum for that iteration, a model's size more. Unless every update of the iteration
        mixed next is in and a free buffer can take it: then the next iteration's first update lands
        while this one is mixed, in memory already there.

        Safe: the sender ``j`` needs this worker's update of that iteration anyway (``j`` is in
        ``_hold_from``: no backup workers, and this worker is its in-neighbour), which this worker
        sends only once it mixed the iteration before, so ``j`` could not finish that iteration
        earlier; and what this worker waits for to mix its next iteration, ``j`` sent before the held
        update on the same FIFO link, so nothing it needs queues behind what it holds. By induction
        on the iteration, no cycle of waits (docs/protocols/hop.md, "Holding the next iteration back")."""
        if header.kind != "update" or header.src not in self._hold_from or self.node.max_restarts:
            return False
        mixing = max(self._reduced + 1, self.round, self._awaiting)
        if header.iter <= mixing or (header.iter == mixing + 1 and self._all_in(mixing)
                                     and self.region_pool.has_free(self._regions_of(header))):
            return False
        key = (header.iter, header.meta.get(PART) if header.meta else None)
        if self._last_held.get(header.src) != key:  # counted once, however often it is asked again
            self._last_held[header.src] = key
            self.updates_held += 1
        return True

    def _all_in(self, k: int) -> bool:
        """Every update of iteration ``k`` expected has come whole: no buffer is needed for ``k`` any more."""
        return (self.queue.size(iter=k) >= len(self.expected_senders(k))
                and not any(key[0] == k for key in self._arriving))

    def _regions_of(self, header: Header) -> tuple[Region, ...]:
        part = header.meta.get(PART) if header.meta else None
        if type(part) is int and 0 <= part < len(self.regions):
            return (self.regions[part],)
        return self.regions

    def _on_chunk(self, msg: Message) -> None:
        """One chunk of a streamed update: added, weighted, into its region of the iteration's sum. The
        update counts as arrived (for the wait rules) once all its chunks are in."""
        k, src = msg.iter, msg.src
        assert msg.meta is not None
        index: int = msg.meta[PART]
        tensor = msg.tensors[0]
        if self._is_late(k, src) or k <= self._reduced:
            self.late_chunks_dropped += 1
            if index == 0 and (k, src) not in self._arriving:
                self.late_updates_dropped += 1
            self.region_pool.give(tensor)
            return
        got = self._arriving.setdefault((k, src), set())
        if index in got:
            self.node.count_drop("duplicate_chunk")
            self.region_pool.give(tensor)
            return
        got.add(index)
        if all_finite_in([tensor]):
            self.sums.add(k, index, tensor, self.in_weight[src])
        else:  # left out of its region's mix; the rest of the update counts
            self._drop_non_finite(k, src, k)
            self.region_pool.give(tensor)
        self.node.take_in_held()  # a buffer may have been freed
        if len(got) < len(self.regions):
            return
        del self._arriving[(k, src)]
        if k > self.newest_received[src]:
            self.newest_received[src] = k
        self.queue.enqueue(Update(k, src, None))

    def _on_credit(self, msg: Message) -> None:
        meta = msg.meta
        if not meta or CREDIT not in meta:
            return
        count = meta[CREDIT]
        if msg.src not in self._out_peer_set or not isinstance(count, int) or count < 1:
            self.node.count_drop("bad_credit")
            return
        self.tokens.grant(msg.src, count, msg.iter)
