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
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from hopnet.errors import HopnetError, PeerFailure
from hopnet.graph import Graph
from hopnet.runtime.clock import Clock
from hopnet.runtime.events import EventLog, JsonlEventLog
from hopnet.runtime.liveness import Liveness
from hopnet.runtime.mailbox import COLLECTIVE_KINDS, Mailbox
from hopnet.runtime.rejoin import HANDOVER, HANDOVER_REQUEST, REJOIN, REJOIN_KINDS, Handover, read_handover
from hopnet.runtime.services import (AddressExchange, AllReduce, CollectiveFactory, CoordinatorChannel, Timer,
                                     TrainingProtocol)
from hopnet.transports.base import DISCARD, Transport
from hopnet.wire import BYE_FINAL_ITER, Header, Message

EnterObserver = Callable[[int, int], None]
P = TypeVar("P", bound=TrainingProtocol)


class StepTimes:
    """Where the current step's time went so far (seconds); reset at the start of each step."""

    __slots__ = ("wait_updates", "wait_tokens", "apply", "updates_from", "tokens_from")

    def __init__(self) -> None:
        self.wait_updates = 0.0
        self.wait_tokens = 0.0
        self.apply = 0.0
        self.updates_from: dict[int, float] = {}
        """Seconds of ``wait_updates`` blamed on each peer (the protocols that name it)."""
        self.tokens_from: dict[int, float] = {}

    def reset(self) -> None:
        self.wait_updates = self.wait_tokens = self.apply = 0.0
        if self.updates_from:
            self.updates_from.clear()
        if self.tokens_from:
            self.tokens_from.clear()


class Node(Generic[P]):
    """Satisfies :class:`hopnet.runtime.services.NodeServices`, the interface its protocol,
    collective and coordinator client are typed against."""

    def __init__(self, rank: int, graph: Graph, transport: Transport, protocol: P, *,
                 clock: Clock, events: EventLog | None = None,
                 on_enter: EnterObserver | None = None, peer_timeout_s: float | None = None,
                 collective_factory: CollectiveFactory | None = None,
                 timer: Timer = time.monotonic, coordinator: CoordinatorChannel | None = None) -> None:
        """``peer_timeout_s``: declare a neighbour dead after this long without a message from
        it. Only used on transports whose peers can die unannounced (``transport.heartbeats``);
        ``None`` turns the watch off. ``coordinator``: the client of the run's coordinator
        (group protocols), started with the node and closed with it. ``collective_factory``:
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
        # One clock for step timings and the records' ``mono`` stamps. The system's monotonic
        # clock is shared by the processes of one machine, so logs of different ranks merge into
        # one timeline. Not loop.time(): uvloop caches it per loop turn at millisecond resolution.
        # The simulator passes its virtual clock.
        self.timer = timer
        self.step_times = StepTimes()
        self._in_step = False
        self._step_ended: float | None = None
        self._finished: dict[str, Any] | None = None
        self._begun: asyncio.Task[None] | None = None
        self._flush_timer: asyncio.TimerHandle | None = None
        self._send_nowait = transport.send_nowait if transport.sends_at_once else None
        self.model_lock = threading.Lock()
        self._pending: set[asyncio.Task[None]] = set()
        self._send_error: BaseException | None = None
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
        self._watch: asyncio.Task[None] | None = None
        self.mailbox = Mailbox(COLLECTIVE_KINDS, clock)
        self._mailbox_kinds = self.mailbox.kinds
        self.addresses: dict[int, str] | None = None  # every rank's, once the rendezvous answered
        # Set once the rendezvous answered (or failed): the transport receives during the
        # exchange, and a protocol acting on an early message must not send before it can.
        self._exchanged: asyncio.Event | None = None
        self._connected: set[int] = set()
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
        self._rejoined: asyncio.Event | None = None  # set at each readmission (wait_for_rejoins)
        self._handover: asyncio.Future[Handover] | None = None
        self._handover_from: int | None = None
        self._at_handover_point = False
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
        self.record("start", address=self.address, **restart, **self.protocol.start_record())
        if self._jsonl is not None:
            self._flush_timer = asyncio.get_running_loop().call_later(
                self._jsonl.flush_interval_s, self._flush_tick)
        if self.peer_timeout_s is not None and self.graph.peers(self.rank):
            self.liveness = Liveness(self.graph.peers(self.rank), timeout_s=self.peer_timeout_s,
                                     now=self.clock.now())
            self._watch = asyncio.get_running_loop().create_task(self._watch_peers())

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
        new = [r for r in ranks if r != self.rank and r not in self._connected]
        if not new or self.addresses is None:
            return
        unknown = [r for r in new if r not in self.addresses]
        if unknown:
            raise HopnetError(f"rank {self.rank}: no address for rank(s) {unknown} (not in the rendezvous)")
        await self.transport.connect({r: self.addresses[r] for r in new})
        self._connected.update(new)

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
                for task in list(self._pending):
                    task.cancel()
        finally:
            await self._stop_watch()
            if self.coordinator is not None:
                await self.coordinator.close()
            self.record("stop", iter=self.protocol.iteration, dropped=dict(self.dropped_all()),
                        **self.protocol.summary())
            if self._flush_timer is not None:
                self._flush_timer.cancel()
                self._flush_timer = None
            await self.transport.close()
            self.events.close()

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

    # ------------------------------------------------------------------ liveness
    async def _watch_peers(self) -> None:
        """Beat to quiet links, and declare neighbours that stay silent dead."""
        liveness = self.liveness
        assert liveness is not None
        # Look at least once per beat interval: arrivals are stamped when the watch looks,
        # so a silence is measured at most one interval short.
        period = liveness.beat_interval_s
        while liveness.watched:
            now = self.clock.now()
            away = liveness.look(now)
            if away:
                self.record("watch_paused", away_s=round(away, 3), iter=self.protocol.iteration)
            heard, self._heard = self._heard, set()
            # A peer whose update this worker holds back waits on this worker, and what it sends
            # meanwhile (beats included) queues behind that update: its silence is ours.
            heard.update(self._holding)
            for peer in heard:
                liveness.heard(peer, now)
            for peer, silent_s in liveness.silent_peers(now):
                self.peer_dead(peer, silent_s)
            iteration = self.protocol.iteration
            for peer in liveness.beat_due(now):
                self._post_beat(Message("beat", self.rank, peer, iteration))
            await asyncio.sleep(max(0.0, min(liveness.next_check(now), now + period) - self.clock.now()))

    def _post_beat(self, msg: Message) -> None:
        """Send a beat; a beat that cannot be sent is not worth failing the worker for."""
        if self._send_nowait is not None:
            self._send_nowait(msg)
            return
        # Express: on a saturated link a beat queued behind updates would arrive too late.
        task = asyncio.get_running_loop().create_task(self.transport.send_express(msg))
        task.add_done_callback(_ignore_result)

    async def _stop_watch(self) -> None:
        task, self._watch = self._watch, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    def peer_dead(self, peer: int, silent_s: float, cause: str | None = None) -> None:
        """``peer`` went silent for ``silent_s``, or the transport found it gone (``cause``, its
        words): handle it like a departure without a bye."""
        if peer in self.dead or peer in self.departed:
            return
        self.dead[peer] = silent_s
        if cause is not None:
            self.death_causes[peer] = cause
        self._holding.discard(peer)
        if peer == self._handover_from and self._handover is not None and not self._handover.done():
            self._handover.set_exception(_DonorGone())
        # "restart": which process of the rank died (the launcher's death watch must not take it for
        # a replacement that already started)
        self.record("peer_dead", peer=peer, silent_s=round(silent_s, 3), iter=self.protocol.iteration,
                    mono=time.monotonic(), restart=self.restarts_seen.get(peer, 0),
                    **({"cause": cause} if cause is not None else {}))
        self.events.flush()  # this worker may well fail next: the record must not be lost
        self.transport.forget_peer(peer)
        self.protocol.on_peer_dead(peer)
        self.mailbox.peer_departed(peer, f"went silent for {silent_s:.1f}s" if cause is None else f"was lost ({cause})",
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
            self._on_rejoin_kind(msg)
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
                if src == self._handover_from and self._handover is not None and not self._handover.done():
                    self._handover.set_exception(_DonorGone())
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

    # ------------------------------------------------------------------ replacements (hopnet.runtime.rejoin)
    def _on_rejoin_kind(self, msg: Message) -> None:
        meta = msg.meta or {}
        if msg.kind == HANDOVER:
            waiter = self._handover
            if waiter is None or waiter.done() or msg.src != self._handover_from:
                self.count_drop("unexpected_handover")
                return
            try:
                waiter.set_result(read_handover(msg))
            except HopnetError as exc:
                waiter.set_exception(exc)
            return
        restart = meta.get("restart")
        if msg.kind == HANDOVER_REQUEST and self.max_restarts and meta.get("epoch") == self.epoch:
            self._requested(msg.src, meta)  # a live peer catching up in a resync (fetch_state)
            return
        if self.max_restarts == 0 or not isinstance(restart, int) or restart < 1:
            self.count_drop("unexpected_rejoin")
            return
        if msg.kind == HANDOVER_REQUEST:
            if self.restarts_seen.get(msg.src, 0) != restart:  # its rejoin comes first on the same link
                self.count_drop("handover_request_before_rejoin")
                return
            self._requested(msg.src, meta)
            return
        address = meta.get("address")
        if not isinstance(address, str) or self.restarts_seen.get(msg.src, 0) >= restart:
            self.count_drop("stale_rejoin")
            return
        self._readmit(msg.src, restart, address)

    def _requested(self, peer: int, meta: Mapping[str, Any]) -> None:
        if peer not in self.handover_requests:
            self.handover_requests.append(peer)
            self.record("handover_requested", peer=peer, iter=self.protocol.iteration,
                        **{k: v for k, v in meta.items() if k in ("restart", "epoch")})
        if self._at_handover_point or self.quiesced:  # blocked where the model is consistent, or done training
            if self.handover_now is not None:
                self.handover_now(self.take_handover_requests())

    def _readmit(self, peer: int, restart: int, address: str) -> None:
        """A new process of ``peer``'s rank joined: end the old one here, if that had not happened
        yet, then take the rank back (its address, the liveness watch, the protocol)."""
        if peer not in self.dead and peer not in self.departed:
            silence = self.liveness.silence(peer, self.clock.now()) if self.liveness is not None else None
            self.peer_dead(peer, silence or 0.0)
        self.restarts_seen[peer] = restart
        self.dead.pop(peer, None)
        self.death_causes.pop(peer, None)
        self.departed.pop(peer, None)
        self.final_iterations.pop(peer, None)
        self.done_peers.pop(peer, None)
        if self.addresses is not None:
            self.addresses[peer] = address
        # Connected at once: the messages right behind the rejoin may need an answer.
        self.transport.readmit_peer(peer, address if peer in self._connected else None)
        self.mailbox.peer_rejoined(peer)
        if self.liveness is not None and peer in self.graph.peers(self.rank):
            # Declared dead by the coordinator's notice or by a rejoin, the old process is still
            # watched here with its last stamp: the new one starts a silence of its own.
            self.liveness.forget(peer)
            self.liveness.watch(peer, self.clock.now())
            if self._watch is None or self._watch.done():
                self._watch = asyncio.get_running_loop().create_task(self._watch_peers())
        # A round it was a member of cannot finish: its predecessor's part is lost, and the new process
        # takes up no round it did not start.
        self.mailbox.break_rounds_with(peer, "was replaced")
        self.record("peer_rejoined", peer=peer, restart=restart, iter=self.protocol.iteration)
        self.events.flush()
        if self._rejoined is not None:
            self._rejoined.set()
        self.protocol.on_peer_rejoined(peer)
        if self.quiesced and peer in self.graph.peers(self.rank):
            self.post(Message("done", self.rank, peer, self.protocol.iteration))  # it must not wait on this one

    async def rejoin(self, restart: int, ranks: Iterable[int], donors: Iterable[int], wait_s: float) -> Handover:
        """This process replaces its rank's dead worker: say ``rejoin`` to ``ranks`` and take the state of
        the first of ``donors`` that hands it over within ``wait_s`` (a donor this node declares dead
        meanwhile is passed over at once)."""
        self.restart = restart
        ranks = [r for r in ranks if r != self.rank]
        await self.connect_to(ranks)
        for rank in ranks:
            self.post(Message(REJOIN, self.rank, rank, self.protocol.iteration,
                              meta={"restart": restart, "address": self.address}))
        await self.flush()
        tried = []
        neighbours = set(self.graph.peers(self.rank))
        for donor in donors:
            if donor == self.rank or donor in self.dead or donor in self.departed:
                continue
            tried.append(donor)
            # A neighbour is watched: one that died, or left, is passed over after --peer-timeout. Another
            # rank is not: it gets twice that, not the whole --timeout.
            wait = wait_s if donor in neighbours or self.peer_timeout_s is None else min(wait_s, 2 * self.peer_timeout_s)
            handover = await self._ask_for_state(donor, {"restart": restart}, wait)
            if handover is not None:
                return handover
        raise HopnetError(f"rank {self.rank}: restart {restart}: no neighbour handed its state over "
                          f"(asked {tried})")

    async def fetch_state(self, donor: int, wait_s: float) -> Handover:
        """Take ``donor``'s state as a replacement would, this worker being live (a resync found it a
        step behind ``donor``, who answers while it waits in the same resync)."""
        handover = await self._ask_for_state(donor, {"epoch": self.epoch}, wait_s)
        if handover is None:
            raise PeerFailure(f"rank {self.rank}: rank {donor} did not hand its state over (in resync {self.epoch})",
                              peer=donor, peer_state=self.peer_state(donor))
        return handover

    async def _ask_for_state(self, donor: int, meta: dict[str, Any], wait_s: float) -> Handover | None:
        await self.connect_to([donor])
        self._handover = asyncio.get_running_loop().create_future()
        self._handover_from = donor
        self.post(Message(HANDOVER_REQUEST, self.rank, donor, self.protocol.iteration, meta=meta))
        try:
            async with asyncio.timeout(wait_s):
                return await self._handover
        except TimeoutError:
            self.record("handover_missing", peer=donor, waited_s=wait_s)
        except _DonorGone:
            self.record("handover_missing", peer=donor, state=self.peer_state(donor))
        finally:
            self._handover = None
            self._handover_from = None
        return None

    @property
    def epoch(self) -> int:
        """How many replacements this worker knows of, its own included: the same number on every
        worker once they all took the same replacements back (collectives tag their rounds with it)."""
        return self.restart + sum(self.restarts_seen.values())

    async def wait_for_rejoins(self, what: str) -> None:
        """Wait until every peer declared dead has been replaced (``--timeout`` at most)."""
        while self.dead:
            self._rejoined = event = asyncio.Event()
            missing = sorted(self.dead)
            await self.clock.wait(event.wait(), f"{what}: the replacement of rank(s) {missing}",
                                  peer=missing[0], iteration=self.protocol.iteration)

    def handover_point(self, reached: bool = True) -> None:
        """The protocol is blocked where its model is consistent (``reached``) or goes on: answer the
        replacements waiting for this worker's state now, rather than at the next step boundary."""
        self._at_handover_point = reached
        if reached and self.handover_requests and self.handover_now is not None:
            self.handover_now(self.take_handover_requests())

    def take_handover_requests(self) -> list[int]:
        """The replacements waiting for this worker's state (each is answered once)."""
        requests, self.handover_requests = self.handover_requests, []
        return [r for r in requests if r not in self.dead and r not in self.departed]

    def dropped_all(self) -> Counter[str]:
        """Drops counted by the transport and by the protocol together."""
        total = Counter(self.transport.stats.dropped)
        total.update(self.dropped)
        return total

    # ------------------------------------------------------------------ what protocols call
    def post(self, msg: Message) -> None:
        """Send without waiting; :meth:`flush` waits until every posted send is done."""
        if self._send_nowait is not None and self.liveness is None:
            self._send_nowait(msg)  # all that _post does on the simulator's transport (once per message)
            return
        self._post(msg, self.transport.send)

    def post_latest(self, msg: Message) -> None:
        """Like :meth:`post`, for a message the receiver only uses the newest of: while the
        link is busy, a later one replaces it (:meth:`Transport.send_latest`)."""
        self._post(msg, self.transport.send_latest)

    def post_express(self, msg: Message) -> None:
        """Like :meth:`post`, for a control message that must not wait behind tensors sent to
        the same peer (it may overtake them): :meth:`Transport.send_express`."""
        self._post(msg, self.transport.send_express)

    def post_tracked(self, msg: Message) -> asyncio.Task[None] | None:
        """Like :meth:`post`, and return what to await before ``msg.tensors`` may be
        modified again (``None``: the transport already let go of them)."""
        return self._post(msg, self.transport.send)

    def post_stream(self, msgs: Sequence[Message], window: int) -> None:
        """Send ``msgs`` (to one peer) in order, at most ``window`` of them in the transport at once:
        a large update as chunks, whose receiver then holds a few chunks in flight, not all of them.
        :meth:`flush` waits for the last."""
        if not msgs:
            return
        if self._send_nowait is not None:
            for msg in msgs:
                self._post(msg, self.transport.send)
            return
        if self.liveness is not None:
            self.liveness.sent(msgs[0].dst, self.clock.now())
        task = asyncio.get_running_loop().create_task(self._stream(msgs, window))
        self._pending.add(task)
        task.add_done_callback(self._sent)

    async def _stream(self, msgs: Sequence[Message], window: int) -> None:
        if self._exchanged is not None and not self._exchanged.is_set():
            await self.connect_to([msgs[0].dst])
        loop = asyncio.get_running_loop()
        sending: set[asyncio.Task[None]] = set()
        try:
            for msg in msgs:
                while len(sending) >= window:
                    done, sending = await asyncio.wait(sending, return_when=asyncio.FIRST_COMPLETED)
                    for finished in done:
                        finished.result()
                sending.add(loop.create_task(self.transport.send(msg)))
            await asyncio.gather(*sending)
        finally:
            for task in sending:
                task.cancel()

    def _post(self, msg: Message, send: Callable[[Message], Coroutine[Any, Any, None]]) -> asyncio.Task[None] | None:
        """Every post goes through here: the send counts as a sign of life to ``msg.dst``."""
        if self.liveness is not None:
            self.liveness.sent(msg.dst, self.clock.now())
        if self._send_nowait is not None:  # the simulator's transport: one way, in virtual time
            self._send_nowait(msg)
            return None
        if self._exchanged is not None and not self._exchanged.is_set():
            # An answer to a message that came during this node's rendezvous (an ad-psgd passive's
            # reply to an active that started first): it leaves once the way to its peer is open.
            task = asyncio.get_running_loop().create_task(self._send_once_connected(msg, send))
        else:
            task = asyncio.get_running_loop().create_task(send(msg))
        self._pending.add(task)
        task.add_done_callback(self._sent)
        return task

    async def _send_once_connected(self, msg: Message, send: Callable[[Message], Coroutine[Any, Any, None]]) -> None:
        await self.connect_to([msg.dst])  # waits for the rendezvous first
        await send(msg)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._pending.discard(task)
        if task.cancelled() or (error := task.exception()) is None:
            return
        if isinstance(error, PeerFailure) and error.peer is not None and error.peer_state == "dead":
            self.peer_lost(error)
            return
        if self._send_error is None:
            self._send_error = error

    async def flush(self) -> None:
        """Wait until every posted message has left, so its tensors may be modified again."""
        while self._pending:
            await asyncio.wait(list(self._pending))
        if self._send_error is not None:
            error, self._send_error = self._send_error, None
            raise HopnetError(f"rank {self.rank}: sending failed: {error}") from error

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
            self._begun.add_done_callback(_ignore_result)
        return self._begun

    # ------------------------------------------------------------------ one step, timed
    async def run_step(self, apply: Callable[[], None] | None, *, last: bool = False,
                       compute_s: float = 0.0) -> None:
        """Finish the current iteration through the protocol and log it with its timings.

        ``compute_s`` is the trainer's time since its previous step returned. The iteration
        record splits the step into ``compute_s`` (that, plus ``apply``), ``wait_updates_s``
        and ``wait_tokens_s`` (the protocol's waits) and ``mix_s`` (the rest of the step:
        mixing, sending, waiting for sends to leave).
        """
        await self.begin()  # at once once done
        if not self._logging:
            await self.protocol.finish_iteration(apply, last=last)
            return
        timer = self.timer
        times = self.step_times
        times.reset()
        began = timer()
        self._in_step = True
        try:
            await self.protocol.finish_iteration(
                apply if apply is None else self._timed_apply(apply), last=last)
        finally:
            self._in_step = False
            record = self._finished
            if record is not None:
                self._finished = None
                ended = timer()
                waited = times.wait_updates + times.wait_tokens
                record["compute_s"] = round(compute_s + times.apply, 6)
                record["wait_updates_s"] = round(times.wait_updates, 6)
                record["wait_tokens_s"] = round(times.wait_tokens, 6)
                # The rest of the interval since the previous step ended, so that the parts add
                # up to it: the hand-overs between the trainer and the loop count as mixing.
                since = began if self._step_ended is None else self._step_ended + compute_s
                record["mix_s"] = round(max(0.0, ended - since - waited - times.apply), 6)
                if times.updates_from:
                    record["wait_updates_from"] = _by_peer(times.updates_from)
                if times.tokens_from:
                    record["wait_tokens_from"] = _by_peer(times.tokens_from)
                record["mono"] = ended
                self._step_ended = ended
                self.record("iteration", **record)

    def _timed_apply(self, apply: Callable[[], None]) -> Callable[[], None]:
        def timed() -> None:
            began = self.timer()
            try:
                apply()
            finally:
                self.step_times.apply += self.timer() - began
        return timed

    def waited(self, what: str, seconds: float, peers: Sequence[int] = ()) -> None:
        """The protocol waited ``seconds`` for ``"updates"`` or ``"tokens"`` (acks count as tokens);
        ``peers``: the neighbours it waited on (the wait is split evenly between them)."""
        times = self.step_times
        if what == "updates":
            times.wait_updates += seconds
            by_peer = times.updates_from
        else:
            times.wait_tokens += seconds
            by_peer = times.tokens_from
        for peer in peers:
            by_peer[peer] = by_peer.get(peer, 0.0) + seconds / len(peers)

    def iteration_done(self, iteration: int, protocol: TrainingProtocol) -> None:
        """The protocol finished ``iteration``; its record is written when the step ends."""
        if not self._logging:
            self._pending_metrics = {}
            return
        record = {"iter": iteration, **protocol.snapshot()}
        if self._pending_metrics:
            record.update(self._pending_metrics)
            self._pending_metrics = {}
        if self._in_step:
            self._finished = record
        else:
            self.record("iteration", **record)

    def record_error(self, fields: Mapping[str, Any], iteration: int | None = None) -> None:
        """Write the ``error`` record of a failing worker (see docs: event records)."""
        self.record("error", mono=time.monotonic(),
                    iter=self.protocol.iteration if iteration is None else iteration, **fields)

    def record(self, event: str, **fields: Any) -> None:
        if self._logging:
            self.events.write({"event": event, "rank": self.rank,
                               "t": round(self.clock.now() - self._t0, 6), "mono": self.timer(), **fields})


def _by_peer(seconds: dict[int, float]) -> dict[str, float]:
    """A per-peer wait as the record writes it: JSON keys are strings."""
    return {str(peer): round(s, 6) for peer, s in sorted(seconds.items())}


class _DonorGone(Exception):
    """The neighbour asked for a handover was declared dead."""


def _ignore_result(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it


__all__ = ["AddressExchange", "CollectiveFactory", "EnterObserver", "Node", "StepTimes", "Timer"]
