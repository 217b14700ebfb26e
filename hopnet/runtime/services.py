"""The typed seam between a protocol and the runtime.

:class:`NodeServices` is everything a protocol (and the coordinator client, and the ring
collective) may use of its node; :class:`TrainingProtocol` is everything the node asks of
the protocol it drives. :class:`hopnet.runtime.node.Node` satisfies the first, every
:class:`hopnet.protocols.base.Protocol` the second. Both are structural, so the runtime
names no protocol, collective or coordinator module: the layers above implement these
interfaces, the runtime only calls them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol

import torch

from hopnet.graph import Graph
from hopnet.runtime.clock import Clock
from hopnet.runtime.events import EventLog
from hopnet.runtime.mailbox import Mailbox
from hopnet.runtime.rejoin import Handover
from hopnet.wire import Header, Message

ReduceOp = Literal["mean", "sum"]
Timer = Callable[[], float]
ApplyFn = Callable[[], None]


class AllReduce(Protocol):
    """The node's collective as the node and its protocols see it
    (implemented by :class:`hopnet.collectives.base.Collective`)."""

    async def allreduce(self, group: Sequence[int], tensor: torch.Tensor, op: ReduceOp = "mean", *,
                        tag: str) -> torch.Tensor: ...

    async def close(self) -> None: ...


class CoordinatorChannel(Protocol):
    """The client of the run's coordinator, as the node and its protocols see it
    (implemented by :class:`hopnet.coordinator.client.CoordinatorClient`)."""

    def bind(self, node: NodeServices) -> None: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def send(self, message: Mapping[str, Any]) -> None: ...

    async def receive(self, what: str) -> dict[str, Any]: ...


CollectiveFactory = Callable[["NodeServices"], AllReduce]


class ReplicaLanes(Protocol):
    """The other lanes of this worker's replica group (:mod:`hopnet.replica`), as a protocol sees them:
    what a protocol chooses by what reached it, every lane of a replica must choose alike.
    (Implemented by :class:`hopnet.replica.agreement.LaneAgreement`.)"""

    @property
    def side(self) -> ReplicaLanes | None:
        """A second agreement on a group of its own, whose calls may come in another order than this
        one's (where the protocol's spec asks for ``lane_channels=2``)."""
        ...

    async def common(self, have: Collection[int], need: int, candidates: int | None = None
                     ) -> tuple[frozenset[int], bool]:
        """Every lane's ``have`` intersected, and whether it holds at least every lane's ``need``.
        Every lane calls it (and :meth:`least`) the same number of times, in the same order."""
        ...

    async def least(self, value: int) -> int:
        """The smallest of every lane's ``value``."""
        ...

    async def least_each(self, values: Sequence[int]) -> list[int]:
        """The smallest of every lane's ``values[i]``, for each ``i``."""
        ...

    def mixed_models(self) -> None:
        """This lane changed its slice of the model outside the optimizer's step (a gradient protocol's
        periodic model average): the replica's members share their slices again after this step."""
        ...


class NodeServices(Protocol):
    """What a protocol may use of the node it is bound to.

    Identity and topology (``rank``, ``graph``), sending (``post*``, ``flush``,
    ``connect_to``), the collective and the coordinator client, the clock (``clock`` for
    waits, ``timer`` for step timings), the event log (``record``, ``count_drop`` and the
    step bookkeeping), what is known of the peers (``departed``, ``dead``,
    ``final_iterations``, ``peer_state``), and the lock around writes to the model."""

    rank: int
    graph: Graph
    clock: Clock
    timer: Timer
    events: EventLog
    mailbox: Mailbox
    coordinator: CoordinatorChannel | None
    lanes: ReplicaLanes | None
    """The other lanes of this worker's replica group, when it is a member of one of several processes."""
    departed: dict[int, int]
    """Peers that said ``bye``, with the last iteration they sent for."""
    dead: dict[int, float]
    """Peers declared dead, with how long they had been silent (seconds)."""
    death_causes: dict[int, str]
    """Of the dead peers the transport found gone (a closed connection), what it said."""
    done_peers: dict[int, int]
    """Neighbours that said ``done`` (finished training, quiescing for the consensus), with
    the iteration they were in."""
    final_iterations: dict[int, int | None]
    """The last iteration each departed peer planned to run, from its ``bye``."""
    model_lock: threading.Lock
    """Held around every write to the model made off the trainer's thread, and around the
    optimizer step; a trainer holds it to read a consistent model."""
    max_restarts: int
    """How many dead workers the launcher may replace (``--max-restarts``): with any, a peer
    declared dead may come back (:mod:`hopnet.runtime.rejoin`), so a protocol that can keep
    going without it does, rather than fail."""
    survives_losses: bool
    """Whether the run goes on without a dead worker (``--max-restarts`` or ``--max-failures``): a
    group or averaging that a dead member broke is then rolled back on the others, not fatal."""
    restart: int
    """This process's restart number (0: the first process of its rank; N: its N-th replacement)."""
    restarts_seen: dict[int, int]
    """The restart number of each peer's process now, for the peers seen replaced."""

    @property
    def epoch(self) -> int:
        """Replacements known, this worker's own included (see :class:`hopnet.runtime.node.Node`)."""
        ...

    async def wait_for_rejoins(self, what: str) -> None: ...

    async def fetch_state(self, donor: int, wait_s: float) -> Handover: ...

    load_state: Callable[[Handover], None] | None

    def handover_point(self, reached: bool = True) -> None: ...

    @property
    def iteration(self) -> int:
        """The iteration the node's protocol is in."""
        ...

    @property
    def collective(self) -> AllReduce: ...

    # sending
    def post(self, msg: Message) -> None: ...

    def post_latest(self, msg: Message) -> None: ...

    def post_express(self, msg: Message) -> None: ...

    def post_tracked(self, msg: Message) -> asyncio.Task[None] | None: ...

    def post_stream(self, msgs: Sequence[Message], window: int) -> None: ...

    async def flush(self) -> None: ...

    def take_in_held(self) -> None: ...

    async def connect_to(self, ranks: Iterable[int]) -> None: ...

    # peers
    def peer_state(self, peer: int) -> str: ...

    def peer_dead(self, peer: int, silent_s: float) -> None: ...

    # events and step bookkeeping
    def record(self, event: str, **fields: Any) -> None: ...

    def count_drop(self, reason: str) -> None: ...

    def entered(self, iteration: int, protocol: TrainingProtocol) -> None: ...

    def waited(self, what: str, seconds: float, peers: Sequence[int] = ()) -> None: ...

    def iteration_done(self, iteration: int, protocol: TrainingProtocol) -> None: ...


class Stateful(Protocol):
    """State saved in checkpoints the way torch saves a module's or an optimizer's."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class TrainingProtocol(Protocol):
    """What the node asks of the protocol it drives (see :class:`hopnet.protocols.base.Protocol`)."""

    iteration: int

    def bind(self, node: NodeServices) -> None: ...

    def make_collective(self, node: NodeServices) -> AllReduce: ...

    def start_record(self) -> dict[str, Any]: ...

    async def start(self) -> None: ...

    async def begin(self) -> None: ...

    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None: ...

    async def synchronize(self) -> None: ...

    def defer_gradient_sync(self, deferred: bool) -> None: ...

    def gradient_of(self, iteration: int) -> int: ...

    async def stop(self) -> None: ...

    def buffers_for(self, header: Header) -> Any: ...

    def hold(self, header: Header) -> bool: ...

    def on_message(self, msg: Message) -> None: ...

    def on_peer_departed(self, peer: int, last_iteration: int) -> None: ...

    def on_peer_dead(self, peer: int) -> None: ...

    def on_peer_rejoined(self, peer: int) -> None: ...

    def handover_state(self) -> dict[str, Any]: ...

    def rejoin_at(self, iteration: int, state: Mapping[str, Any]) -> None: ...

    async def after_rejoin(self) -> None: ...

    def resume_at(self, iteration: int) -> None: ...

    async def after_resume(self) -> None: ...

    def on_peer_done(self, peer: int) -> None: ...

    async def quiesce(self) -> None: ...

    def model_tensors(self) -> list[torch.Tensor]: ...

    def checkpoint_state(self) -> Stateful | None: ...

    def snapshot(self) -> dict[str, Any]: ...

    def summary(self) -> dict[str, Any]: ...


AddressExchange = Callable[[str], Awaitable[Mapping[int, str]]]

__all__ = ["AddressExchange", "AllReduce", "ApplyFn", "CollectiveFactory", "CoordinatorChannel", "NodeServices", "ReplicaLanes",
           "ReduceOp", "Stateful", "Timer", "TrainingProtocol"]
