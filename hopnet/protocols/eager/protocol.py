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
which imports no torch.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Coroutine, Mapping
from typing import Any

import torch

from hopnet.collectives.ring import RingCollective
from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError, HopnetError, PeerFailure, ProtocolError
from hopnet.model_state import ModelState
from hopnet.params import FlatGradients
from hopnet.protocols.base import ApplyFn, Protocol, allreduce_each
from hopnet.protocols.buffer_sync import BufferSync
from hopnet.protocols.resync import resynchronize
from hopnet.protocols.eager.options import ACTIVATION_KIND, EagerOptions
from hopnet.runtime.services import NodeServices
from hopnet.wire import Header, Message

TAG_PREFIX = "eager"


def majority_initiator(seed: int, round_id: int, world_size: int) -> int:
    """The designated initiator of a majority round: the same on every rank, no messages."""
    digest = hashlib.blake2b(f"{seed}:{round_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % world_size


def activation_targets(rank: int, root: int, world_size: int) -> list[int]:
    """Where ``rank`` sends (or forwards) the activation of the tree rooted at ``root``.

    On ranks relative to the root, the root sends on every dimension k (to ``2^k``); a rank
    that received on dimension i (its highest set bit) forwards on every dimension j > i.
    Relative ranks make it a binomial tree for any P, not only powers of two."""
    rel = (rank - root) % world_size
    first = rel.bit_length()  # dimensions above the one it received on (0 for the root)
    targets = []
    k = first
    while rel + (1 << k) < world_size:
        targets.append((root + rel + (1 << k)) % world_size)
        k += 1
    return targets


class EagerProtocol(Protocol):
    name = "eager-sgd"

    def __init__(self, config: ProtocolConfig, options: EagerOptions, model: ModelState | torch.Tensor | None,
                 grads: FlatGradients | torch.Tensor | None) -> None:
        super().__init__()
        if isinstance(grads, torch.Tensor) and (grads.dim() != 1 or not grads.is_contiguous()):
            raise ConfigError("eager-sgd reduces one flat, contiguous gradient buffer")
        state = ModelState.wrap(model)
        if options.full_sync_every is not None and state is None:
            raise ConfigError("--full-sync-every averages the models: start the worker with hopnet.init(model)")
        self.config = config
        self.options = options
        self.mode = options.eager_mode
        self.flats = state.flats if state is not None else []
        self.model_buffers = state.buffers if state is not None else []
        self.grads = grads
        self.everyone: tuple[int, ...] = ()
        # The round engine (runs on the node's loop).
        self.executed = 0            # rounds this rank has finished
        self.requested = -1          # highest round an activation (or this rank) asked for
        self.consumed = 0            # rounds whose results the trainer has taken
        self._seen: set[tuple[int, int]] = set()   # (round, root) activations already handled
        self._engine: asyncio.Task[None] | None = None
        self._round_done: dict[int, asyncio.Future[None]] = {}
        self._failure: BaseException | None = None
        self._fresh = False          # pend holds a gradient of the trainer's current call
        self._tasks: set[asyncio.Task[None]] = set()
        self.left_early: dict[int, int] = {}
        self.finished: set[int] = set()  # ranks that said they finished their iterations
        self.syncing: dict[int, int] = {}  # rank -> the iteration whose full sync it entered
        self._finished_with_everyone = False  # passed the closing barrier (quiesce or stop)
        self._waiting_for: int | None = None  # the round the trainer's call waits for
        self.synchronized = -1       # the last iteration whose gradient went into a round
        self.resync_needed = False   # --max-restarts: a replacement joined; restart the rounds first
        self.voided: int | None = None  # the iteration a resync threw away
        self.resyncs = 0
        self.missed_rounds = 0  # rounds a replacement counts as run without it (0 active, here)
        self._deferred: list[tuple[int, int]] | None = None  # activations that came during a resync
        # Buffers, allocated on the first call (their size comes from the gradients).
        self.pend: torch.Tensor | None = None
        self.recv: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None
        self.contributed: torch.Tensor | None = None  # sum of what this rank put into rounds
        self.computed: torch.Tensor | None = None     # sum of every gradient the trainer deposited
        self._buffers_latest: list[torch.Tensor] | None = None  # the model's buffers at the last call
        self._buffers_result: list[torch.Tensor] | None = None  # those of the last round, reduced
        # Reporting.
        self.active_per_round: list[int] = []  # fresh gradients in round r, at index r
        self.last_round: int | None = None
        self.last_lag = 0
        self.stale_calls = 0
        self.initiated = 0
        self.rounds_skipped = 0

    def bind(self, node: NodeServices) -> None:
        super().bind(node)
        self.rank = node.rank
        self.world_size = node.graph.n
        self.everyone = tuple(range(self.world_size))
        # Its own ring over the node's messages, whatever --bulk picked: eager's rounds, full
        # syncs and the closing reduce interleave differently on different ranks, which only
        # a collective that keeps every tag apart (not one process group in call order) allows.
        self.collective = RingCollective(node)
        self.buffer_sync = BufferSync(self.options.buffers, self.model_buffers, self.rank, self.world_size)

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

    def initiator(self, round_id: int) -> int:
        return majority_initiator(self.config.seed, round_id, self.world_size)

    def _starts(self, round_id: int) -> bool:
        """Whether this rank starts majority round ``round_id``: it is the designated initiator, or the
        designated one has finished its iterations (and will never call again), or waits in a full sync
        this rank has not passed (it calls again only once this rank got there, on these rounds)."""
        if self.requested >= round_id:
            return False
        who = self.initiator(round_id)
        return who == self.rank or who in self.finished or self.syncing.get(who, -1) >= self.iteration

    def _allocate(self, like: torch.Tensor) -> None:
        self.pend = torch.zeros_like(like)
        self.recv = torch.zeros_like(like)
        self._spare = torch.zeros_like(like)
        self.contributed = torch.zeros_like(like)
        self.computed = torch.zeros_like(like)

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

    def _gradient_buffer(self) -> torch.Tensor:
        if isinstance(self.grads, FlatGradients):
            return self.grads.gather()
        if self.grads is None:
            raise ConfigError("--protocol eager-sgd averages gradients: start the worker with "
                              "hopnet.init(model), or give Worker a grads buffer")
        return self.grads

    # ------------------------------------------------------------------ activations
    def on_message(self, msg: Message) -> None:
        if msg.kind == ACTIVATION_KIND and msg.meta and msg.meta.get("fin") == 1:
            self._peer_finished(msg.src)
            return
        if msg.kind == ACTIVATION_KIND and msg.meta and isinstance(msg.meta.get("sync"), int):
            self._peer_syncing(msg.src, msg.meta["sync"])
            return
        root = msg.meta.get("r") if msg.meta else None
        if msg.kind != ACTIVATION_KIND or not isinstance(root, int) or not 0 <= root < self.world_size \
                or msg.iter < 0:
            self.node.count_drop("unexpected_kind" if msg.kind != ACTIVATION_KIND else "bad_activation")
            return
        if self.node.max_restarts and (msg.meta or {}).get("e") != self.node.epoch:
            self.node.count_drop("stale_activation")  # for a round from before a replacement
            return
        if self._deferred is not None:  # a rank done with the resync already: its round runs after this one's
            self._deferred.append((msg.iter, root))
            return
        self._activate(msg.iter, root)

    def _activate(self, round_id: int, root: int) -> None:
        """An activation of ``round_id`` from the tree of ``root`` (this rank's own, or received)."""
        if round_id < self.executed or (round_id, root) in self._seen:
            return  # that round has run (every rank joined it), or this tree was forwarded already
        self._seen.add((round_id, root))
        targets = activation_targets(self.rank, root, self.world_size)
        if targets:
            self._spawn(self._send_activation(round_id, root, targets))
        if round_id > self.requested:
            self.requested = round_id
        if self._engine is None or self._engine.done():
            self._engine = asyncio.get_running_loop().create_task(self._run_rounds())

    async def _send_activation(self, round_id: int, root: int, targets: list[int]) -> None:
        epoch = {"e": self.node.epoch} if self.node.max_restarts else {}
        await self.node.connect_to(targets)
        for dst in targets:
            self.node.post(Message(ACTIVATION_KIND, self.rank, dst, round_id, None, {"r": root, **epoch}))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self._fail(error)

    # ------------------------------------------------------------------ the round engine
    async def _run_rounds(self) -> None:
        """Run every requested round, in order (the progress engine, on the node's loop)."""
        try:
            while self.executed <= self.requested and self._failure is None:
                await self._execute(self.executed)
        except BaseException as exc:  # the waiting trainer gets it
            self._fail(exc)

    async def _execute(self, round_id: int) -> None:
        # Swap pend for zeros the moment the round reads it: a gradient deposited while the
        # all-reduce runs belongs to the next round.
        if self.pend is None:  # activated before the trainer's first call
            self._allocate(self._gradient_shape_source())
        contribution = self.pend
        assert contribution is not None and self._spare is not None and self.contributed is not None
        self.pend = self._spare.zero_()
        self._spare = None
        self.contributed.add_(contribution)
        active = torch.tensor([1.0 if self._fresh else 0.0], dtype=torch.float64)
        self._fresh = False
        tag = self._tag(str(round_id))
        collective = self.collective
        # before the first call: the buffers as they are (the trainer's first forward may be writing them)
        model_buffers = self.buffer_sync.snapshot(self._buffers_latest) if self.buffer_sync.active else None
        await asyncio.gather(collective.allreduce(self.everyone, contribution, "sum", tag=tag),
                             collective.allreduce(self.everyone, active, "sum", tag=f"{tag}/active"),
                             *([self.buffer_sync.reduce(collective, self.everyone, model_buffers, tag=f"{tag}/buffers")]
                               if model_buffers is not None else []))
        contribution.div_(self.world_size)  # always P, however many were fresh
        if model_buffers is not None:
            if self._buffers_result is not None:
                self.buffer_sync.release(self._buffers_result)  # a newer round's buffers replace them
            self._buffers_result = model_buffers
        self._spare, self.recv = self.recv, contribution
        self.active_per_round.append(int(round(active.item())))
        self.executed = round_id + 1
        self._seen = {key for key in self._seen if key[0] > round_id}
        done = self._round_done.pop(round_id, None)
        if done is not None and not done.done():
            done.set_result(None)

    def _gradient_shape_source(self) -> torch.Tensor:
        """The gradient buffer, only to size ours: the trainer may be writing into it."""
        if isinstance(self.grads, FlatGradients):
            return self.grads.buffer
        return self._gradient_buffer()

    def _round_future(self, round_id: int) -> asyncio.Future[None]:
        future = self._round_done.get(round_id)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._round_done[round_id] = future
        return future

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        for future in self._round_done.values():
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: the trainer may have stopped waiting
        self._round_done.clear()

    def _raise_failure(self) -> None:
        exc = self._failure
        if exc is None:
            return
        if isinstance(exc, HopnetError):
            raise exc
        raise ProtocolError(f"rank {self.rank}: eager-SGD round {self.executed} failed: {exc}") from exc

    def _peer_syncing(self, peer: int, iteration: int) -> None:
        self.syncing[peer] = iteration
        self._start_for_waiting()

    def _peer_finished(self, peer: int) -> None:
        self.finished.add(peer)
        self._start_for_waiting()

    def _start_for_waiting(self) -> None:
        """The round the trainer waits for may have lost its initiator (finished, or in a sync)."""
        waiting = self._waiting_for
        if waiting is not None and self.mode == "majority" and self._starts(waiting):
            self.initiated += 1
            self._activate(waiting, self.rank)

    # ------------------------------------------------------------------ replacements (--max-restarts)
    def _tag(self, what: str) -> str:
        """A round's tag; under ``--max-restarts`` with the replacements every rank took back."""
        return f"{TAG_PREFIX}/{what}@{self.node.epoch}" if self.node.max_restarts else f"{TAG_PREFIX}/{what}"

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
        self._peer_gone(peer, "dead", "went silent")

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
