"""Hop: queue-based decentralized training (Hop, ASPLOS'19, Sec. 3-6).

One class covers the settings of Hop's Table 1, combined as the paper combines them:

* standard decentralized training, parallel (default) or serial approach (Sec. 3.2),
  with token queues bounding the gap between neighbours by ``max_ig`` (Fig. 7);
* backup workers (Fig. 8): a worker needs ``|N_in(i)| - N_buw(i)`` updates of its
  iteration and takes whatever else of that iteration has already arrived;
* bounded staleness (Fig. 9): the newest update per in-neighbour, if no older than
  ``k - s``, mixed with the iteration-weighted average of Eq. 2;
* iteration skipping (Sec. 5) for a worker that finds itself far behind;
* notify-ack (Sec. 3.3), the baseline Hop improves on: a worker enters iteration
  ``k`` only once every out-neighbour has acknowledged consuming its update ``k - 1``.

Slow links. With bounded staleness a receiver only ever uses the newest update of each
in-neighbour, so an update that has not left this process when a newer one is ready is
worthless: updates go by ``post_latest`` (on a link slower than the worker, at most one
waits per out-neighbour, the newest), and credits go as tokens on the transport's express
lane, behind no update bytes. A fast worker then runs at its own pace across a slow link
instead of the link's: backup workers spare it the wait for the remote update, and the
tokens keep the gap bound. Without staleness every update of an iteration may be needed,
so nothing is replaced and credits ride on the updates.

Tokens travel as credits. When a worker enters iteration ``k`` it grants its
in-neighbours a token; where the in-neighbour is also an out-neighbour the credit
rides on the update it sends anyway, so a symmetric graph pays no extra message.
The grants also tell a worker which iteration each out-neighbour has reached, which
is all it needs to skip sending updates that would arrive late (Sec. 6.2), with no
round trip.

Its declaration (options, what it refuses, what it registers) is :mod:`hopnet.protocols.hop.spec`,
which imports no torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError, PeerFailure, ProtocolError, WaitTimeout
from hopnet.finite import all_finite_in
from hopnet.graph import Graph
from hopnet.model_state import ModelState
from hopnet.protocols.base import ApplyFn, Protocol
from hopnet.protocols.hop.options import WELCOME, HopOptions, restart_refusal
from hopnet.protocols.local_steps import mixes_at, mixing_iteration, round_of, rounds_sent_by
from hopnet.protocols.hop.mix_sums import MixSums, Region, RegionPool, mix_into, plan_regions
from hopnet.runtime.services import NodeServices
from hopnet.protocols.hop.queues import BufferPool, TokenCredits, Update, UpdateQueue
from hopnet.transports.base import DISCARD
from hopnet.wire import Header, Message, TensorSpec

CREDIT = "c"
PART = "p"
"""Meta key of one chunk of a streamed update: its region's index in the plan (:func:`plan_regions`)."""
STREAM_WINDOW = 2
"""Chunks of one streamed update in the transport at once, per out-neighbour: one on the wire, one
queued behind it. The receiver then has about as many in flight (the torch plane posts a receive per
chunk whose header came), whatever the update's size."""


_ANY_SENDER = -1
"""The receive pool's one key (see :class:`BufferPool`): buffers are shared by all senders."""


class HopProtocol(Protocol):
    name = "hop"

    def __init__(self, config: ProtocolConfig, options: HopOptions, model: ModelState | torch.Tensor | None, *,
                 notify_ack: bool = False) -> None:
        super().__init__()
        state = ModelState.wrap(model)
        flats = state.flats if state is not None else []
        if any(f.dim() != 1 or not f.is_contiguous() for f in flats):
            raise ConfigError("Hop mixes flat, contiguous tensors (see hopnet.model_state.ModelState)")
        self.config = config
        self.options = options
        self.flats = flats
        """What an update carries and the reduce mixes: the model's flat tensors (parameters and
        floating buffers, one per dtype), all with the same weights."""
        self.notify_ack = notify_ack
        self.use_tokens = options.token_queues and not self.notify_ack
        self.staleness = options.staleness
        self.local_steps = options.local_steps
        self.specs = tuple(TensorSpec(f.dtype, tuple(f.shape)) for f in flats)
        self.skipped_iterations = 0
        self.late_updates_dropped = 0
        self.updates_not_sent = 0
        self.skip_log: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ set-up
    def bind(self, node: NodeServices) -> None:
        super().bind(node)
        graph, rank = node.graph, node.rank
        self.rank = rank
        self.in_peers: tuple[int, ...] = graph.in_peers(rank)
        self.out_peers: tuple[int, ...] = graph.out_peers(rank)
        self._in_peer_set = frozenset(self.in_peers)
        self._out_peer_set = frozenset(self.out_peers)
        self.peers: tuple[int, ...] = tuple(sorted(self._in_peer_set | self._out_peer_set))
        self.self_weight = graph.weight(rank, rank)
        self.in_weight = {j: graph.weight(j, rank) for j in self.in_peers}
        self.n_buw = self.options.backup_workers_for(rank)
        if self.n_buw > len(self.in_peers):
            raise ConfigError(f"rank {rank} has {len(self.in_peers)} in-neighbours besides itself, "
                              f"so it cannot have {self.n_buw} backup workers")
        factory: Callable[[], list[torch.Tensor]] | None = None
        if self.flats:
            flats = self.flats
            factory = lambda: [torch.empty_like(f) for f in flats]  # noqa: E731
        self.num_slots = self._slots_needed(graph)
        self.queue = UpdateQueue(self.num_slots)
        self.summing = self.staleness is None and bool(self.flats)
        """Mix by accumulation (:mod:`hopnet.protocols.hop.mix_sums`): the queue then only records which
        updates came. With staleness the newest update of a sender replaces its older one, which
        a sum could not take back, so the queue keeps the newest update's tensors until the reduce."""
        # With staleness: one pool for every sender: a buffer is held only while it is received or
        # the newest update of its sender, so no sender needs buffers of its own.
        self.pool = BufferPool(factory if not self.summing else None, (_ANY_SENDER,), per_sender=1)
        model_bytes = sum(spec.nbytes for spec in self.specs)
        chunk = self.options.stream_bytes(self.config.bulk, model_bytes)
        self.streaming = self.summing and chunk > 0 and model_bytes > chunk
        """Updates go as chunks of ``--stream-mib``, each added into its sum as it arrives."""
        self.regions = plan_regions(self.specs, chunk if self.streaming else None, [f.device for f in self.flats])
        self.region_pool = RegionPool()
        self.sums = MixSums(self.regions, self.region_pool)
        self._arriving: dict[tuple[int, int], set[int]] = {}
        """(iteration, sender) -> the chunks of a streamed update received so far."""
        self._reduced = -1
        """The last iteration mixed into the model: chunks of it that come later are dropped."""
        self._awaiting = -1
        """The newest iteration :meth:`_recv` waited for (a skip waits past the next iteration)."""
        self._hold_from = frozenset(j for j in self.in_peers if self.summing and self.options.hold_back
                                    and self.options.backup_workers_for(j) == 0 and rank in graph.in_peers(j))
        """In-neighbours whose updates of the iterations after the one this worker mixes next are held
        back, unread, on a transport that can (:meth:`hold`): those that need this worker's updates
        (no backup workers), so that holding theirs back couples them to this worker no more than
        they already are."""
        self.updates_held = 0
        self._last_held: dict[int, tuple[int, Any]] = {}
        self.late_chunks_dropped = 0
        self.tokens = TokenCredits(self.out_peers, self.options.max_ig)
        self.acks: dict[int, int] = {j: -1 for j in self.out_peers}
        self.last_used: dict[int, int] = {j: -1 for j in self.in_peers}
        self.newest_received: dict[int, int] = {j: -1 for j in self.in_peers}
        self.departed_after: dict[int, int] = {}
        # --max-restarts: peers that came back as new processes; a replacement's view of its neighbours
        self._joined_late: set[int] = set()
        self.welcomes: dict[int, int] = {}
        self._welcomed: asyncio.Event | None = None
        self._rejoin_from = 0
        self._started_at: int | None = None

    def _slots_needed(self, graph: Graph) -> int:
        """Rotating slots: how far ahead an in-neighbour can be, plus how far back we still look."""
        if self.use_tokens:
            lead = self.options.max_ig
        elif self.notify_ack:
            lead = 2
        else:
            factor = 1 if self.staleness is None else self.staleness + 1
            back = graph.back_lengths()
            lead = factor * max((back[j, self.rank] for j in self.in_peers), default=1)
        return lead + (self.staleness or 0) + 1

    # ------------------------------------------------------------------ receiving
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
        return self.pool.acquire(_ANY_SENDER)

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
        on the iteration, no cycle of waits (docs/design.md, "Memory")."""
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
        return (self.queue.size(iter=k) >= len(self._expected(k))
                and not any(key[0] == k for key in self._arriving))

    def _regions_of(self, header: Header) -> tuple[Region, ...]:
        part = header.meta.get(PART) if header.meta else None
        if type(part) is int and 0 <= part < len(self.regions):
            return (self.regions[part],)
        return self.regions

    def _release(self, tensors: list[torch.Tensor] | None) -> None:
        if tensors is None:  # nothing to give back (an update without a model: the simulator's, mostly)
            return
        if not self.summing:
            self.pool.release(_ANY_SENDER, tensors)
        elif not self.streaming:
            for t in tensors:
                self.region_pool.give(t)

    def _store(self, update: Update) -> bool:
        """Queue an update (False for a duplicate, whose buffers are given back); when summing, its
        tensors go into its iteration's sum (a non-finite update is counted, named and left out).
        Raises :class:`ProtocolError` (nothing released) past the queue's window."""
        tensors = update.tensors if self.specs else None
        if not self.summing:
            update.tensors = tensors
            if not self.queue.enqueue(update):
                self._release(tensors)
                return False
            return True
        update.tensors = None
        if not self.queue.enqueue(update):
            self._release(tensors)
            return False
        if tensors is None:
            return True
        if not all_finite_in(tensors):
            self._drop_non_finite(update.iter, update.src, update.iter)
            self._release(tensors)
            return True
        self._release(self.sums.add_whole(update.iter, tensors, self.in_weight[update.src]))
        self.node.take_in_held()  # a buffer may have been freed
        return True

    def _drop_non_finite(self, k: int, src: int, update_iter: int) -> None:
        self.node.count_drop("non_finite")
        self.node.record("non_finite", iter=k, src=src, update_iter=update_iter)

    def on_message(self, msg: Message) -> None:
        kind = msg.kind
        if kind == "update":
            if msg.src in self._joined_late and self._beyond_window(msg.iter):
                # a replacement that started further ahead than this worker's queue reaches (it took the
                # furthest neighbour's pace): its update is dropped, as one would be on a lossy link
                self.node.count_drop("update_beyond_window")
                self._release(msg.tensors if self.specs else None)
                self._on_credit(msg)
                return
            self._on_credit(msg)
            if msg.src not in self._in_peer_set:
                return
            if msg.meta and PART in msg.meta:
                self._on_chunk(msg)
                return
            if msg.iter > self.newest_received[msg.src]:
                self.newest_received[msg.src] = msg.iter
            if self._is_late(msg.iter, msg.src) or (self.staleness is not None
                                                    and msg.iter < self.queue.newest_iter(msg.src)):
                self.late_updates_dropped += 1
                self._release(msg.tensors if self.specs else None)
                return
            if self.staleness is not None:
                # Only the newest update per in-neighbour is ever used (Sec. 6.1): keep one.
                self._release_updates(self.queue.take(w_id=msg.src))
            self._store(Update(msg.iter, msg.src, msg.tensors))
        elif kind == "token":
            self._on_credit(msg)
        elif kind == WELCOME:
            self._on_welcome(msg)
        elif kind == "ack":
            if msg.src in self._out_peer_set and msg.iter > self.acks[msg.src]:
                self.acks[msg.src] = msg.iter
                self.tokens.wake()
        else:
            self.node.count_drop("unexpected_kind")

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

    @property
    def round(self) -> int:
        """The round this worker is in (``--local-steps``): what its messages, queues and tokens count;
        the iteration itself when every iteration mixes."""
        return self.iteration // self.local_steps  # round_of(), inline: read several times per message

    def _mixes(self, iteration: int) -> bool:
        return mixes_at(iteration, self.local_steps, self.final_iteration)

    def _oldest_useful(self) -> int:
        return self.round - (self.staleness or 0)

    def _is_late(self, iteration: int, src: int) -> bool:
        if iteration < self.round - (self.staleness or 0):  # _oldest_useful(), inline: once per update
            return True
        return self.staleness is not None and iteration <= self.last_used[src]

    def on_peer_departed(self, peer: int, last_iteration: int) -> None:
        # a goodbye names the peer's iteration: it sent its model up to the round it last entered
        final = self.node.final_iterations.get(peer, self.final_iteration)
        self._departed(peer, rounds_sent_by(last_iteration, self.local_steps, final))

    def _departed(self, peer: int, last_round: int) -> None:
        self.departed_after[peer] = last_round
        if peer in self._out_peer_set:
            self.tokens.depart(peer)
        self.queue.wake()

    def on_peer_dead(self, peer: int) -> None:
        # Nothing is on its way from a dead peer: the newest update it sent is its last.
        self._departed(peer, self.newest_received.get(peer, -1))

    # ------------------------------------------------------------------ replacements (--max-restarts)
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

    def _beyond_window(self, iteration: int) -> bool:
        return iteration >= self.round + self.num_slots - (self.staleness or 0)

    def _expected(self, k: int) -> Sequence[int]:
        """In-neighbours that will still send an update of iteration ``k``."""
        gone = self.departed_after
        if not gone:
            return self.in_peers
        return [j for j in self.in_peers if gone.get(j, k) >= k]

    # ------------------------------------------------------------------ iteration flow
    async def start(self) -> None:
        """Nothing yet: iteration 0 is entered (and the model sent) in :meth:`begin`."""

    def resume_at(self, iteration: int) -> None:
        super().resume_at(iteration)
        # Every rank resumes at ``iteration`` (in the middle of a round, possibly: it mixes where it
        # would have): no ack of an earlier round will come.
        before = self.round - 1
        self.acks = {j: before for j in self.acks}
        self.last_used = {j: before for j in self.last_used}
        self.newest_received = {j: before for j in self.newest_received}

    async def begin(self) -> None:
        if self._mixes(self.iteration):
            await self._enter(self.iteration, 1)

    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        k = self.iteration
        if not self._mixes(k):  # a local step (--local-steps): no message, no wait
            if apply is not None:
                apply()
            self.node.iteration_done(k, self)
            if not last:
                await self._advance(k + 1, 1)
            return
        await self._mix(apply, k, self.round, last)

    async def _mix(self, apply: ApplyFn | None, k: int, r: int, last: bool) -> None:
        """Finish mixing iteration ``k``, the end of round ``r`` (the same number without local steps)."""
        if self.options.serial:
            if apply is not None:
                apply()
            self._send_updates(r, credit=0)
            updates, iters = await self._recv(r)
            await self.node.flush()
            self._reduce(updates, iters, r)
        else:
            updates, iters = await self._recv(r)
            await self.node.flush()
            self._reduce(updates, iters, r)
            if apply is not None:
                apply()
        if self.notify_ack:
            for j in self.in_peers:
                if j not in self.departed_after:
                    self.node.post(Message("ack", self.rank, j, r))
        self.node.iteration_done(k, self)
        if last:
            return
        target = await self._maybe_skip(r)  # skipping is refused with local steps: rounds are iterations here
        await self._advance(target if self.local_steps == 1 else k + 1, target - r)

    async def _advance(self, k: int, count: int) -> None:
        """Go on to iteration ``k``; at a mixing iteration, enter its round having advanced ``count`` rounds
        (the token queues' wait, then the grants and, in the parallel approach, the model sent)."""
        if not self._mixes(k):
            self.iteration = k
            return
        if self.use_tokens:
            r = round_of(k, self.local_steps)
            await self._wait(lambda: self.tokens.available(count), self.tokens,
                             lambda: ("tokens", self.tokens.missing(count)), r)
            await self.tokens.acquire(count)
        await self._enter(k, count)

    async def stop(self) -> None:
        await self.say_goodbye(peer for peer in self.peers if peer not in self.departed_after)

    async def _maybe_skip(self, k: int) -> int:
        """Sec. 5: jump ahead when more than ``skip_threshold`` behind every out-neighbour."""
        threshold, max_jump = self.options.skip_threshold, self.options.max_jump
        if threshold is None or max_jump is None:
            return k + 1
        behind = self.tokens.min_lead()
        if behind is None or behind <= threshold:
            return k + 1
        target = k + 1 + min(max_jump, behind - 1)
        # Before jumping to ``target`` the worker needs its in-neighbours' updates of target - 1,
        # and an in-neighbour cannot get more than max_ig iterations ahead of this worker (it
        # needs this worker's tokens). On a directed graph an out-neighbour may be further ahead
        # than that, so cap the jump where the in-neighbours can still deliver.
        target = min(target, k + self.options.max_ig)
        if self.final_iteration is not None:
            target = min(target, self.final_iteration)
        if target <= k + 1:
            return k + 1
        # Renew the parameters with the in-neighbours' updates of iteration target - 1.
        updates, iters = await self._recv(target - 1)
        self._reduce(updates, iters, target - 1)
        self.skipped_iterations += target - k - 1
        self.skip_log.append({"rank": self.rank, "iter": k, "to": target, "behind": behind,
                              "t": round(self.node.clock.now(), 9)})
        self.node.record("skip", iter=k, to=target, behind=behind)
        return target

    async def _enter(self, iteration: int, count: int) -> None:
        """Enter mixing iteration ``iteration``, so its round, having advanced ``count`` rounds: grant, then
        send (parallel). Entries count rounds (its ``enter`` record, the gap tracker)."""
        self.iteration = iteration
        k = self.round
        self._discard_older_than(self._oldest_useful())
        if self.notify_ack and k > 0:
            await self._wait(lambda: all(self.acks[j] >= k - 1 for j in self._live_out()), self.tokens,
                             lambda: ("acks", [j for j in self._live_out() if self.acks[j] < k - 1]), k)
        self.node.entered(k, self)
        credit = count if self.use_tokens else 0
        if self.options.serial:
            if credit:
                for j in self.in_peers:
                    if j not in self.departed_after:
                        self.node.post(Message("token", self.rank, j, k, meta={CREDIT: credit}))
        else:
            self._send_updates(k, credit)

    def _live_out(self) -> list[int]:
        return [j for j in self.out_peers if j not in self.departed_after]

    def _send_updates(self, k: int, credit: int) -> None:
        payload = self.flats
        known = self.tokens.known_iter
        # An out-neighbour already in iteration m uses updates no older than m - s (s = 0
        # without staleness); anything older would be dropped on arrival, so it is not sent.
        newest_useful = k + (self.staleness or 0)
        gone = self.departed_after
        newest_only = self.staleness is not None
        for peer in self.peers:
            if peer in gone:
                continue  # it left: nothing sent to it would be read
            meta = {CREDIT: credit} if credit and peer in self._in_peer_set else None
            if peer in self._out_peer_set and known[peer] <= newest_useful:
                if newest_only:
                    self.node.post_latest(Message("update", self.rank, peer, k, tensors=payload))
                    if meta is not None:
                        self.node.post_express(Message("token", self.rank, peer, k, meta=meta))
                    continue
                self._post_update(peer, k, meta)
            else:
                if peer in self._out_peer_set:
                    self.updates_not_sent += 1
                if meta is not None:
                    self.node.post(Message("token", self.rank, peer, k, meta=meta))

    def _post_update(self, peer: int, k: int, meta: dict[str, Any] | None) -> None:
        """The model as iteration ``k``'s update to ``peer``: one message, or (streaming) one per
        region, in order, the credit riding on the first."""
        if not self.streaming:
            self.node.post(Message("update", self.rank, peer, k, meta=meta, tensors=self.flats))
            return
        chunks = [Message("update", self.rank, peer, k, meta={PART: index, **(meta or {})} if index == 0
                          else {PART: index}, tensors=[region.of(self.flats)])
                  for index, region in enumerate(self.regions)]
        self.node.post_stream(chunks, STREAM_WINDOW)

    async def _recv(self, k: int) -> tuple[list[Update], list[int]]:
        if self.staleness is not None:
            return await self._recv_stale(k)
        if k > self._awaiting:
            self._awaiting = k
            if self._hold_from:  # (never in the simulator: its models have no tensors to sum)
                self.node.take_in_held()
        need = len(self.in_peers) - self.n_buw
        while True:
            await self._wait(lambda: self.queue.size(iter=k) >= min(need, len(self._expected(k)))
                             or self._short_of_peers(k, need), self.queue,
                             lambda: ("updates", self._missing_updates(k)), k)
            if not (self._short_of_peers(k, need) and self.queue.size(iter=k) < need):
                break
            await self._await_replacements(k, need)
        updates = self.queue.take(iter=k)
        return updates, [u.iter for u in updates]

    async def _await_replacements(self, k: int, need: int) -> None:
        """Iteration ``k`` needs the update of a dead in-neighbour: under ``--max-restarts`` wait for its
        replacement (``--timeout`` at most), which sends what the dead process owed; else fail naming it."""
        dead = [j for j in self.in_peers if j in self.node.dead]
        if not self.node.max_restarts or not dead:
            raise self._peer_failure(k, need)
        self.node.handover_point()
        try:
            await self.node.wait_for_rejoins(f"rank {self.rank}'s updates of iteration {k}")
        finally:
            self.node.handover_point(False)

    def _short_of_peers(self, k: int, need: int) -> bool:
        return len(self._expected(k)) < need

    def _peer_failure(self, k: int, need: int) -> PeerFailure:
        """Iteration ``k`` needs an update that departed or dead in-neighbours will never send."""
        gone = sorted(j for j in self.in_peers if j not in self._expected(k))
        # Blame a peer that said nothing before one that said goodbye: a dead peer is the cause,
        # the others may only have left because of it.
        peer = next((j for j in gone if self.node.peer_state(j) == "dead"), gone[0])
        state = self.node.peer_state(peer)
        need_text = (f"rank {self.rank} needs {need} of its {len(self.in_peers)} in-neighbours' "
                     f"updates with {self.n_buw} backup workers")
        others = [j for j in gone if j != peer]
        also = f"; in-neighbour(s) {others} are gone too" if others else ""
        cause = self.node.death_causes.get(peer)
        if state == "dead" and cause is not None:
            message = (f"rank {self.rank} cannot finish {self._at(k)}: peer {peer} is gone (dead: {cause}) "
                       f"and {need_text}{also}")
        elif state == "dead":
            silent = self.node.dead.get(peer, 0.0)
            message = (f"rank {self.rank} cannot finish {self._at(k)}: peer {peer} went silent "
                       f"(dead: nothing heard from it for {silent:.1f}s; its process died or hangs, "
                       f"or its host is unreachable) and {need_text}{also}")
        else:
            message = self._departure_text(peer, k, need_text) + also
        return PeerFailure(message, peer=peer, peer_state=state, iteration=k)

    def _departure_text(self, peer: int, k: int, need_text: str) -> str:
        last = self.departed_after[peer]
        final = self.node.final_iterations.get(peer)
        mine = self.final_iteration
        if final is not None and last >= round_of(final, self.local_steps) and (mine is None or mine > final):
            runs_to = f"runs to iteration {mine}" if mine is not None else f"needs its update of {self._at(k)}"
            return (f"peer {peer} finished at iteration {final} but rank {self.rank} {runs_to}: "
                    "every rank must run the same number of iterations")
        if final is not None and last < round_of(final, self.local_steps):
            return (f"rank {self.rank} cannot finish {self._at(k)}: peer {peer} left at {self._at(last)}, "
                    f"before its last iteration {final}, and {need_text}")
        return (f"rank {self.rank} cannot finish {self._at(k)}: peer {peer} left after {self._at(last)} "
                f"and {need_text}")

    def _at(self, r: int) -> str:
        """Round ``r`` in words: its iteration, or with local steps the round and where it mixes."""
        if self.local_steps == 1:
            return f"iteration {r}"
        return f"round {r} (iteration {mixing_iteration(r, self.local_steps, self.final_iteration)})"

    def _missing_updates(self, k: int) -> list[int]:
        return [j for j in self._expected(k) if not self.queue.size(iter=k, w_id=j)]

    async def _recv_stale(self, k: int) -> tuple[list[Update], list[int]]:
        """Fig. 9 (as its text describes): newest update per in-neighbour if >= k - s."""
        oldest = k - (self.staleness or 0)
        need = len(self.in_peers) - self.n_buw

        def fresh_peers() -> list[int]:
            return [j for j in self.in_peers
                    if self.last_used[j] >= oldest or self._newest_from(j) >= oldest]

        def satisfied() -> bool:
            return len(fresh_peers()) >= min(need, len(self._expected(k)))

        while True:
            await self._wait(satisfied, self.queue,
                             lambda: ("an update no older than iteration %d" % oldest,
                                      [j for j in self._expected(k) if j not in fresh_peers()]), k)
            if not (len(self._expected(k)) < need and len(fresh_peers()) < need):
                break
            await self._await_replacements(k, need)
        chosen: list[Update] = []
        stale: list[Update] = []
        for j in self.in_peers:
            entries = self.queue.take(w_id=j)
            if not entries:
                continue
            newest = max(entries, key=lambda u: u.iter)
            stale.extend(u for u in entries if u is not newest)
            if newest.iter >= oldest and newest.iter > self.last_used[j]:
                self.last_used[j] = newest.iter
                chosen.append(newest)
            else:
                stale.append(newest)
        self._release_updates(stale)
        return chosen, [u.iter for u in chosen]

    def _discard_older_than(self, iteration: int) -> None:
        self._release_updates(self.queue.take_older_than(iteration))
        if self.summing:  # (sums and chunks arriving exist only then)
            self.sums.discard_older_than(iteration)
            for key in [key for key in self._arriving if key[0] < iteration]:
                del self._arriving[key]

    def _release_updates(self, updates: list[Update]) -> None:
        for update in updates:
            self._release(update.tensors)
            update.tensors = None

    def _newest_from(self, j: int) -> int:
        return self.queue.newest_iter(j)

    async def _wait(self, ready: Callable[[], bool], waitable: UpdateQueue | TokenCredits,
                    describe: Callable[[], tuple[str, Sequence[int]]], k: int) -> None:
        """Wait until ``ready()``; on timeout, name what was missing and from whom."""
        if ready():
            return
        node = self.node
        began = node.timer()
        # The peers still missing when the wait was last re-checked: the ones whose arrival ended it.
        missing = list(describe()[1])

        def tracked() -> bool:
            if ready():
                return True
            missing[:] = describe()[1]
            return False

        # Waiting here, the model is consistent (the reduce comes after): a neighbour's replacement may
        # take it now (in a strict run it may be what this worker waits for).
        node.handover_point()
        try:
            await node.clock.wait(waitable.wait_until(tracked), "", iteration=k)
        except WaitTimeout as exc:
            what, peers = describe()
            peer = peers[0] if peers else None
            raise WaitTimeout(f"{what} (rank {self.rank})", peer=peer,
                              peer_state=self.node.peer_state(peer) if peer is not None else None,
                              iteration=k, waited_s=exc.waited_s) from None
        finally:
            node.handover_point(False)
            still = set(describe()[1])
            node.waited("updates" if waitable is self.queue else "tokens", node.timer() - began,
                        [j for j in missing if j not in still] or missing)

    # ------------------------------------------------------------------ mixing
    def _reduce(self, updates: list[Update], iters: list[int], k: int) -> None:
        """Weighted average of this worker's parameters and the received ones (Eq. 1 / Eq. 2)."""
        if self.summing:
            self._reduced = k
            for key in [key for key in self._arriving if key[0] == k]:
                del self._arriving[key]  # its regions that came are in the sum; the rest are late
            summed = self.sums.pop(k)  # what came of iteration k: at least the updates taken
            if summed is not None:
                mix_into(self.flats, self.self_weight, summed, self.regions)
                self.sums.release(summed)
            self.node.take_in_held()  # the next iteration's updates, into the buffers just freed
            return
        if not self.flats or not updates:
            self._release_updates(updates)
            return
        updates, iters = self._finite_only(updates, iters, k)
        if self.staleness is None:
            weights = [self.in_weight[u.src] for u in updates]
            own = self.self_weight
        else:
            base = k - self.staleness
            weights = [self.in_weight[u.src] * (it - base + 1) for u, it in zip(updates, iters)]
            own = self.self_weight * (self.staleness + 1)
        total = own + sum(weights)
        for i, flat in enumerate(self.flats):
            flat.mul_(own / total)
            for update, weight in zip(updates, weights):
                assert update.tensors is not None
                flat.add_(update.tensors[i], alpha=weight / total)
        self._release_updates(updates)

    def _finite_only(self, updates: list[Update], iters: list[int], k: int) -> tuple[list[Update], list[int]]:
        """Leave a non-finite update out of the mix (dropped, counted, its sender named)."""
        kept = [(u, it) for u, it in zip(updates, iters) if u.tensors is None or all_finite_in(u.tensors)]
        if len(kept) == len(updates):
            return updates, iters
        for update in updates:
            if all(update is not u for u, _ in kept):
                self._drop_non_finite(k, update.src, update.iter)
                self._release_updates([update])
        return [u for u, _ in kept], [it for _, it in kept]

    def summary(self) -> dict[str, Any]:
        return {"queue_high_water": self.queue.high_water,
                "token_high_water": self.tokens.high_water if self.use_tokens else None,
                "skipped_iterations": self.skipped_iterations,
                "late_updates_dropped": self.late_updates_dropped, "updates_not_sent": self.updates_not_sent,
                "buffers_allocated": self.pool.allocated + self.region_pool.allocated,
                "sums_high_water": self.sums.high_water, "late_chunks_dropped": self.late_chunks_dropped,
                "updates_held": self.updates_held}

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {"queue": len(self.queue)}
        if self.use_tokens:
            snap["tokens"] = {str(j): self.tokens.tokens(j) for j in self.out_peers}
        return snap


__all__ = ["HopProtocol"]
