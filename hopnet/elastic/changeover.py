"""A worker's move from one view's training segment to the next, on the trainer's thread.

Each view runs as a segment of its own: a node, a transport and a protocol over the view's
members, numbered by position (the members in rank order), as a fresh run resumed at the
view's first iteration would be. Messages of an older view cannot reach a newer segment: its
sockets are new. What lives on across segments is the trainer's: the model, the optimizer and
the registered state, the event log, the control channel.

At a step boundary the worker asks :meth:`Changeover.due`; when the old segment's last iteration
is done, :meth:`Changeover.enter` ends it (quiesce, wait for the neighbours, close), hands each
joiner it serves its state, and opens the next segment. See docs/design/elastic.md."""

from __future__ import annotations

import asyncio
import io
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from hopnet import checkpoint
from hopnet.bootstrap.plane import collective_factory, make_transport
from hopnet.data import ElasticSampler
from hopnet.coordinator import needs_coordinator
from hopnet.coordinator.client import client_from_environ
from hopnet.elastic.coordinator import ViewCoordinator
from hopnet.elastic.run import ElasticRun, LeftRun, RunEnded, ViewEntry
from hopnet.elastic.switch import assign_donors
from hopnet.errors import HopnetError, MembershipStopped
from hopnet.graph.members import MemberGraph
from hopnet.protocols import make_protocol
from hopnet.runtime.clock import Clock
from hopnet.runtime.node import Node
from hopnet.runtime.rejoin import fingerprint
from hopnet.security import CurveKeys


class Left(SystemExit):
    """Raised from ``worker.iterations()`` in a worker whose leave (a SIGTERM) took effect: the
    process exits 0, without running the rest of the training script."""

    def __init__(self, line: str) -> None:
        super().__init__(0)
        self.line = line


class Changeover:
    """The segments of one elastic worker (a :class:`hopnet.api.Worker`, typed ``Any``: the api is a
    layer above this one)."""

    def __init__(self, worker: Any, run: ElasticRun, *, graph_spec: str, bind_host: str,
                 curve: CurveKeys | None, safe_point: Callable[[int], int], run_dir: str,
                 ask_to_join: Callable[[], None] | None = None) -> None:
        self.worker = worker
        self.run = run
        self.me = run.rank
        """This worker's number in the views: its rank, or its replica's in a run of replica groups."""
        self.graph_spec = graph_spec
        self.bind_host = bind_host
        self.curve = curve
        self.safe_point = safe_point
        self.members: tuple[int, ...] = ()
        self.view = run.segment_view
        self.last_iteration: int | None = None
        """The old segment's last iteration, once a committed change fixed it."""
        self._entry: ViewEntry | None = None
        self._late_samplers: dict[str, tuple[int, tuple[int, ...], dict[int, int]]] = {}
        self.joining = False
        self._ask_to_join = ask_to_join
        """A joiner not admitted yet: it asks at its first step (:meth:`join_when_due`)."""
        self.run_dir = run_dir
        self._loaded: float | None = None
        """A joiner's: the fingerprint of the model its donor handed it."""
        self._hosted: ViewCoordinator | None = None
        """The coordinator of the view this worker hosts (the lowest member hosts it, if the protocol has one)."""

    # ------------------------------------------------------------------ at each step boundary
    def due(self, finished: int) -> ViewEntry | None:
        """After iteration ``finished``: the committed view to enter now, else None (the segment
        goes on; its last iteration is set once a change is committed)."""
        run = self.run
        if run.left_line is not None:
            raise Left(run.left_line)
        if run.stopped_line is not None:
            raise MembershipStopped(run.stopped_line)
        if self._entry is None:
            self._fix(*self._decide())
        return self._entry_due(finished)

    def _fix(self, entry: ViewEntry | None, first: int | None) -> None:
        """The next view is ``entry``, from iteration ``first`` on: the current segment ends before it."""
        if entry is None:
            return
        assert first is not None
        worker = self.worker
        self._entry, self.last_iteration = entry, first - 1
        final = worker._final_iteration
        worker.node.protocol.final_iteration = first - 1 if final is None else min(final, first - 1)
        worker.record("view_change_at", view=entry.number, iter=first, members=list(entry.members))

    def _entry_due(self, finished: int) -> ViewEntry | None:
        if self._entry is not None and self.last_iteration is not None and finished >= self.last_iteration:
            return self._entry
        return None

    async def _head(self) -> ViewEntry | None:
        return self.run.head()

    def _decide(self) -> tuple[ViewEntry | None, int | None]:
        """At a step boundary with no change fixed yet: the committed view to enter next and its first
        iteration (once every old member reported), else ``(None, None)``."""
        entry = self.worker._thread.run(self._head())
        if entry is None:
            return None, None
        return entry, self.worker._thread.run(self.run.first_iteration(entry, self.safe_point), timeout_s=None)

    def _admission(self) -> tuple[ViewEntry, int]:
        """A joiner: ask to be admitted, and wait for the admitting view and its first iteration."""
        worker, run = self.worker, self.run
        if self._ask_to_join is not None:
            self._ask_to_join()
        entry = worker._thread.run(run.admitted(), timeout_s=None)
        return entry, worker._thread.run(run.first_iteration(entry, self.safe_point), timeout_s=None)

    def view_members(self, members: tuple[int, ...]) -> tuple[int, ...]:
        """What :attr:`members` (the samplers' division) holds for a view of ``members``."""
        return members

    def boundary(self, finished: int) -> bool:
        """At the step boundary after ``finished``: enter the next view if it begins now (True)."""
        try:
            entry = self.due(finished)
        except LeftRun as left:
            raise Left(str(left)) from None
        if entry is None:
            return False
        try:
            self.enter(entry)
        except LeftRun as left:
            self.worker._left = True
            raise Left(str(left)) from None
        except BaseException:
            self.worker._left = True  # its node is closed: only the event log is left to close
            raise
        return True

    def close(self, timeout_s: float) -> None:
        """The worker closes: the control channel, then the event log its segments shared."""
        try:
            self.worker._thread.run(self._run_ended(), timeout_s=timeout_s)
            self.worker._thread.run(self.run.close(), timeout_s=timeout_s)
            self._stop_hosted()
        finally:
            self.worker.node.events.close()

    def step_failed(self, error: Exception) -> None:
        """A step failed: in a worker whose leave was committed, that is the run stopping around it
        (below ``--min-nproc``); it leaves all the same (raises :class:`Left`)."""
        line = self.run.left_line
        if line is not None:
            self.worker._left = True
            raise Left(line) from error

    def ends_segment(self, iteration: int) -> bool:
        """Whether ``iteration`` is the current segment's last (its step is the segment's ``last``)."""
        return self.last_iteration is not None and iteration >= self.last_iteration

    # ------------------------------------------------------------------ the change
    def enter(self, entry: ViewEntry) -> None:
        """End the current segment after its last iteration and start ``entry``'s (or leave)."""
        worker = self.worker
        assert self.last_iteration is not None
        first = self.last_iteration + 1
        started = time.monotonic()
        graph = MemberGraph.build(self.graph_spec, entry.members)
        old_members = [m for m in entry.members if m in entry.old_members]
        joiners = [j for j in entry.commit.change.joined if j in entry.members]
        donors = assign_donors(graph, joiners, old_members) if joiners and old_members else {}
        cursors = {name: obj.cursor for name, obj in worker._states.items() if isinstance(obj, ElasticSampler)}
        worker._thread.run(self._send_cursors(entry, cursors))
        worker._thread.run(self._end_segment(worker.node), timeout_s=None)
        served = [j for j, d in donors.items() if d == self.me]
        if served:
            payload = self._state_payload(first)
            for joiner in served:
                worker._thread.run(self._send_state(entry, joiner, payload))
            worker.record("state_sent", view=entry.number, to=served, bytes=len(payload),
                          fingerprint=fingerprint(worker.node.protocol.model_tensors()))
        self._entry, self.last_iteration = None, None
        if self.me not in entry.members:
            if self._hosted is not None:  # the old view's members may still need it for their last iteration
                worker._thread.run(self.run.segments(entry), timeout_s=None)
                self._stop_hosted()
            worker._thread.run(self._entered(entry))
            line = f"{self._who()} left after iteration {first - 1}: view {entry.number} goes on without it"
            worker.record("left", view=entry.number, iter=first - 1, line=line)
            raise Left(line)
        self._open_segment(entry, graph, first, donor=None)
        worker.record("view_entered", view=entry.number, members=list(entry.members), iter=first,
                      position=graph.position(self.me), stall_s=round(time.monotonic() - started, 6))

    def join_when_due(self) -> None:
        """A joiner's first step or loop: it asks to be admitted now, its trainer set up (whatever the
        trainer does between ``hopnet.init`` and its loop does not hold the members up)."""
        if self.joining:
            self.joining = False
            try:
                self.join()
            except RunEnded as ended:
                self.worker.record("run_ended", line=str(ended))
                print(f"hopnet: {ended}", file=sys.stderr, flush=True)
                self.worker._left = True  # its nodes are closed or never started
                raise Left(str(ended)) from None

    def join(self) -> None:
        """A joiner: wait to be admitted, then enter the admitting view with a donor's state."""
        worker = self.worker
        started = time.monotonic()
        entry, first = self._admission()
        graph = MemberGraph.build(self.graph_spec, entry.members)
        old_members = [m for m in entry.members if m in entry.old_members]
        donors = assign_donors(graph, [j for j in entry.commit.change.joined if j in entry.members], old_members)
        donor = donors[self.me]
        worker._thread.run(self._close_alone(worker.node), timeout_s=None)
        first = self._open_segment(entry, graph, first, donor=donor)
        worker.record("joined", view=entry.number, members=list(entry.members), iter=first, donor=donor,
                      position=graph.position(self.me), wait_s=round(time.monotonic() - started, 6),
                      fingerprint=self._loaded)

    def _stop_hosted(self) -> None:
        if self._hosted is not None:
            hosted, self._hosted = self._hosted, None
            hosted.stop()

    async def _send_coordinator(self, entry: ViewEntry, env: dict[str, str]) -> None:
        self.run.send_coordinator(entry, env)

    async def _run_ended(self) -> None:
        self.run.tell_joiners_the_run_ended(self.worker.node.protocol.iteration)

    async def _send_cursors(self, entry: ViewEntry, cursors: dict[str, int]) -> None:
        self.run.send_cursors(entry, cursors)

    async def _send_state(self, entry: ViewEntry, joiner: int, payload: bytes) -> None:
        self.run.send_state(entry, joiner, payload)

    async def _state(self, entry: ViewEntry, donor: int) -> bytes:
        return await self.run.state(entry, donor)

    async def _cursors(self, entry: ViewEntry) -> dict[int, dict[str, int]]:
        """Every reporting old member's samplers' cursors (sampler rank -> name -> cursor)."""
        return await self.run.cursors(entry)

    def _address_exchange(self, entry: ViewEntry, graph: MemberGraph) -> Callable[[str], Awaitable[dict[int, str]]]:
        """How the new segment's members learn each other's addresses (position -> address)."""
        run = self.run

        async def exchange(address: str) -> dict[int, str]:
            run.announce(entry, {"addr": address})
            segments = await run.segments(entry)
            return {graph.position(rank): str(segments[rank]["addr"]) for rank in entry.members}
        return exchange

    def _who(self) -> str:
        return f"rank {self.worker.rank}"

    async def _entered(self, entry: ViewEntry) -> None:
        self.run.entered(entry)

    @staticmethod
    async def _close_alone(node: Node[Any]) -> None:
        """A joiner's node before its admission: it trained nothing and knows nobody."""
        node.owns_events = False
        await node.close(leave=False)

    def registered(self, name: str, obj: Any) -> None:
        """The trainer registered ``obj`` after this worker joined: a sampler enters the view the
        worker joined, from the division its donor's state brought."""
        late = self._late_samplers.pop(name, None)
        if late is not None and isinstance(obj, ElasticSampler):
            view, members, cursors = late
            obj.change_view(view, members, cursors)

    async def _end_segment(self, node: Node[Any], wait_for_peers: bool = True) -> None:
        """Finish the old segment as a run finishes: quiesce, wait until every neighbour is done
        too (none waits on this worker any more), say bye, close its sockets."""
        node.owns_events = False
        await node.quiesce()
        if wait_for_peers:
            deadline = time.monotonic() + node.clock.default_timeout_s
            while any(p not in node.done_peers and p not in node.departed and p not in node.dead
                      for p in node.graph.peers(node.rank)):
                if time.monotonic() > deadline:
                    raise HopnetError(f"rank {self.worker.rank}: the neighbours did not finish view {self.view} "
                                      f"within {node.clock.default_timeout_s:g}s (--timeout)")
                await asyncio.sleep(0.002)
        await node.close()

    def _state_payload(self, first: int) -> bytes:
        worker = self.worker
        with worker.model_lock:
            state = worker.replica.localized({  # (under fsdp: this member's shards, as a checkpoint holds them)
                "iteration": first, "model": worker._model_state(), "gathers": worker.gather_calls,
                "states": {name: checkpoint.state_of(obj) for name, obj in worker._states.items()
                           if not isinstance(obj, torch.Generator)}})
            buffer = io.BytesIO()
            torch.save(state, buffer)
        return buffer.getvalue()

    def _load_state(self, payload: bytes) -> dict[str, Any]:
        """Load a donor's state into the model and the registered state; returns it."""
        worker = self.worker
        state: dict[str, Any] = torch.load(io.BytesIO(payload), weights_only=False)
        with worker.model_lock:
            worker._load_model(state["model"])
        # The gathers are numbered: a joiner's next one is its donor's next (a trainer's collectives)
        worker.gather_calls = int(state.get("gathers", worker.gather_calls))
        for name, held in state.get("states", {}).items():
            if name in worker._states:
                checkpoint.load_state_into(worker._states[name], held)
            else:
                worker._resumed[name] = held  # registered later by the trainer
        return state

    def _open_segment(self, entry: ViewEntry, graph: MemberGraph, first: int, donor: int | None) -> int:
        """Open this worker's segment of ``entry``'s view; returns the view's first iteration."""
        worker, run = self.worker, self.run
        config = worker.config
        position = graph.position(self.me)
        device = worker.model.device if worker.model is not None else torch.device("cpu")
        params_bytes = worker.model.nbytes if worker.model is not None else None
        transport = make_transport(rank=position, peers=frozenset(graph.graph.peers(position)),
                                   bind_host=self.bind_host, bulk="zmq", device=device, store_endpoint="",
                                   timeout_s=config.timeout_s, message_bytes=params_bytes, curve=self.curve)
        grads = worker.grads
        factory = collective_factory(rank=position, world_size=graph.graph.n, bulk="zmq", device=device,
                                     store_endpoint="", timeout_s=config.timeout_s, bind_host=self.bind_host,
                                     tensor_bytes=None)
        old = worker.node
        protocol = make_protocol(config, worker.params, grads)
        held = protocol.checkpoint_state()  # DiLoCo's outer optimizer goes on in the new protocol object
        if held is not None:
            carried = old.protocol.checkpoint_state()
            if carried is not None and donor is None:
                held.load_state_dict(carried.state_dict())
            worker._states[checkpoint.PROTOCOL_STATE] = held
        if donor is not None:
            self._load_state(worker._thread.run(self._state(entry, donor), timeout_s=None))
            self._loaded = fingerprint(protocol.model_tensors())  # what the donor's ``state_sent`` names
        hosting = None
        client = None
        if needs_coordinator(config):
            if position == 0:
                hosting = ViewCoordinator.start(config, graph.graph, self.run_dir, entry.number, self.bind_host)
                worker._thread.run(self._send_coordinator(entry, hosting.worker_env()))
            env = worker._thread.run(run.coordinator_env(entry), timeout_s=None)
            client = client_from_environ(position, config.peer_timeout_s or 0.0, env)
        node: Node[Any] = Node(position, graph.graph, transport, protocol, clock=Clock(config.timeout_s),
                               events=old.events, peer_timeout_s=config.peer_timeout_s, collective_factory=factory,
                               coordinator=client, lanes=old.lanes)
        node.owns_events = False
        node.members = entry.members
        node.start_fields = {"view": entry.number}
        worker.replica.attach(node, worker.report)
        node.survives_losses = old.survives_losses
        node.handover_now = old.handover_now
        node.load_state = old.load_state
        # (a joiner computed ``first`` before it had the run's protocol: the safe point is the protocol's)
        first = protocol.view_change_iteration(first)
        protocol.resume_at(first)

        worker._thread.run(node.open(self._address_exchange(entry, graph)), timeout_s=None)
        node._t0 = old._t0  # one time axis for the worker's records, across its segments
        self._stop_hosted()  # every member announced: the old view is over everywhere
        self._hosted = hosting
        reported = worker._thread.run(self._cursors(entry), timeout_s=None)
        names = {name for held in reported.values() for name in held}
        members = self.view_members(entry.members)
        for name in sorted(names):
            # a member taken for dead reported nothing: its whole share goes round again (seen twice, never lost)
            cursors = {rank: reported.get(rank, {}).get(name, 0) for rank in self.view_members(entry.old_members)}
            obj = worker._states.get(name)
            if isinstance(obj, ElasticSampler):
                obj.change_view(entry.number, members, cursors)
            elif obj is None and donor is not None:
                self._late_samplers[name] = (entry.number, members, cursors)
        worker.node = node
        worker.graph = graph.graph
        self.members = members
        self.view = entry.number
        worker._thread.run(self._entered(entry))
        worker._thread.run(protocol.start(), timeout_s=None)
        worker._thread.run(protocol.after_resume(), timeout_s=None)
        final = worker._final_iteration
        if final is not None:
            protocol.final_iteration = final
            worker._thread.loop.call_soon_threadsafe(node.plan, final + 1)
        return first


def close_elastic(changeover: Changeover | None, timeout_s: float) -> None:
    """Close an elastic worker's control channel and event log (nothing for another worker)."""
    if changeover is not None:
        changeover.close(timeout_s)
