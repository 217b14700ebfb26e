"""eager-SGD: partial all-reduce of the gradients, solo or majority (Li et al., PPoPP'20).

Every worker keeps a pending buffer ``pend`` (gradients not yet in any round; it starts
as zeros, G_null) and the latest result ``recv``. Rounds ``r = 0, 1, 2, ...`` run in strict
order on every rank; each is one all-reduce (sum, then divided by P) of every rank's
pending buffer, tagged ``eager/{r}``.

The trainer's call (``opt.step()``) with a fresh gradient G:

1. ``pend += G``.
2. If a round finished since this worker last took a result, take it now: the worker was
   late, its G missed that round and waits in ``pend`` for the next one (stale gradient).
3. Otherwise round ``r`` (the next one) is wanted. Solo: this worker starts it unless it is
   already under way. Majority: only ``initiator(r) = H(seed, r) mod P`` starts it; the
   others wait for it with their G deposited. Starting means broadcasting an activation
   along the union of binomial trees (partner ``rel XOR 2^k`` on the ranks relative to the
   root, forwarded on higher dimensions), so it reaches every rank in ceil(log2 P) hops.
4. Wait for round ``r`` to finish, take ``recv`` as the gradient and apply it.

The node's event loop is the progress engine: an activation that arrives while the trainer
computes makes the loop forward it and run the round with whatever ``pend`` holds then
(zeros, or stale gradients). ``pend`` is swapped for zeros the moment the round reads it,
so a gradient deposited during the round goes to the next one: nothing is lost or counted
twice. Activations carry the round id: simultaneous initiators of one round, or an
activation for a round already run, cause no second execution. Each round also sums one
flag per rank, so every member knows how many fresh gradients (active processes) it had.

Model buffers (``--buffers``, :mod:`hopnet.protocols.buffer_sync`): each trainer call also
copies the floating buffers; a round reduces the newest copy beside the gradients, and the
trainer writes the round's result into the model when it takes the round's gradient. A round
that ran before a rank's call carries that rank's older copy (as it carries its stale
gradient), so the last call of every rank syncs the live buffers once more, blocking, as
``--full-sync-every`` does: every rank ends with the same buffers.
``--full-sync-every`` averages the whole model, parameters and floating buffers.

Its declaration (options, what it refuses, what it registers) is :mod:`hopnet.protocols.eager.spec`,
which imports no torch. The rounds themselves (activations, the round engine) and the protocol's state
are :class:`~hopnet.protocols.eager.rounds.EagerRounds`; this module adds the trainer's call, full
syncs, replacements and the end of the run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import torch

from hopnet.errors import PeerFailure
from hopnet.params import FlatGradients
from hopnet.protocols.base import ApplyFn, allreduce_each
from hopnet.protocols.eager.options import ACTIVATION_KIND
from hopnet.protocols.eager.rounds import EagerRounds, activation_targets, majority_initiator
from hopnet.protocols.resync import resynchronize
from hopnet.wire import Header, Message


class EagerProtocol(EagerRounds):
    name = "eager-sgd"

    async def start(self) -> None:
        self.node.entered(0, self)

    # ------------------------------------------------------------------ the trainer's call
    async def synchronize(self) -> None:
        """Steps 1 to 4 up to ``apply``: deposit the gradient, take a round's result into each ``.grad``.
        Under ``--max-restarts`` a round a dead member broke, or a replacement's arrival, restarts the
        rounds from a resync instead (:meth:`_restart_rounds`)."""
        if self.voided is not None:
            return
        if not self.node.max_restarts:
            await self._synchronize()
            return
        k = self.iteration
        try:
            if not self.resync_needed:
                await self._synchronize()
                return
        except PeerFailure as exc:
            if exc.peer is None or exc.peer == self.rank:
                raise
        await self._restart_rounds()
        self.voided = k

    async def _synchronize(self) -> None:
        self._raise_failure()
        k = self.iteration
        if self.synchronized == k:
            return
        grads = self._gradient_buffer()
        if self.replica_rounds is not None:
            await self._synchronize_lanes(grads, k)
            self.synchronized = k
            return
        self._deposit(grads)
        if self.executed > self.consumed:
            self.stale_calls += 1  # a round ran while this rank computed: take its result
            if self.mode == "majority" and self._starts(self.executed):
                self.initiated += 1  # the others wait for this rank: start the next round now
                self._activate(self.executed, self.rank)
        else:
            round_id = self.executed
            if self.requested < round_id and (self.mode == "solo" or self._starts(round_id)):
                self.initiated += 1
                self._activate(round_id, self.rank)
            await self._wait_round(round_id, k)
        self._take_result(grads)
        self.synchronized = k

    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        k = self.iteration
        await self.synchronize()
        if self.voided is not None:
            void, self.voided = self.voided, None
            self.node.record("iteration_voided", iter=void, to=self.iteration)
            self.node.entered(self.iteration, self)  # computed again, from the model the resync gave
            return
        if apply is not None:
            apply()
        every = self.options.full_sync_every
        if every is not None and (k + 1) % every == 0:
            try:
                await self._full_sync(k)
            except PeerFailure as exc:
                if not self.node.max_restarts or exc.peer is None or exc.peer == self.rank:
                    raise
                await self._restart_rounds()  # the resync's broadcast is a full sync too
                if self.iteration != k:
                    self.node.iteration_done(k, self)
                    self.node.entered(self.iteration, self)
                    return
        if last:
            # Rounds may carry buffers some iterations old (a late rank's copy); every rank's last
            # call meets the others' here, with no forward pass left, so they end in step.
            await self.buffer_sync.sync(self.collective, self.everyone, tag=self._tag("buffers/last"))
        self.node.iteration_done(k, self)
        if last:
            return
        self.iteration = k + 1
        self.node.entered(k + 1, self)

    async def _synchronize_lanes(self, grads: torch.Tensor, k: int) -> None:
        """Between replica groups (:mod:`hopnet.protocols.eager.replicas`): hold the gradient until the
        lanes agree on a round to carry it, and take the round whose result they agree on."""
        assert self.replica_rounds is not None
        if self.pend is None:
            self._allocate(grads)
        assert self.computed is not None
        self.computed.add_(grads)
        self.replica_rounds.hold(grads, self.buffer_sync.snapshot() if self.buffer_sync.active else None)
        calls = self.replica_rounds.calls_in + len(self.replica_rounds.held)
        target = await self.replica_rounds.agreed_target(self.executed, self.consumed)
        round_id = target.round_id
        if self.executed <= round_id:
            if self.requested < round_id and (self.mode == "solo" or target.finished_somewhere
                                              or self._starts(round_id)):
                self.initiated += 1
                self._activate(round_id, self.rank)
            await self._wait_round(round_id, k)
        result, dropped = self.replica_rounds.take(round_id, self.executed)
        for buffers in dropped:
            self.buffer_sync.release(buffers)
        stale = result.calls_in < calls  # this call's gradient waits for a later round
        if stale:
            self.stale_calls += 1
            if self.mode == "majority" and self.initiator(round_id + 1) == self.rank \
                    and self.requested < round_id + 1:
                self.initiated += 1  # the others wait for this replica: start the next round now
                self._activate(round_id + 1, self.rank)
        self.last_lag = round_id + 1 - self.consumed
        self.rounds_skipped += max(0, self.last_lag - 1)
        self.consumed = round_id + 1
        self.last_round = round_id
        grads.copy_(result.gradient)
        self.replica_rounds.release(result.gradient)
        if result.buffers is not None:
            self.buffer_sync.adopt(result.buffers)

    def _deposit(self, grads: torch.Tensor) -> None:
        if self.pend is None:
            self._allocate(grads)
        assert self.pend is not None and self.computed is not None
        self.pend.add_(grads)
        self.computed.add_(grads)
        self._fresh = True
        if self.buffer_sync.active:
            if self._buffers_latest is None:
                self._buffers_latest = self.buffer_sync.snapshot()
            else:
                for copy, buffer in zip(self._buffers_latest, self.model_buffers):
                    copy.copy_(buffer)

    async def _wait_round(self, round_id: int, iteration: int) -> None:
        if self.executed > round_id:
            return
        done = self._round_future(round_id)
        started = self.node.clock.now()
        if self.requested < round_id:  # majority: waiting for the designated initiator
            who = self.initiator(round_id)
            what = (f"rank {self.rank}: eager-SGD round {round_id} (majority) to be started by its "
                    f"initiator rank {who}")
            peer: int | None = who
        else:
            what = f"rank {self.rank}: eager-SGD round {round_id} to finish (activation and all-reduce)"
            peer = None
        self._waiting_for = round_id
        try:
            await self.node.clock.wait(asyncio.shield(done), what, peer=peer, iteration=iteration)
        finally:
            self._waiting_for = None
            self.node.waited("updates", self.node.clock.now() - started, () if peer is None else [peer])
        self._raise_failure()

    def _take_result(self, grads: torch.Tensor) -> None:
        assert self.recv is not None
        self.last_lag = self.executed - self.consumed
        self.rounds_skipped += max(0, self.last_lag - 1)  # lag > 1: only the newest result is used
        self.consumed = self.executed
        self.last_round = self.executed - 1
        grads.copy_(self.recv)
        if isinstance(self.grads, FlatGradients):
            self.grads.unpack(grads)
        if self._buffers_result is not None:
            self.buffer_sync.adopt(self._buffers_result)
            self._buffers_result = None

    async def _full_sync(self, iteration: int) -> None:
        if self.mode == "majority":
            # A barrier: a rank that took a round's result late is a round behind the others,
            # which may now wait in this iteration for the round it is to start at its next
            # call. Tell them, so they start it themselves (the engine still serves it here).
            others = [r for r in self.everyone if r != self.rank]
            await self.node.connect_to(others)
            for peer in others:
                self.node.post(Message(ACTIVATION_KIND, self.rank, peer, self.executed, None, {"sync": iteration}))
        await allreduce_each(self.collective, self.everyone, self.flats, "mean", tag=self._tag(f"sync/{iteration}"))
        if self.node.lanes is not None:
            self.node.lanes.mixed_models()  # each lane averaged its slice: the members share theirs

    # ------------------------------------------------------------------ replacements (--max-restarts)
    async def _restart_rounds(self) -> None:
        """Drop the rounds in flight and the gradients pending (lost), resynchronize every rank's model
        and iteration (:mod:`hopnet.protocols.resync`), and number the rounds from there alike."""
        self._deferred = []
        tasks = [t for t in (self._engine, *self._tasks) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.peer_timeout_s)
        self._engine = None
        self._tasks.clear()
        self._failure = None
        self._round_done.clear()
        self._seen.clear()
        self._waiting_for = None
        self.syncing.clear()
        if self.pend is not None:
            self.pend.zero_()
            if self._spare is None:  # a round was cancelled after taking it
                self._spare = torch.zeros_like(self.pend)
        self._fresh = False
        try:
            done = await resynchronize(self.node, self.collective, self.everyone, self.iteration,
                                       self.model_tensors(), self._tag, self.config.timeout_s,
                                       counters=[self.executed])
        finally:
            deferred, self._deferred = self._deferred, None
        self.executed = self.consumed = done.counters[0]
        self.requested = self.executed - 1
        self.missed_rounds += max(0, self.executed - len(self.active_per_round))
        del self.active_per_round[self.executed:]  # a round cut short here ran nowhere
        self.active_per_round += [0] * (self.executed - len(self.active_per_round))  # ran without this process
        self.iteration = done.furthest
        self.synchronized = -1
        self.resync_needed = False
        self.resyncs += 1
        for round_id, root in deferred:
            self._activate(round_id, root)

    def on_peer_rejoined(self, peer: int) -> None:
        self.resync_needed = True
        self.left_early.pop(peer, None)
        self.finished.discard(peer)

    def rejoin_at(self, iteration: int, state: Mapping[str, Any]) -> None:
        super().rejoin_at(iteration, state)
        self.resync_needed = True

    # ------------------------------------------------------------------ resume from checkpoints
    async def after_resume(self) -> None:
        """Every rank resumes from its checkpoint of the same iteration with the rounds numbered from
        0 again and nothing pending (the gradients that were in ``pend`` or in a round at the kill are
        lost). The checkpoints need not hold the same model: a rank that took only the newest of
        several finished rounds skipped the others' results. So the lowest rank's model (parameters
        and floating buffers) goes to every rank, exactly, before any trainer computes: the resumed
        run starts from one model, as the first run did."""
        if self.world_size < 2 or not self.flats:
            return
        if self.rank != 0:
            for tensor in self.flats:
                tensor.zero_()
        await allreduce_each(self.collective, self.everyone, self.flats, "sum", tag=self._tag("resume"))

    # ------------------------------------------------------------------ peers and the end
    def on_peer_departed(self, peer: int, last_iteration: int) -> None:
        self.left_early[peer] = last_iteration
        self._peer_gone(peer, "departed", f"left after iteration {last_iteration}")

    def on_peer_dead(self, peer: int) -> None:
        self.left_early[peer] = self.iteration - 1
        self._peer_gone(peer, "dead", f"went silent (rank {peer} unreachable from rank {self.rank})")

    def _peer_gone(self, peer: int, state: str, why: str) -> None:
        """A round needs every rank: fail the ones this rank waits for, naming the peer."""
        if self._round_done:
            waiting = min(self._round_done)
            self._fail(PeerFailure(f"rank {self.rank}: eager-SGD round {waiting} cannot finish: rank {peer} {why}",
                                   peer=peer, peer_state=state, iteration=self.iteration))

    async def stop(self) -> None:
        """Keep serving the others' rounds until every rank has finished, then say goodbye.

        A rank that finished its iterations still contributes (its pending buffer) to rounds
        the slower ranks start; the closing all-reduce is the barrier after which no rank
        starts one. Its waits run under the configured timeout like every other. A rank whose
        run failed, or whose peers are leaving early, skips the barrier and only says goodbye,
        so the others' waits on it fail at once instead of timing out."""
        n = self.world_size
        if n < 2:
            return
        if not self.left_early and self._failure is None and not self._finished_with_everyone:
            await self._finish_with_everyone()
        # the ring neighbours, the only ranks that wait on this one's messages; one that left
        # already needs no goodbye
        await self.say_goodbye((peer for peer in {(self.rank - 1) % n, (self.rank + 1) % n}
                                if peer not in self.left_early), final_iteration=False)

    async def quiesce(self) -> None:
        """Serve the others' rounds until every rank has finished: the closing barrier of
        :meth:`stop`, run now, so that no round starts once the consensus begins."""
        if self.world_size > 1 and not self.left_early and self._failure is None \
                and not self._finished_with_everyone:
            await self._finish_with_everyone()

    async def _finish_with_everyone(self) -> None:
        others = [r for r in self.everyone if r != self.rank]
        await self.node.connect_to(others)
        for peer in others:
            self.node.post(Message(ACTIVATION_KIND, self.rank, peer, self.executed, None, {"fin": 1}))
        done = torch.zeros(1, dtype=torch.float64)
        await self.collective.allreduce(self.everyone, done, "sum", tag=self._tag("done"))
        # No round starts after the barrier, but this rank's part of the last one may still be
        # receiving (the others' parts of it finished, so they could pass the barrier).
        if self._engine is not None:
            await self._engine
        for task in list(self._tasks):
            await task
        self._raise_failure()
        self._finished_with_everyone = True

    def buffers_for(self, header: Header) -> Any:
        return None

    # ------------------------------------------------------------------ reporting
    def snapshot(self) -> dict[str, Any]:
        round_id = self.last_round
        return {"round": round_id,
                "active": self.active_per_round[round_id] if round_id is not None else None,
                "lag": self.last_lag}

    def summary(self) -> dict[str, Any]:
        counts = self.active_per_round
        histogram: dict[str, int] = {}
        for c in counts:
            histogram[str(c)] = histogram.get(str(c), 0) + 1
        return {"rounds": self.executed, "mode": self.mode, "initiated": self.initiated,
                "stale_calls": self.stale_calls, "rounds_skipped": self.rounds_skipped,
                "active_mean": round(sum(counts) / len(counts), 4) if counts else None,
                "active_histogram": dict(sorted(histogram.items(), key=lambda kv: int(kv[0])))}


__all__ = ["EagerProtocol", "activation_targets", "majority_initiator"]
