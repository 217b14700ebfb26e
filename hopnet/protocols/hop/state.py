"""What every part of Hop's algorithm shares: its state (set up in :meth:`HopState.bind`), the
messages' meta keys, and the bookkeeping each part uses: which round a worker is in, which updates
are late or still expected, and queueing or releasing an update's buffers.

:class:`~hopnet.protocols.hop.protocol.HopProtocol` is built on it, with its receiving side
(:mod:`.receiving`) and its part in replacing a dead worker (:mod:`.rejoin`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError
from hopnet.finite import all_finite_in
from hopnet.graph import Graph
from hopnet.model_state import ModelState
from hopnet.protocols.base import Protocol
from hopnet.protocols.hop.mix_sums import MixSums, RegionPool, plan_regions
from hopnet.protocols.hop.options import HopOptions
from hopnet.protocols.hop.queues import BufferPool, TokenCredits, Update, UpdateQueue
from hopnet.protocols.local_steps import mixes_at
from hopnet.runtime.services import NodeServices
from hopnet.wire import TensorSpec

CREDIT = "c"
"""Meta key of a token grant: how many tokens it credits (on an update, or on a ``token`` message)."""
PART = "p"
"""Meta key of one chunk of a streamed update: its region's index in the plan (:func:`plan_regions`)."""
STREAM_WINDOW = 2
"""Chunks of one streamed update in the transport at once, per out-neighbour: one on the wire, one
queued behind it. The receiver then has about as many in flight (the torch plane posts a receive per
chunk whose header came), whatever the update's size."""


ANY_SENDER = -1
"""The receive pool's one key (see :class:`BufferPool`): buffers are shared by all senders."""


class HopState(Protocol):
    """Hop's state and the bookkeeping its parts share."""

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
        self.agreeing = node.lanes is not None and self.n_buw > 0
        """A lane of a replica group with backup workers: it mixes the updates every lane of its replica
        has (:meth:`~hopnet.protocols.hop.protocol.HopProtocol._recv`), so it keeps them whole until then."""
        self.summing = self.staleness is None and bool(self.flats) and not self.agreeing
        """Mix by accumulation (:mod:`hopnet.protocols.hop.mix_sums`): the queue then only records which
        updates came. With staleness the newest update of a sender replaces its older one, which
        a sum could not take back, so the queue keeps the newest update's tensors until the reduce
        (and so does a lane that agrees with the other lanes of its replica on which updates to mix)."""
        # With staleness: one pool for every sender: a buffer is held only while it is received or
        # the newest update of its sender, so no sender needs buffers of its own.
        self.pool = BufferPool(factory if not self.summing else None, (ANY_SENDER,), per_sender=1)
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
        # --max-restarts (rejoin.py): peers that came back as new processes; a replacement's view of its neighbours
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

    def _beyond_window(self, iteration: int) -> bool:
        return iteration >= self.round + self.num_slots - (self.staleness or 0)

    def expected_senders(self, k: int) -> Sequence[int]:
        """In-neighbours that will still send an update of iteration ``k``."""
        gone = self.departed_after
        if not gone:
            return self.in_peers
        return [j for j in self.in_peers if gone.get(j, k) >= k]

    def _live_out(self) -> list[int]:
        return [j for j in self.out_peers if j not in self.departed_after]

    def _release(self, tensors: list[torch.Tensor] | None) -> None:
        if tensors is None:  # nothing to give back (an update without a model: the simulator's, mostly)
            return
        if not self.summing:
            self.pool.release(ANY_SENDER, tensors)
        elif not self.streaming:
            for t in tensors:
                self.region_pool.give(t)

    def _release_updates(self, updates: list[Update]) -> None:
        for update in updates:
            self._release(update.tensors)
            update.tensors = None

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

    def _discard_older_than(self, iteration: int) -> None:
        self._release_updates(self.queue.take_older_than(iteration))
        if self.summing:  # (sums and chunks arriving exist only then)
            self.sums.discard_older_than(iteration)
            for key in [key for key in self._arriving if key[0] < iteration]:
                del self._arriving[key]

    def _newest_from(self, j: int) -> int:
        return self.queue.newest_iter(j)
