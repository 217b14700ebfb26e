"""Hop's update queue and token queue (Hop Sec. 4.1, 4.2, 6.1).

:class:`UpdateQueue` holds the updates a worker received, tagged with the sender's
iteration and rank. It is built as rotating per-iteration slots (Sec. 6.1): the
update of iteration ``k`` lives in slot ``k mod num_slots``, so looking for the
updates of one iteration never touches another's, and a slot that would have to
hold two live iterations at once is reported as a capacity violation rather than
silently mixing versions.

Payload buffers come from a :class:`BufferPool`, preallocated and recycled, so a
worker in steady state receives into memory it already owns.

:class:`TokenCredits` realises the token queues as credits: an out-neighbour ``j``
grants one credit each time it enters an iteration, and this worker spends one per
out-neighbour to enter its next. The count held for ``j`` is exactly
``Iter(j) - Iter(i) + max_ig`` as of the last grant received (Theorem 2's invariant).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from hopnet.errors import ProtocolError

Payload = list[torch.Tensor] | None


@dataclass(slots=True)
class Update:
    iter: int
    src: int
    tensors: Payload


class BufferPool:
    """Recycled receive buffers, one free list per sender."""

    def __init__(self, factory: Callable[[], list[torch.Tensor]] | None, senders: Iterable[int],
                 per_sender: int) -> None:
        self._factory = factory
        self._free: dict[int, list[list[torch.Tensor]]] = {s: [] for s in senders}
        self.allocated = 0
        if factory is not None:
            for free in self._free.values():
                for _ in range(per_sender):
                    free.append(factory())
                    self.allocated += 1
        self.preallocated = self.allocated

    def acquire(self, src: int) -> list[torch.Tensor] | None:
        if self._factory is None:
            return None
        free = self._free.setdefault(src, [])
        if free:
            return free.pop()
        self.allocated += 1
        return self._factory()

    def release(self, src: int, tensors: Payload) -> None:
        if tensors is not None and self._factory is not None:
            self._free.setdefault(src, []).append(tensors)


class UpdateQueue:
    """Updates by (iteration, sender) in ``num_slots`` rotating per-iteration slots."""

    def __init__(self, num_slots: int, pool: BufferPool | None = None) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        self.pool = pool
        self._slots: list[dict[int, Update]] = [{} for _ in range(num_slots)]
        self._slot_iter: list[int | None] = [None] * num_slots
        self._count = 0
        self._waiter: asyncio.Future[None] | None = None
        self.high_water = 0

    # -- producer side (the event loop) ---------------------------------------------------
    def enqueue(self, update: Update) -> bool:
        """Add an update. Returns False (and recycles it) for a duplicate (iteration, sender)."""
        index = update.iter % self.num_slots
        slot = self._slots[index]
        held = self._slot_iter[index]
        if slot and held != update.iter:
            raise ProtocolError(
                f"update queue capacity exceeded: slot {index} holds iteration {held} while "
                f"iteration {update.iter} from rank {update.src} arrived ({self.num_slots} slots)")
        if update.src in slot:
            self._recycle(update)
            return False
        slot[update.src] = update
        self._slot_iter[index] = update.iter
        self._count += 1
        if self._count > self.high_water:
            self.high_water = self._count
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return True

    # -- consumer side --------------------------------------------------------------------
    def size(self, iter: int | None = None, w_id: int | None = None) -> int:
        if iter is None and w_id is None:
            return self._count
        if w_id is None and iter is not None:  # one iteration's: its slot's, if it holds that iteration
            index = iter % self.num_slots
            return len(self._slots[index]) if self._slot_iter[index] == iter else 0
        return sum(1 for _ in self._matching(iter, w_id))

    def __len__(self) -> int:
        return self._count

    def _matching(self, iter: int | None, w_id: int | None) -> Iterable[Update]:
        if iter is not None:
            index = iter % self.num_slots
            if self._slot_iter[index] != iter:
                return ()
            slot = self._slots[index]
            if w_id is None:
                return list(slot.values())
            update = slot.get(w_id)
            return (update,) if update is not None else ()
        found = [u for slot in self._slots for u in slot.values() if w_id is None or u.src == w_id]
        found.sort(key=lambda u: u.iter)
        return found

    def held(self, iter: int | None = None, w_id: int | None = None) -> list[Update]:
        """The matching entries, oldest first, left in the queue."""
        return list(self._matching(iter, w_id))

    def take(self, m: int | None = None, iter: int | None = None, w_id: int | None = None) -> list[Update]:
        """Remove and return up to ``m`` matching entries (all when ``m`` is None), without waiting."""
        taken: list[Update] = []
        for update in self._matching(iter, w_id):
            if m is not None and len(taken) >= m:
                break
            self._remove(update)
            taken.append(update)
        return taken

    def newest_iter(self, w_id: int) -> int:
        """The newest iteration held from sender ``w_id``, or -1."""
        newest = -1
        for index, slot in enumerate(self._slots):
            if w_id in slot:
                held = self._slot_iter[index]
                assert held is not None
                newest = max(newest, held)
        return newest

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait on the event loop until ``predicate()`` holds; re-checked after every enqueue."""
        while not predicate():
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def wake(self) -> None:
        """Make a pending :meth:`wait_until` re-check its predicate (a peer left, say)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def dequeue(self, m: int, iter: int | None = None, w_id: int | None = None) -> list[Update]:
        """Hop's ``dequeue``: wait until ``m`` matching entries exist, then take the first ``m``."""
        await self.wait_until(lambda: self.size(iter, w_id) >= m)
        return self.take(m, iter, w_id)

    def discard_older_than(self, iteration: int) -> int:
        """Drop (and recycle) every entry of an iteration before ``iteration``. Returns how many."""
        dropped = self.take_older_than(iteration)
        self.release(dropped)
        return len(dropped)

    def take_older_than(self, iteration: int) -> list[Update]:
        """Remove and return every entry of an iteration before ``iteration``."""
        taken: list[Update] = []
        for index, held in enumerate(self._slot_iter):
            if held is not None and held < iteration:
                for update in list(self._slots[index].values()):
                    self._remove(update)
                    taken.append(update)
        return taken

    def release(self, updates: Iterable[Update]) -> None:
        """Return consumed updates' buffers to the pool."""
        for update in updates:
            self._recycle(update)

    def _remove(self, update: Update) -> None:
        index = update.iter % self.num_slots
        slot = self._slots[index]
        del slot[update.src]
        self._count -= 1
        if not slot:
            self._slot_iter[index] = None

    def _recycle(self, update: Update) -> None:
        if self.pool is not None:
            self.pool.release(update.src, update.tensors)
            update.tensors = None


class TokenCredits:
    """Token queues TokenQ(j -> i) for every out-neighbour j of this worker i, as credits."""

    def __init__(self, out_peers: Iterable[int], max_ig: int) -> None:
        self.max_ig = max_ig
        # Fig. 7 puts max_ig - 1 tokens in every queue; each peer's entry into iteration 0 adds one.
        self._granted: dict[int, int] = {j: max_ig - 1 for j in out_peers}
        self._consumed = 0
        self.known_iter: dict[int, int] = {j: -1 for j in out_peers}
        self.departed: set[int] = set()
        self._waiter: asyncio.Future[None] | None = None
        self.high_water = max_ig

    def tokens(self, peer: int) -> int:
        return self._granted[peer] - self._consumed

    def grant(self, peer: int, count: int, iteration: int) -> None:
        """``peer`` entered ``iteration``, granting ``count`` tokens (more than one after a skip)."""
        self._granted[peer] += count
        if iteration > self.known_iter[peer]:
            self.known_iter[peer] = iteration
        held = self._granted[peer] - self._consumed
        if held > self.high_water:
            self.high_water = held
        waiter = self._waiter  # wake(), inline: a grant comes with every update
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def depart(self, peer: int) -> None:
        """``peer`` left for good: stop requiring its tokens."""
        self.departed.add(peer)
        self.wake()

    def readmit(self, peer: int, entered: int) -> None:
        """``peer`` runs again (a replacement), counted as having entered ``entered`` iterations; its own
        grants bring the count to where it starts."""
        self.departed.discard(peer)
        self._granted[peer] = self.max_ig - 1 + entered
        self.known_iter[peer] = entered - 1
        self.wake()

    def restart_at(self, iteration: int, entered: dict[int, int]) -> None:
        """This worker starts at ``iteration`` (a replacement): it has consumed as many tokens, and each
        out-neighbour has entered ``entered[peer]`` iterations (one not in it is gone)."""
        self._consumed = iteration
        for peer in self._granted:
            if peer in entered:
                self._granted[peer] = self.max_ig - 1 + entered[peer]
                self.known_iter[peer] = entered[peer] - 1
            else:
                self.departed.add(peer)
        self.wake()

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def live_peers(self) -> list[int]:
        return [j for j in self._granted if j not in self.departed]

    def available(self, count: int = 1) -> bool:
        consumed = self._consumed + count
        for j, granted in self._granted.items():  # a loop, not all(): this runs twice per iteration
            if granted < consumed and j not in self.departed:
                return False
        return True

    def missing(self, count: int = 1) -> list[int]:
        consumed = self._consumed + count
        return [j for j in self._granted if j not in self.departed and self._granted[j] < consumed]

    def min_lead(self) -> int | None:
        """min over live out-neighbours of tokens - max_ig, i.e. how far the slowest of them is ahead."""
        live = self.live_peers()
        if not live:
            return None
        return min(self.tokens(j) for j in live) - self.max_ig

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; re-checked after every grant, ack or departure."""
        while not predicate():
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def acquire(self, count: int = 1) -> None:
        """Take ``count`` tokens from every live out-neighbour, waiting until they are there."""
        while not self.available(count):
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._consumed += count
