"""eager-SGD's rounds, on the node's loop: an activation spreads along the union of binomial trees
from its initiator, and the engine runs every requested round in order, each one all-reduce of every
rank's pending gradients (see :mod:`hopnet.protocols.eager.protocol` for the algorithm).

:class:`EagerRounds` holds the protocol's state; :class:`~hopnet.protocols.eager.protocol.EagerProtocol`
adds the trainer's side (deposit a gradient, wait for a round, take its result), the replacements and
the end of the run."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Coroutine
from typing import Any

import torch

from hopnet.collectives.ring import RingCollective
from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError, HopnetError, ProtocolError
from hopnet.model_state import ModelState
from hopnet.params import FlatGradients
from hopnet.protocols.base import Protocol
from hopnet.protocols.buffer_sync import BufferSync
from hopnet.protocols.eager.options import ACTIVATION_KIND, EagerOptions
from hopnet.protocols.eager.replicas import ReplicaRounds
from hopnet.runtime.services import NodeServices
from hopnet.wire import Message

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


class EagerRounds(Protocol):
    """The round engine and the activations that request its rounds, with the protocol's state."""

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
        self.replica_rounds: ReplicaRounds | None = None  # between replica groups: what the lanes agree on

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
        if node.lanes is not None:
            self.replica_rounds = ReplicaRounds(node.lanes)

    def _tag(self, what: str) -> str:
        """A round's tag; under ``--max-restarts`` with the replacements every rank took back."""
        return f"{TAG_PREFIX}/{what}@{self.node.epoch}" if self.node.max_restarts else f"{TAG_PREFIX}/{what}"

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

    def _gradient_buffer(self) -> torch.Tensor:
        if isinstance(self.grads, FlatGradients):
            return self.grads.gather()
        if self.grads is None:
            raise ConfigError("--protocol eager-sgd averages gradients: start the worker with "
                              "hopnet.init(model), or give Worker a grads buffer")
        return self.grads

    def _gradient_shape_source(self) -> torch.Tensor:
        """The gradient buffer, only to size ours: the trainer may be writing into it."""
        if isinstance(self.grads, FlatGradients):
            return self.grads.buffer
        return self._gradient_buffer()

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
        if self.replica_rounds is not None:
            await self._move_agreed()
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
        if self.replica_rounds is not None:
            self._keep_result(round_id, contribution, model_buffers)
        else:
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

    async def _move_agreed(self) -> None:
        """Between replica groups: the held gradients every lane of the replica has go into this round."""
        assert self.replica_rounds is not None and self.pend is not None
        moved = await self.replica_rounds.agreed_moves()
        for entry in moved:
            self.pend.add_(entry.gradient)
            self.replica_rounds.release(entry.gradient)
            if entry.buffers is not None:
                if self._buffers_latest is not None:
                    self.buffer_sync.release(self._buffers_latest)
                self._buffers_latest = entry.buffers
        self._fresh = bool(moved)

    def _keep_result(self, round_id: int, result: torch.Tensor, buffers: list[torch.Tensor] | None) -> None:
        """Between replica groups: keep the round's result until the lanes agree which one a call takes."""
        assert self.replica_rounds is not None
        for dropped in self.replica_rounds.keep(round_id, result, buffers, executed=round_id + 1):
            self.buffer_sync.release(dropped)
        self._spare = self.replica_rounds.spare_like(result)

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
