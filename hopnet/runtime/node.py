"""The Node: one worker's runtime, living on an event loop.

It owns the rank, the graph, the transport, the clock and the event log, and stands
between the transport and the protocol: inbound messages are validated (by the
transport, then by kind here), departures of peers are noticed, sends are tracked so
the protocol can wait until its buffers are free again. Everything here runs on the
node's event loop; :class:`hopnet.api.Worker` drives it from a trainer's thread.

On a transport whose peers can die unannounced (``transport.heartbeats``), the Node
also watches its neighbours (:mod:`hopnet.runtime.liveness`): any valid message is a
sign of life, a ``beat`` goes to a neighbour nothing else went to lately, and a
neighbour silent for ``peer_timeout_s`` is declared dead and handled like one that
said ``bye``.

Its parts, each in a module of its own: the sends in flight (:mod:`hopnet.runtime.outbox`),
the watch over its neighbours (:mod:`hopnet.runtime.peer_watch`), its part in replacing a
dead worker (:mod:`hopnet.runtime.replacement`) and the timing of each step
(:mod:`hopnet.runtime.step_timing`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from hopnet.errors import HopnetError, PeerFailure
from hopnet.graph import Graph
from hopnet.runtime.clock import Clock
from hopnet.runtime.events import EventLog, JsonlEventLog
from hopnet.runtime.liveness import Liveness
from hopnet.runtime.mailbox import COLLECTIVE_KINDS, Mailbox
from hopnet.runtime.outbox import Outbox
from hopnet.runtime.peer_watch import PeerWatch, ignore_result
from hopnet.runtime.rejoin import REJOIN_KINDS, Handover
from hopnet.runtime.replacement import Replacements
from hopnet.runtime.services import (AddressExchange, AllReduce, CollectiveFactory, CoordinatorChannel, ReplicaLanes,
                                     Timer, TrainingProtocol)
from hopnet.runtime.step_timing import StepTimes, StepTiming
from hopnet.transports.base import DISCARD, Transport
from hopnet.wire import BYE_FINAL_ITER, Header, Message

EnterObserver = Callable[[int, int], None]
P = TypeVar("P", bound=TrainingProtocol)
BY_PEER_FIELDS = ("wait_updates_from", "wait_tokens_from")
"""Iteration record fields keyed by peer (:mod:`hopnet.runtime.step_timing`)."""


class Node(Generic[P]):
    """Satisfies :class:`hopnet.runtime.services.NodeServices`, the interface its protocol,
    collective and coordinator client are typed against."""

    def __init__(self, rank: int, graph: Graph, transport: Transport, protocol: P, *,
                 clock: Clock, events: EventLog | None = None,
                 on_enter: EnterObserver | None = None, peer_timeout_s: float | None = None,
                 collective_factory: CollectiveFactory | None = None,
                 timer: Timer = time.monotonic, coordinator: CoordinatorChannel | None = None,
                 lanes: ReplicaLanes | None = None) -> None:
        """``peer_timeout_s``: declare a neighbour dead after this long without a message from
        it. Only used on transports whose peers can die unannounced (``transport.heartbeats``);
        ``None`` turns the watch off. ``coordinator``: the client of the run's coordinator
        (group protocols), started with the node and closed with it. ``lanes``: the other lanes of
        this worker's replica group (:mod:`hopnet.replica`), if any. ``collective_factory``:
        how to build :attr:`collective`; by default the protocol's
        (:meth:`~hopnet.runtime.services.TrainingProtocol.make_collective`)."""
        if not 0 <= rank < graph.n:
            raise HopnetError(f"rank {rank} is out of range for a graph of {graph.n} nodes")
        self.rank = rank
        self.graph = graph
        self.transport = transport
        self.protocol = protocol
        self.clock = clock
        self.events = events if events is not None else EventLog(keep=False)
        self.dropped: Counter[str] = Counter()
        self._on_enter = on_enter
        self._jsonl = self.events if isinstance(self.events, JsonlEventLog) else None
        self._log_entries = self._jsonl is not None
        self._logging = self.events.keep or self._log_entries
        # One clock for step timings and the records' ``mono`` stamps: the system's monotonic clock,
        # shared by a machine's processes, so logs of different ranks merge into one timeline. Not
        # loop.time(): uvloop caches it per loop turn at millisecond resolution. (The simulator's is virtual.)
        self.timer = timer
        self._steps = StepTiming(timer)
        self.last_step: dict[str, Any] | None = None  # the last step's ``iteration`` record (its timings)
        self.step_times: StepTimes = self._steps.times
        self._begun: asyncio.Task[None] | None = None
        self._flush_timer: asyncio.TimerHandle | None = None
        self._outbox = Outbox(self)
        self._send_nowait = self._outbox.send_nowait
        self.model_lock = threading.Lock()
        self._pending_metrics: dict[str, Any] = {}
        self._t0 = 0.0
        self.address: str | None = None
        self.departed: dict[int, int] = {}
        self.final_iterations: dict[int, int | None] = {}  # planned last iteration, from each bye
        self.dead: dict[int, float] = {}  # peer -> seconds it had been silent when declared dead
        self.death_causes: dict[int, str] = {}  # peer -> what the transport said, when it found the peer gone
        self.done_peers: dict[int, int] = {}  # neighbour -> its iteration when it said done
        self.quiesced = False
        self.peer_timeout_s = peer_timeout_s if transport.heartbeats else None
        self.liveness: Liveness | None = None
        self._heard: set[int] = set()  # peers heard from since the watch last looked
        self._holding: set[int] = set()  # peers whose messages the transport holds back for the protocol
        self.watch: PeerWatch | None = None
        self.mailbox = Mailbox(COLLECTIVE_KINDS, clock)
        self._mailbox_kinds = self.mailbox.kinds
        self.addresses: dict[int, str] | None = None  # every rank's, once the rendezvous answered
        # Set once the rendezvous answered (or failed): the transport receives during the
        # exchange, and a protocol acting on an early message must not send before it can.
        self._exchanged: asyncio.Event | None = None
        self.connected: set[int] = set()  # ranks connect_to opened the way to
        self._collective_factory = collective_factory
        self._collective: AllReduce | None = None
        self.coordinator = coordinator
        self.max_restarts = 0
        """Workers the launcher may replace (``--max-restarts``): peers declared dead may come back."""
        self.survives_losses = False
        """The run goes on without a dead worker (``--max-restarts`` or ``--max-failures``)."""
        self.restart = 0
        """This process's restart number: 0 for the first process of its rank, N for its N-th replacement."""
        self.restarts_seen: dict[int, int] = {}  # peer -> the restart number of its process now
        self.handover_requests: list[int] = []  # replacements waiting for this worker's state
        self.load_state: Callable[[Handover], None] | None = None
        """Loads a fetched state (:meth:`fetch_state`) into the model and the trainer's registered state,
        with the trainer blocked in its step; set by :class:`hopnet.api.Worker`."""
        self.handover_now: Callable[[list[int]], None] | None = None
        """Answers handover requests on the event loop while the trainer is blocked and the model
        consistent (:meth:`handover_point`); set by :class:`hopnet.api.Worker`."""
        self._replacements = Replacements(self)
        self.owns_events = True
        """Close the event log with the node (an elastic run's segments share the worker's log)."""
        self.start_fields: dict[str, Any] = {}
        """More fields for the ``start`` record (an elastic run's later views: ``view``)."""
        self.members: tuple[int, ...] | None = None
        """The run's rank on each position of ``graph``, in an elastic run's view (records name ranks, not
        positions); None when positions are ranks."""
        self.lanes = lanes
        if coordinator is not None:
            coordinator.bind(self)
        protocol.bind(self)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, exchange: AddressExchange | None = None) -> None:
        """Bind, learn the neighbours' addresses, connect, and enter iteration 0."""
        await self.open(exchange)
        await self.protocol.start()

    async def open(self, exchange: AddressExchange | None = None) -> None:
        """Bind, learn the neighbours' addresses and connect, without entering iteration 0."""
        self._t0 = self.clock.now()
        self.transport.admit_run(self.graph.n)
        self.address = await self.transport.start(self)
        if exchange is not None:
            self._exchanged = asyncio.Event()
            try:
                addresses = await exchange(self.address)
                missing = [p for p in self.graph.peers(self.rank) if p not in addresses]
                if missing:
                    raise HopnetError(f"rank {self.rank}: no address for peer(s) {missing} after the rendezvous")
                self.addresses = {int(r): a for r, a in addresses.items()}
            finally:
                self._exchanged.set()
            await self.connect_to(self.graph.peers(self.rank))
        if self.coordinator is not None:
            await self.coordinator.start()
        restart = {"restart": self.restart} if self.restart else {}  # a replacement (hopnet.runtime.rejoin)
        self.record("start", address=self.address, **restart, **self.start_fields, **self.protocol.start_record())
        if self._jsonl is not None:
            self._flush_timer = asyncio.get_running_loop().call_later(
                self._jsonl.flush_interval_s, self._flush_tick)
        if self.peer_timeout_s is not None and self.graph.peers(self.rank):
            self.liveness = Liveness(self.graph.peers(self.rank), timeout_s=self.peer_timeout_s,
                                     now=self.clock.now(), judge_unheard=not self.restart)
            self.watch = PeerWatch(self, self.liveness, heard=self._heard, holding=self._holding)
            self.watch.start()

    def _flush_tick(self) -> None:
        """Flush the event log while the worker waits, so a live reader sees its last records."""
        if self._jsonl is None:
            return
        self._jsonl.flush()
        self._flush_timer = asyncio.get_running_loop().call_later(self._jsonl.flush_interval_s, self._flush_tick)

    async def connect_to(self, ranks: Iterable[int]) -> None:
        """Open the ways to ``ranks`` (any rank of the run, not only graph neighbours).

        Connections are made once, on first need: a collective calls this for the members it
        sends to. Without a rendezvous (the in-process transport, or a caller that connected
        the transport itself) there is nothing to do."""
        if self._exchanged is not None and not self._exchanged.is_set():
            await self._exchanged.wait()  # a message that arrived during the rendezvous got us here
        new = [r for r in ranks if r != self.rank and r not in self.connected]
        if not new or self.addresses is None:
            return
        unknown = [r for r in new if r not in self.addresses]
        if unknown:
            raise HopnetError(f"rank {self.rank}: no address for rank(s) {unknown} (not in the rendezvous)")
        await self.transport.connect({r: self.addresses[r] for r in new})
        self.connected.update(new)

    @property
    def collective(self) -> AllReduce:
        """The all-reduce every group protocol uses: built on first use by the node's
        collective factory, or else by the protocol (the ring over the node's messages)."""
        if self._collective is None:
            factory = self._collective_factory
            self._collective = factory(self) if factory is not None else self.protocol.make_collective(self)
        return self._collective

    @property
    def iteration(self) -> int:
        return self.protocol.iteration

    async def close(self, *, leave: bool = True, flush_timeout_s: float | None = None) -> None:
        """Tell the neighbours this worker is leaving (unless ``leave`` is False), then shut down.

        ``flush_timeout_s`` bounds the wait for sends still in flight and the collective's
        close (a worker that fails leaves promptly: a neighbour that stopped reading must
        not hold it); what has not left by then is dropped with the sockets.
        """
        try:
            # the watch still runs while flushing: a neighbour dying now releases its sends
            try:
                async with asyncio.timeout(flush_timeout_s):
                    await self.flush()
                    await self.transport.drain()  # held updates leave before the bye
                    if leave:
                        await self.protocol.stop()
                    await self.flush()
                    if self._collective is not None:
                        await self._collective.close()
            except TimeoutError:
                if flush_timeout_s is None:
                    raise
                self._outbox.cancel()
        finally:
            if self.watch is not None:
                await self.watch.stop()
            if self.coordinator is not None:
                await self.coordinator.close()
            self.record("stop", iter=self.protocol.iteration, dropped=dict(self.dropped_all()),
                        **self.protocol.summary())
            if self._flush_timer is not None:
                self._flush_timer.cancel()
                self._flush_timer = None
            await self.transport.close()
            if self.owns_events:
                self.events.close()
            else:
                self.events.flush()

    async def quiesce(self) -> None:
        """Finish training for the consensus: wait for the sends in flight, let the protocol
        finish or answer its in-flight exchanges and stop starting new ones
        (:meth:`~hopnet.runtime.services.TrainingProtocol.quiesce`), then tell the neighbours
        still here ``done``, so none of them waits on this worker for an exchange. The node
        stays open: it still beats, receives, and says ``bye`` when it closes. Idempotent."""
        if self.quiesced:
            return
        await self.flush()
        await self.transport.drain()  # held updates leave before anything changes the model
        await self.protocol.quiesce()
        await self.flush()
        await self.transport.drain()
        self.quiesced = True
        for peer in self.graph.peers(self.rank):
            if peer not in self.departed and peer not in self.dead:
                self.post(Message("done", self.rank, peer, self.protocol.iteration))
        await self.flush()
        self.record("quiesced", iter=self.protocol.iteration)

    # ------------------------------------------------------------------ peers dead, lost, replaced
    def peer_dead(self, peer: int, silent_s: float, cause: str | None = None) -> None:
        """``peer`` went silent for ``silent_s``, or the transport found it gone (``cause``, its
        words): handle it like a departure without a bye."""
        if peer in self.dead or peer in self.departed:
            return
        self.dead[peer] = silent_s
        if cause is not None:
            self.death_causes[peer] = cause
        self._holding.discard(peer)
        self._replacements.donor_gone(peer)
        # "restart": which process of the rank died (the launcher's death watch must not take it for
        # a replacement that already started)
        self.record("peer_dead", peer=peer, silent_s=round(silent_s, 3), iter=self.protocol.iteration,
                    mono=time.monotonic(), restart=self.restarts_seen.get(peer, 0),
                    **({"cause": cause} if cause is not None else {}))
        self.events.flush()  # this worker may well fail next: the record must not be lost
        self.transport.forget_peer(peer)
        self.protocol.on_peer_dead(peer)
        self.mailbox.peer_departed(peer, f"went silent (rank {peer} unreachable from rank {self.rank} for {silent_s:.1f}s)"
                                   if cause is None else f"was lost ({cause})",
                                   "dead")
        if self.survives_losses:
            self.mailbox.break_rounds_with(peer, "died")

    def peer_lost(self, failure: PeerFailure) -> None:
        """The transport found ``failure.peer`` gone (the torch plane's pair connection closed or
        reset, as when its process died), on a send or a receive: handled as the heartbeats' news
        of a silent peer is."""
        peer = failure.peer
        if peer is None:
            return
        silence = self.liveness.silence(peer, self.clock.now()) if self.liveness is not None else None
        self.peer_dead(peer, silence or 0.0, cause=str(failure).removeprefix(f"rank {self.rank}: "))

    def peer_state(self, peer: int) -> str:
        """What this node knows of ``peer``: "departed" (said bye), "dead" (went silent), or
        "stalled" (alive, as far as anyone can tell: the word for a peer a wait is blocked on)."""
        if peer in self.departed:
            return "departed"
        if peer in self.dead:
            return "dead"
        return "stalled"

    # ------------------------------------------------------------------ the Receiver side
    def buffers_for(self, header: Header) -> Any:
        if header.kind in REJOIN_KINDS:
            return None
        if header.src in self.dead:
            return DISCARD
        self._heard.add(header.src)  # a late update that is discarded is still a sign of life
        if header.kind in self._mailbox_kinds:
            return self.mailbox.buffers_for(header)
        if header.kind in ("bye", "done"):
            return None
        return self.protocol.buffers_for(header)

    def hold(self, header: Header) -> bool:
        if header.src in self.dead or header.kind in self._mailbox_kinds or header.kind in REJOIN_KINDS:
            return False
        self._heard.add(header.src)
        if not self.protocol.hold(header):
            return False
        self._holding.add(header.src)
        return True

    def take_in_held(self) -> None:
        """The protocol takes in what it had the transport hold back (:meth:`hold`), as far as it now will."""
        if not self._holding:
            return
        self._holding.clear()
        self.transport.take_in_held()  # asks hold() again: a peer still held is added back

    def deliver(self, msg: Message) -> None:
        src = msg.src
        if msg.kind in REJOIN_KINDS:
            self._replacements.on_message(msg)
            return
        if src in self.dead:
            self.count_drop("from_dead_peer")  # written off already; it must not rejoin half-way
            return
        self._heard.add(src)
        kind = msg.kind
        if kind == "beat":
            return
        if kind in self._mailbox_kinds:
            self.mailbox.deliver(msg)
            return
        if kind == "bye":
            if src not in self.departed:
                final = msg.meta.get(BYE_FINAL_ITER) if msg.meta else None
                final = final if isinstance(final, int) else None
                self.departed[src] = msg.iter
                self.final_iterations[src] = final
                self._replacements.donor_gone(src)
                if self.liveness is not None:
                    self.liveness.forget(src)
                self.record("peer_left", peer=src, last_iter=msg.iter, final_iter=final)
                self.events.flush()
                self.protocol.on_peer_departed(src, msg.iter)
                self.mailbox.peer_departed(src, f"left after iteration {msg.iter}")
                self.transport.forget_peer(src)
            return
        if kind == "done":
            if src not in self.done_peers:
                self.done_peers[src] = msg.iter
                self.record("peer_done", peer=src, iter=msg.iter)
                self.protocol.on_peer_done(src)
            return
        self.protocol.on_message(msg)

    def count_drop(self, reason: str) -> None:
        self.dropped[reason] += 1

    # ------------------------------------------------------------------ replacements (hopnet.runtime.replacement)
    async def rejoin(self, restart: int, ranks: Iterable[int], donors: Iterable[int], wait_s: float) -> Handover:
        """This process replaces its rank's dead worker: see :meth:`Replacements.rejoin`."""
        return await self._replacements.rejoin(restart, ranks, donors, wait_s)

    async def ask_again(self, restart: int, donor: int, at: int, wait_s: float) -> Handover:
        """Rejoined, ask ``donor`` for its state at iteration ``at``: see :meth:`Replacements.ask_again`."""
        return await self._replacements.ask_again(restart, donor, at, wait_s)

    async def fetch_state(self, donor: int, wait_s: float) -> Handover:
        """Take ``donor``'s state, this worker being live: see :meth:`Replacements.fetch_state`."""
        return await self._replacements.fetch_state(donor, wait_s)

    @property
    def epoch(self) -> int:
        """How many replacements this worker knows of, its own included: the same number on every
        worker once they all took the same replacements back (collectives tag their rounds with it)."""
        return self.restart + sum(self.restarts_seen.values())

    async def wait_for_rejoins(self, what: str) -> None:
        """Wait until every peer declared dead has been replaced (``--timeout`` at most)."""
        await self._replacements.wait_for_rejoins(what)

    def handover_point(self, reached: bool = True) -> None:
        """The protocol is blocked where its model is consistent (``reached``) or goes on: answer the
        replacements waiting for this worker's state now, rather than at the next step boundary."""
        self._replacements.handover_point(reached)

    def take_handover_requests(self, iteration: int | None = None) -> list[int]:
        """The replacements waiting for this state (:meth:`Replacements.take_handover_requests`)."""
        return self._replacements.take_handover_requests(iteration)

    def dropped_all(self) -> Counter[str]:
        """Drops counted by the transport and by the protocol together."""
        total = Counter(self.transport.stats.dropped)
        total.update(self.dropped)
        return total

    # ------------------------------------------------------------------ what protocols call
    def post(self, msg: Message) -> None:
        """Send without waiting; :meth:`flush` waits until every posted send is done."""
        if self._send_nowait is not None and self.liveness is None:
            self._send_nowait(msg)  # all that a post does on the simulator's transport (once per message)
            return
        self._outbox.post(msg, self.transport.send)

    def post_latest(self, msg: Message) -> None:
        """Like :meth:`post`, for a message the receiver only uses the newest of: while the
        link is busy, a later one replaces it (:meth:`Transport.send_latest`)."""
        self._outbox.post(msg, self.transport.send_latest)

    def post_express(self, msg: Message) -> None:
        """Like :meth:`post`, for a control message that must not wait behind tensors sent to
        the same peer (it may overtake them): :meth:`Transport.send_express`."""
        self._outbox.post(msg, self.transport.send_express)

    def post_tracked(self, msg: Message) -> asyncio.Task[None] | None:
        """Like :meth:`post`, and return what to await before ``msg.tensors`` may be
        modified again (``None``: the transport already let go of them)."""
        return self._outbox.post(msg, self.transport.send)

    def post_stream(self, msgs: Sequence[Message], window: int) -> None:
        """Send ``msgs`` (to one peer) in order, at most ``window`` of them in the transport at once:
        a large update as chunks, whose receiver then holds a few chunks in flight, not all of them.
        :meth:`flush` waits for the last."""
        self._outbox.post_stream(msgs, window)

    async def flush(self) -> None:
        """Wait until every posted message has left, so its tensors may be modified again."""
        await self._outbox.flush()

    @property
    def awaiting_addresses(self) -> bool:
        """The rendezvous has not answered yet (the transport already receives meanwhile)."""
        return self._exchanged is not None and not self._exchanged.is_set()

    def entered(self, iteration: int, protocol: TrainingProtocol) -> None:
        """The protocol entered ``iteration`` (called before it sends anything for it)."""
        if self._on_enter is not None:
            self._on_enter(self.rank, iteration)
        if self._log_entries:
            self.record("enter", iter=iteration)

    def report(self, **metrics: Any) -> None:
        """Attach metrics (loss, accuracy...) to the next iteration record."""
        self._pending_metrics.update(metrics)

    def plan(self, total: int) -> None:
        """The trainer will run ``total`` iterations: tell the readers of the event log, and let the
        protocol send what iteration 0 needs from the model (:meth:`begin`)."""
        self.record("plan", total=total)
        self.begin()

    def begin(self) -> asyncio.Task[None]:
        """Start the protocol's :meth:`~hopnet.runtime.services.TrainingProtocol.begin`, once: the
        trainer starts its loop, so the model holds the weights it trains from."""
        if self._begun is None:
            self._begun = asyncio.get_running_loop().create_task(self.protocol.begin(),
                                                                 name=f"rank{self.rank}-begin")
            self._begun.add_done_callback(ignore_result)
        return self._begun

    # ------------------------------------------------------------------ one step, timed
    async def run_step(self, apply: Callable[[], None] | None, *, last: bool = False,
                       compute_s: float = 0.0, metrics: dict[str, Any] | None = None) -> None:
        """Finish the current iteration through the protocol and log it with its timings.

        ``compute_s`` is the trainer's time since its previous step returned. The iteration
        record splits the step into ``compute_s`` (that, plus ``apply``), ``wait_updates_s``
        and ``wait_tokens_s`` (the protocol's waits) and ``mix_s`` (the rest of the step:
        mixing, sending, waiting for sends to leave). ``metrics``: what the trainer reported for it.
        """
        self._pending_metrics.update(metrics or ())
        await self.begin()  # at once once done
        if not self._logging:
            await self.protocol.finish_iteration(apply, last=last)
            return
        steps = self._steps
        began = steps.start()
        try:
            await self.protocol.finish_iteration(apply if apply is None else steps.timed_apply(apply), last=last)
        finally:
            record = steps.end(began, compute_s)
            if record is not None:
                self.last_step = record
                self.record("iteration", **record)

    def waited(self, what: str, seconds: float, peers: Sequence[int] = ()) -> None:
        """The protocol waited ``seconds`` for ``"updates"`` or ``"tokens"`` (acks count as tokens);
        ``peers``: the neighbours it waited on (the wait is split evenly between them)."""
        self._steps.waited(what, seconds, peers)

    def iteration_done(self, iteration: int, protocol: TrainingProtocol) -> None:
        """The protocol finished ``iteration``; its record is written when the step ends."""
        if not self._logging:
            self._pending_metrics = {}
            return
        record = {"iter": iteration, **protocol.snapshot()}
        if self._pending_metrics:
            record.update(self._pending_metrics)
            self._pending_metrics = {}
        if not self._steps.keep_until_step_ends(record):
            self.record("iteration", **record)

    def record_error(self, fields: Mapping[str, Any], iteration: int | None = None) -> None:
        """Write the ``error`` record of a failing worker (see docs: event records)."""
        self.record("error", mono=time.monotonic(),
                    iter=self.protocol.iteration if iteration is None else iteration, **fields)

    def record(self, event: str, **fields: Any) -> None:
        if self._logging:
            members = self.members
            if members is not None:
                peer = fields.get("peer")
                if isinstance(peer, int) and 0 <= peer < len(members):
                    fields["peer"] = members[peer]
                for key in BY_PEER_FIELDS:  # the step's waits, by peer: positions in the view, logged as ranks
                    by_peer = fields.get(key)
                    if by_peer:
                        fields[key] = {str(members[int(p)]) if 0 <= int(p) < len(members) else p: s
                                       for p, s in by_peer.items()}
            self.events.write({"event": event, "rank": self.rank if members is None else members[self.rank],
                               "t": round(self.clock.now() - self._t0, 6), "mono": self.timer(), **fields})


__all__ = ["AddressExchange", "CollectiveFactory", "EnterObserver", "Node", "StepTimes", "Timer"]
