"""DiLoCo's outer rounds over the first ``P`` ready workers (``--outer-quorum P``), late
pseudo-gradients weighted by their staleness, at most ``--max-stale-rounds S`` rounds old.

Every rank takes part in every outer round's all-reduce (the anchor stays one model), but a
round does not wait for every rank's pseudo-gradient. When a worker's trainer reaches a sync
point it takes its pseudo-gradient (``anchor - model``), tells every rank (``diloco_ready``) and
blocks until a round has taken it. Each rank's event loop starts the next round as soon as it
knows of ``P`` ranks with a pseudo-gradient not yet taken (finished ranks count towards ``P``),
also while its own trainer computes: a rank whose pseudo-gradient is not ready contributes
zeros, and its pseudo-gradient joins a later round. A round sums ``w_i * delta_i`` and the
weights ``w_i`` (one entry per rank, zero for ranks without a pseudo-gradient in it) and applies
the outer step to ``sum(w_i delta_i) / max(sum(w_i), P)``; ``w_i = 1 / (1 + s_i)``, where the
staleness ``s_i`` counts the rounds that closed between the round the worker's local steps started
from and the one taking them. So a round of ``P`` fresh pseudo-gradients or more takes their
(weighted) mean, and a stale pseudo-gradient counts as a fraction of a worker: a round whose weights
add up to less than ``P`` (stale ones in it, or fewer workers at the end, when finished workers
count towards the quorum) makes a proportionally smaller step. Without the ``P`` floor the last
rounds of a slow worker, alone once the others finished, would each move the anchor by its whole
pseudo-gradient (with the outer momentum behind it) and undo part of the training: measured on
digits, the consensus fell from the fast ranks' 0.96 to 0.947. Every rank learns from the summed
weights whose pseudo-gradients a round took, so all keep the same books (:class:`QuorumBook`) and
the same anchor.

**The bound.** A round closes without rank ``j`` only if ``j``'s next pseudo-gradient would still
be at most ``S`` rounds stale; otherwise every rank waits for ``j`` (``S = 0``: every round takes
every rank, synchronous DiLoCo). So no worker falls more than ``S`` rounds behind the anchor.

**Landing.** Rounds close on the event loop; a worker applies them in order at its next step
(the trainer blocked): the anchor takes the outer step; a worker whose pseudo-gradient the round
took takes the anchor as its model (it has been blocked since it took the pseudo-gradient), the
others keep their local steps on top of it (``model += new anchor - old anchor``), so the local
steps they made are neither lost nor counted twice.

**The end.** A worker's last iteration always contributes (its local steps since its last
sync). A finished worker keeps taking part in rounds until every rank has finished and every
pseudo-gradient announced was taken, then applies the last rounds: all ranks end with the
anchor as their model.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError, HopnetError, PeerFailure
from hopnet.model_state import ModelState
from hopnet.protocols.base import ApplyFn
from hopnet.protocols.diloco.options import READY_KIND, DiLoCoOptions
from hopnet.protocols.diloco.protocol import TAG_PREFIX, DiLoCoProtocol
from hopnet.runtime.services import NodeServices
from hopnet.wire import Message


class QuorumBook:
    """What every rank knows of the others' pseudo-gradients, and when a round may start. Pure:
    the same announcements and round results give the same answers on every rank."""

    def __init__(self, world_size: int, quorum: int, max_stale: int) -> None:
        self.n = world_size
        self.quorum = quorum
        self.max_stale = max_stale
        self.announced = [0] * world_size
        self.taken = [0] * world_size
        self.started_at = [0] * world_size
        """The rounds closed when each rank's current local steps started (its pseudo-gradient's
        staleness is the round taking it minus this)."""
        self.done = [False] * world_size
        self.rounds = 0
        """Rounds closed."""

    def announce(self, rank: int, count: int, done: bool = False) -> None:
        self.announced[rank] = max(self.announced[rank], count)
        self.done[rank] = self.done[rank] or done

    def waiting(self, rank: int) -> bool:
        """``rank`` has a pseudo-gradient no round took yet."""
        return self.announced[rank] > self.taken[rank]

    def staleness(self, rank: int) -> int:
        """How stale ``rank``'s pseudo-gradient would be in the next round."""
        return self.rounds - self.started_at[rank]

    def weight(self, rank: int) -> float:
        return 1.0 / (1 + self.staleness(rank))

    def can_start(self) -> bool:
        """The next round may close over the ranks waiting now: there is one, ``P`` are waiting or
        finished, and no rank left out would be more than ``max_stale`` rounds stale after it."""
        waiting = [r for r in range(self.n) if self.waiting(r)]
        if not waiting:
            return False
        if sum(1 for r in range(self.n) if r in waiting or self.done[r]) < self.quorum:
            return False
        return all(r in waiting or self.done[r] or self.staleness(r) + 1 <= self.max_stale for r in range(self.n))

    def close(self, weights: torch.Tensor) -> list[tuple[int, int]]:
        """A round closed taking the ranks with a positive weight: ``(rank, staleness)`` of each."""
        took = [(r, self.staleness(r)) for r in range(self.n) if float(weights[r]) > 0]
        for r, _ in took:
            self.taken[r] += 1
            self.started_at[r] = self.rounds + 1
        self.rounds += 1
        return took

    def finished(self) -> bool:
        """Every rank finished and every pseudo-gradient announced was taken: no round is to come."""
        return all(self.done) and not any(self.waiting(r) for r in range(self.n))


@dataclass
class _Closed:
    """A round closed on the loop, not applied to the model yet."""

    index: int
    sums: list[torch.Tensor]
    weights: torch.Tensor
    took: list[tuple[int, int]]


class QuorumDiLoCoProtocol(DiLoCoProtocol):
    """DiLoCo whose outer rounds close over the first ``--outer-quorum`` ready workers (see the module)."""

    def __init__(self, config: ProtocolConfig, options: DiLoCoOptions, model: ModelState | torch.Tensor | None) -> None:
        super().__init__(config, options, model)
        if options.fragments != 1 or options.overlap():
            raise ConfigError("--outer-quorum takes neither --fragments nor --overlap-steps")
        assert options.outer_quorum is not None
        self.quorum = options.outer_quorum
        self.max_stale = options.max_stale_rounds
        self.book = QuorumBook(1, 1, 0)
        self.max_staleness = 0
        self.late_taken = 0
        """Pseudo-gradients taken by a later round than the one after their local steps."""
        self._mine: list[torch.Tensor] | None = None  # this rank's pseudo-gradient, until a round takes it
        self._closed: deque[_Closed] = deque()
        self._running: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._wake: asyncio.Event | None = None
        self._trained = False

    def bind(self, node: NodeServices) -> None:
        super().bind(node)
        self.book = QuorumBook(len(self.everyone), self.quorum, self.max_stale)

    def resume_at(self, iteration: int) -> None:
        raise ConfigError("--protocol diloco --outer-quorum cannot resume from a checkpoint yet (the ranks' rounds "
                          "are not at one point)")

    async def start(self) -> None:
        await super().start()
        self._wake = asyncio.Event()
        await self.node.connect_to(r for r in self.everyone if r != self.rank)

    # ------------------------------------------------------------------ the step
    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        k = self.iteration
        if not self.anchor:
            await self._first_anchor()
        if apply is not None:
            apply()
        self._raise_failure()
        self._apply_closed()
        if (k + 1) % self.h == 0 or last:
            await self._contribute(k)
        self.node.iteration_done(k, self)
        if last:
            self._trained = True
            return
        self.iteration = k + 1
        self.node.entered(k + 1, self)

    async def _contribute(self, k: int) -> None:
        """Take this rank's pseudo-gradient, announce it, and wait until a round took it."""
        me = self.rank
        self._mine = [a - f for a, f in zip(self.anchor, self.flats)]
        self.book.announce(me, self.book.announced[me] + 1)
        self._tell_everyone({"n": self.book.announced[me]}, k)
        self._kick()
        began = self.node.timer()
        try:
            await self.node.clock.wait(self._until(lambda: not self.book.waiting(me)),
                                       f"an outer round taking rank {me}'s pseudo-gradient of iteration {k} "
                                       f"({TAG_PREFIX}, --outer-quorum {self.quorum})", iteration=k)
        finally:
            self.node.waited("updates", self.node.timer() - began)
        self._apply_closed()

    def _apply_closed(self) -> None:
        """Apply the rounds closed since the last step, in order (the trainer is blocked)."""
        while self._closed:
            closed = self._closed.popleft()
            total = max(float(closed.weights.sum()), float(self.quorum))  # see the module: below P, a smaller step
            took_mine = float(closed.weights[self.rank]) > 0
            for piece, summed in zip(self.pieces[0], closed.sums):
                live = self.flats[piece.flat][piece.start:piece.stop]
                before = None if took_mine else self.anchor[piece.flat][piece.start:piece.stop].clone()
                anchor = self._outer_step(piece, summed.div_(total).to(live.dtype))
                if before is None:
                    live.copy_(anchor)
                else:  # keep the local steps made since this rank's own anchor
                    live.sub_(before).add_(anchor)  # exactly the anchor where there were none
            self.outer_steps += 1

    # ------------------------------------------------------------------ rounds, on the loop
    def _kick(self) -> None:
        if self._running is None and self._failure is None and self.book.can_start():
            index = self.book.rounds
            self._running = asyncio.get_running_loop().create_task(self._round(index),
                                                                   name=f"rank{self.rank}-{TAG_PREFIX}/q{index}")

    async def _round(self, index: int) -> None:
        me, book = self.rank, self.book
        weights = torch.zeros(book.n, dtype=torch.float64)
        mine = self._mine if book.waiting(me) else None
        lanes = self.node.lanes
        if lanes is not None and not await lanes.least(int(mine is not None)):
            mine = None  # a lane of a replica group: the replica's pseudo-gradient joins when every lane's does
        if mine is not None:
            weights[me] = book.weight(me)
            sums = [d.mul(book.weight(me)) for d in mine]
        else:
            sums = [torch.zeros_like(f) for f in self.flats]
        try:
            await self.node.collective.allreduce(self.everyone, weights, "sum", tag=f"{TAG_PREFIX}/q{index}/w")
            for i, tensor in enumerate(sums):
                await self.collective.allreduce(self.everyone, tensor, "sum", tag=f"{TAG_PREFIX}/q{index}/{i}")
        except BaseException as exc:
            self._failure = exc
            self._running = None
            self._notify()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        took = book.close(weights)
        if float(weights[me]) > 0:
            self._mine = None
        late = [s for _, s in took if s > 0]
        self.late_taken += len(late)
        self.max_staleness = max([self.max_staleness, *late])
        self.node.record("outer_round", round=index, took=[r for r, _ in took], staleness=[s for _, s in took])
        self._closed.append(_Closed(index, sums, weights, took))
        self._running = None
        self._notify()
        self._kick()

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _until(self, condition: Any) -> None:
        """Wait until ``condition()`` holds; raise the failure that broke the rounds meanwhile."""
        assert self._wake is not None
        while True:
            self._wake.clear()
            self._raise_failure()
            if condition():
                return
            await self._wake.wait()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _tell_everyone(self, meta: dict[str, Any], k: int) -> None:
        for peer in self.everyone:
            if peer != self.rank and peer not in self.node.departed and peer not in self.node.dead:
                self.node.post(Message(READY_KIND, self.rank, peer, k, meta=meta))

    def on_message(self, msg: Message) -> None:
        meta = msg.meta or {}
        count = meta.get("n")
        if msg.kind != READY_KIND or not isinstance(count, int) or not 0 <= msg.src < self.book.n:
            self.node.count_drop("unexpected_kind" if msg.kind != READY_KIND else "bad_ready")
            return
        self.book.announce(msg.src, count, done=meta.get("done") is True)
        self._kick()
        self._notify()

    def on_peer_departed(self, peer: int, last_iteration: int) -> None:
        if not self.book.done[peer] and self._failure is None:
            self._failure = PeerFailure(f"rank {self.rank}: rank {peer} left after iteration {last_iteration} "
                                        "before finishing its diloco outer rounds", peer=peer, peer_state="departed")
            self._notify()

    def on_peer_dead(self, peer: int) -> None:
        if self._failure is None:
            self._failure = PeerFailure(f"rank {self.rank}: rank {peer} died before finishing its diloco outer rounds",
                                        peer=peer, peer_state="dead")
            self._notify()

    # ------------------------------------------------------------------ the end
    async def _serve_to_the_end(self) -> None:
        """Training is over here: take part in rounds until every rank is done, then apply them."""
        me = self.rank
        if not self.book.done[me]:
            self.book.announce(me, self.book.announced[me], done=True)
            self._tell_everyone({"n": self.book.announced[me], "done": True}, self.iteration)
            self._kick()
        await self._until(lambda: self.book.finished() and self._running is None)
        self._apply_closed()

    async def quiesce(self) -> None:
        await self._serve_to_the_end()

    async def stop(self) -> None:
        try:
            if self._trained and self._failure is None:
                await self._serve_to_the_end()
        except HopnetError:
            pass  # a failure on the way out: recorded by the node; leave all the same
        finally:
            if self._running is not None:
                self._running.cancel()
                await asyncio.wait([self._running])
            await self._leave()

    async def _leave(self) -> None:
        await self.say_goodbye(self._others(), final_iteration=False)

    def _others(self) -> Iterable[int]:
        return [r for r in self.everyone if r != self.rank and r not in self.node.departed]

    def snapshot(self) -> dict[str, Any]:
        return {"outer_steps": self.outer_steps, "rounds": self.book.rounds}

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "rounds": self.book.rounds, "outer_quorum": self.quorum,
                "late_taken": self.late_taken, "max_staleness": self.max_staleness}


__all__ = ["READY_KIND", "QuorumBook", "QuorumDiLoCoProtocol"]
