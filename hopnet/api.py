"""What a trainer calls: :func:`init`, :class:`Worker` (and :class:`hopnet.optim.DistributedOptimizer`).

A few lines turn an ordinary PyTorch loop into a hopnet worker::

    worker = hopnet.init(model)                      # reads what `hopnet launch` set
    opt = hopnet.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), worker)
    for step in worker.iterations(1000):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        worker.report(loss=loss.item())
        opt.step()                                   # exchange, mix, apply, advance
    worker.consensus()                               # optional: every live worker ends with the mean model
    worker.close()

The node's event loop runs in a thread of its own, so sends and receives progress
while the trainer computes. ``opt.step()`` blocks only for what the protocol needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hopnet import checkpoint
from hopnet.collectives.base import Collective, ReduceOp
from hopnet.collectives.consensus import ConsensusResult, consensus, gather
from hopnet.config import ProtocolConfig
from hopnet.coordinator.client import CoordinatorClient, client_from_environ
from hopnet.deferral import GradientSyncDeferral
from hopnet.errors import ConfigError, HopnetError
from hopnet.graph import Graph
from hopnet.bootstrap.env import MODEL_FILE, Restarts, save_model_requested
from hopnet.model_state import ModelState
from hopnet.params import FlatGradients
from hopnet.protocols import make_protocol
from hopnet.runtime.clock import Clock
from hopnet.runtime.events import EventLog, JsonlEventLog
from hopnet.runtime import cpu_time, rejoin, shutdown
from hopnet.runtime.loop_thread import EventLoopThread
from hopnet.runtime.node import AddressExchange, CollectiveFactory, Node
from hopnet.runtime.services import CoordinatorChannel, ReplicaLanes
from hopnet.elastic.changeover import Changeover, close_elastic
from hopnet.elastic.settings import ElasticSettings
from hopnet.elastic.setup import check_elastic, lone_config, lone_graph, open_control, start_elastic
from hopnet.elastic.stopped import raise_if_stopped
from hopnet.transports.base import Transport
from hopnet.transports.tcp_diag import link_counters
from hopnet.wire import Message
from hopnet.bootstrap.lanes import event_log_path, place_in_replica
from hopnet.replica.base import NO_REPLICA, ReplicaSync
from hopnet.replica.handover import one_handover, state_key
from hopnet.bootstrap.init import (
    InitSpec,
    check_inputs,
    check_restarts,
    connect,
    find_launcher,
    open_run,
    resolve_options,
)

CLOSE_TIMEOUT_S = 120.0
"""Longest a close may take before the loop thread is abandoned (sends have their own timeout)."""

ABORT_FLUSH_S = 1.0
"""How long a failing worker waits for its last sends (its ``bye`` included) before closing."""


async def run_consensus(node: Node, call: int) -> ConsensusResult:
    """Quiesce the node's protocol, then average its model over the live workers
    (:func:`hopnet.collectives.consensus.consensus`)."""
    await node.quiesce()
    result = await consensus(node, node.protocol.model_tensors(), call=call)
    ranks = node.members  # an elastic run's view: the collective counts positions, the result names ranks
    if ranks is None:
        return result
    return dataclasses.replace(result, members=tuple(ranks[p] for p in result.members),
                               non_finite=tuple(ranks[p] for p in result.non_finite))


async def run_gather(node: Node, value: Any, call: int) -> dict[int, Any]:
    """What :meth:`Worker.gather` returns: every live worker's ``value``, by rank, the same dict on
    every live worker, for the small agreements a trainer makes outside the protocol (a metric's
    mean, a stop decision, a path to share, a barrier). The live workers agree on who they are, as
    :meth:`Worker.consensus` does (workers that left or died under ``--max-failures`` are left out),
    each one's value riding on its agreement messages (:func:`hopnet.collectives.consensus.gather`):
    one round trip when none left. Every live worker calls it, as many times and in the same order;
    the call blocks until all of them did (``--timeout``). ``value``: None, bool, numbers, str,
    bytes, lists and dicts of them, small enough for a message header (a few MiB); pickle anything
    else into bytes."""
    values = await gather(node, value, call=call)
    ranks = node.members
    return values if ranks is None else {ranks[p]: v for p, v in values.items()}


def checkpoint_state_of(worker: Worker, iteration: int) -> dict[str, Any]:
    """What :meth:`Worker.save_checkpoint` writes after ``iteration``, as CPU copies: the model, the
    registered state (the optimizer's included), the RNG states. For a trainer that keeps its
    checkpoints itself (a framework's), which :func:`init` takes back as ``resume=``; take it where
    a checkpoint is consistent: after a step, before the next one computes."""
    with worker.model_lock:  # ad-psgd averages on the event loop
        state: dict[str, Any] = checkpoint.copied(worker.replica.localized({  # (under fsdp: this member's shards)
            "iteration": iteration, "rank": worker.rank, "protocol": worker.config.protocol,
            "model": model_state_of(worker), "replica_size": worker.replica.size,
            "states": {name: checkpoint.state_of(obj) for name, obj in worker._states.items()},
            "rng": checkpoint.rng_states()}))
    return state


def save_state_dict(state: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``state`` (a state_dict) to ``path`` as plain CPU tensors (not views into hopnet's
    flat buffers), through a temporary file so a reader never sees half of it."""
    state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}
    partial = path.with_name(path.name + ".tmp")
    torch.save(state, partial)
    os.replace(partial, path)


async def send_handovers(node: Node, messages: list[Message]) -> None:
    for msg in messages:
        await node.connect_to([msg.dst])
        node.post(msg)
        node.record("handed_over", peer=msg.dst, iter=msg.iter, fingerprint=(msg.meta or {}).get("fingerprint"))
    await node.flush()


def model_state_of(worker: Worker) -> dict[str, torch.Tensor]:
    """The model as checkpoints and handovers carry it (under fsdp, this process's shards)."""
    if worker.module is not None:
        return dict(worker.replica.model_state(worker.module))
    return {f"params{i}": t for i, t in enumerate(worker.node.protocol.model_tensors())}


def load_model_into(worker: Worker, state: Mapping[str, torch.Tensor]) -> None:
    if worker.module is not None:
        worker.replica.load_model_state(worker.module, dict(state))
    else:
        for i, tensor in enumerate(worker.node.protocol.model_tensors()):
            tensor.copy_(state[f"params{i}"])


def consensus_state(worker: Worker) -> dict[str, torch.Tensor] | None:
    """What ``--save-model`` writes: the module's state_dict (under fsdp gathered over the replica, by
    every member; ``None`` on those that do not write it), or the flat parameters of ``params=``."""
    if worker.module is not None:
        return worker.replica.full_model_state(worker.module)
    flats = worker.node.protocol.model_tensors()
    return {"params": flats[0]} if len(flats) == 1 else {f"params{i}": t for i, t in enumerate(flats)}


def assemble_node(*, rank: int, graph: Graph, config: ProtocolConfig, params: ModelState | torch.Tensor | None,
                  grads: FlatGradients | torch.Tensor | None, transport: Transport, events: EventLog | None,
                  collective_factory: CollectiveFactory | None, coordinator: CoordinatorClient | None,
                  lanes: ReplicaLanes | None = None) -> Node:
    """The node of one worker: ``config``'s protocol over ``params`` (the model's flat tensors, or one
    bare flat parameter tensor) and ``grads``, on ``transport``,
    with the clock and peer timeout ``config`` sets. :class:`Worker` and :class:`AsyncWorker`
    (and so :func:`init`) build their node here."""
    protocol = make_protocol(config, params, grads)
    return Node(rank, graph, transport, protocol, clock=Clock(config.timeout_s), events=events,
                peer_timeout_s=config.peer_timeout_s, collective_factory=collective_factory,
                coordinator=coordinator, lanes=lanes)


async def rejoin_coordinator(coordinator: CoordinatorChannel) -> None:
    coordinator.send({"t": "rejoin"})  # count this rank in again (hopnet.coordinator.wire)


def load_handover(worker: Worker, handover: rejoin.Handover) -> None:
    """A resync found ``worker`` behind ``handover.donor``: take its model and registered state
    (the optimizer's: the models stay identical only if the steps do), on the event loop with the
    trainer blocked in its step."""
    worker._load_model(handover.state["model"])
    for name, state in handover.state.get("states", {}).items():
        if name in worker._states:
            checkpoint.load_state_into(worker._states[name], state)


def take_over(worker: Worker, restart: int) -> dict[str, Any]:
    """Replace this rank's dead worker: rejoin the run and load a neighbour's state (under replica
    groups, every lane at the same iteration from the same replica: :mod:`hopnet.replica.handover`).
    Returns the trainer's registered state handed over, loaded as each registers."""
    node = worker.node
    before = rejoin.fingerprint(node.protocol.model_tensors())
    # Every rank hears of it: groups and collectives are drawn from the whole run, not the graph only.
    lane_rank = node.rank  # the process's rank, or its replica's in a run of replica groups
    everyone = [r for r in range(worker.graph.n) if r != lane_rank]
    neighbours = sorted(worker.graph.peers(lane_rank))
    donors = neighbours + [r for r in everyone if r not in neighbours]
    wait_s = worker.config.timeout_s
    handover = worker._thread.run(node.rejoin(restart, everyone, donors, wait_s=wait_s))
    lanes = worker.replica.lanes
    if lanes is not None:
        async def ask_again(donor: int, at: int) -> rejoin.Handover:
            return await node.ask_again(restart, donor, at, wait_s)

        whole = worker.replica.mode == "ddp" and worker.module is not None
        key = functools.partial(state_key, parameters=frozenset(n for n, _ in worker.module.named_parameters())
                                if whole and worker.module is not None else None)
        handover = worker._thread.run(one_handover(lanes, handover, ask_again, key, replica=lane_rank))
    state = handover.state
    # Under the lock: an ad-psgd passive serves averagings on the event loop meanwhile, and the
    # record must show the model loaded, not one averaged since.
    with worker.model_lock:
        worker._load_model(state["model"])
        loaded = rejoin.fingerprint(node.protocol.model_tensors())
    seen = handover.protocol_state.pop(rejoin.RESTARTS_SEEN, {})
    finished = bool(handover.protocol_state.pop(rejoin.FINISHED, False))
    handover.protocol_state.pop(rejoin.BLOCKED, None)
    worker.gather_calls = int(handover.protocol_state.pop(rejoin.GATHERS, 0))
    node.restarts_seen.update({int(r): int(n) for r, n in seen.items() if int(r) != lane_rank})
    node.protocol.rejoin_at(handover.iteration, handover.protocol_state)
    if node.coordinator is not None:
        worker._thread.run(rejoin_coordinator(node.coordinator))
    if not finished:  # else the others are done training: there is nothing to catch up with
        worker._thread.run(node.protocol.after_rejoin())
    worker.record("rejoined", restart=restart, peer=handover.donor, iter=handover.iteration,
                  fingerprint=loaded, initial_fingerprint=before, donor_fingerprint=handover.fingerprint)
    return dict(state.get("states", {}))


def _record_kernel_counters(worker: Worker) -> bool:
    """The kernel's round trip and retransmissions on the worker's connections to each peer
    (:mod:`hopnet.transports.tcp_diag`), as a ``links`` record for `hopnet report`, and its threads'
    time on and waiting for a core (:mod:`hopnet.runtime.cpu_time`), as a ``cpu`` record; whether
    it asked (in-process transports have no sockets)."""
    node = worker.node
    times = cpu_time.scheduler_times(worker._busy_threads())
    if times:
        worker.record("cpu", **times)
    if not node.transport.heartbeats or not node.addresses:
        return False
    peers = link_counters({r: a for r, a in node.addresses.items() if r != node.rank})
    if peers:
        worker.record("links", peers={str(r): c for r, c in sorted(peers.items())})
    return True


class Worker:
    """One training process's handle on its node, driven from the trainer's thread."""

    def __init__(self, *, rank: int, graph: Graph, config: ProtocolConfig,
                 params: ModelState | torch.Tensor | None, transport: Transport,
                 exchange: AddressExchange | None = None, events: EventLog | None = None,
                 grads: FlatGradients | torch.Tensor | None = None,
                 collective_factory: CollectiveFactory | None = None,
                 coordinator: CoordinatorClient | None = None, start_iteration: int = 0,
                 max_restarts: int = 0, restart: int = 0, max_failures: int = 0,
                 module: torch.nn.Module | None = None, members: tuple[int, ...] | None = None,
                 replica: ReplicaSync = NO_REPLICA, process_rank: int | None = None) -> None:
        """``start_iteration``: resume there (after a checkpoint of the iteration before it).
        ``params``: the model's flat tensors (:meth:`ModelState.of`, what ``hopnet.init`` passes) or
        one bare flat parameter tensor. ``coordinator``: the client of the run's coordinator
        (``hopnet.init`` builds it from ``HOPNET_COORDINATOR``; group protocols reach it as
        ``node.coordinator``). ``max_restarts``: dead workers the launcher may replace (peers then
        wait for them to come back); ``restart``: this process replaces its rank's dead worker (the
        ``restart``-th time) and takes a neighbour's state (:mod:`hopnet.runtime.rejoin`).
        ``max_failures``: workers the run may lose; a group a dead member broke is then rolled back.
        ``members``: the rank on each node of ``graph`` if not ``0..n-1`` (an elastic joiner's: ``(rank,)``).
        ``replica``: this process's replica group (:mod:`hopnet.replica`), whose lane the node runs as
        ``rank``; :attr:`rank` is then ``process_rank``, this process's rank in the run."""
        model = ModelState.wrap(params)
        if model is not None and model.device.type != "cpu" and not transport.carries_cuda:
            raise ConfigError(f"the model is on {model.device}: its tensors need the torch bulk plane "
                              "(--bulk torch or auto), not ZeroMQ")
        self.rank = rank if process_rank is None else process_rank
        self.replica = replica
        self.graph = graph
        self.config = config
        self.params = params
        self.model = model
        self.grads = grads
        self.slowdown = config.make_slowdown()
        self.slowdown.validate_ranks(graph.n)
        self._thread = EventLoopThread(name=f"hopnet-rank{rank}")
        self.node = assemble_node(rank=rank if members is None else members.index(rank), graph=graph,
                                  config=config if members is None else lone_config(), params=params, grads=grads,
                                  transport=transport, events=events, collective_factory=collective_factory,
                                  coordinator=coordinator, lanes=replica.lanes)
        self.node.members = members
        replica.attach(self.node, self.report)  # its start fields; its time in each iteration's record
        self.node.start_fields.update(cpu_time.machine(), **cpu_time.scheduler_times(self._busy_threads()))
        self._final_iteration: int | None = None
        self._closed = False
        self.failure: BaseException | None = None
        """The last error :meth:`step` raised, kept for the ``error`` record at exit."""
        self.steps = 0
        self._reported: dict[str, Any] = {}  # metrics for this iteration's record, handed over at its step
        self._in_loop = False
        """The trainer is inside :meth:`iterations`: a step's boundary comes when its loop body is done."""
        self._boundary: tuple[int, bool] | None = None
        """A step finished (its iteration, whether the last) whose boundary has not been reached."""
        self.after_close: list[Callable[[bool], None]] = []
        """Called with ``aborted`` once the node is closed (the store of an attached run leaves)."""
        self.module: torch.nn.Module | None = module
        """The module :func:`init` was given, if any: what :meth:`consensus` saves (else
        ``{"params": the flat parameters}``)."""
        self._deferral = GradientSyncDeferral(self._defer_gradient_sync, module)
        self.save_model_to: Path | None = None
        """Where :meth:`consensus` writes the model's state_dict on the lowest live rank
        (:func:`init` sets it under ``hopnet launch --save-model``)."""
        self.saved_model: Path | None = None
        """Where :meth:`consensus` wrote the model (on the rank that wrote it)."""
        self.consensus_calls = 0
        self.gather_calls = 0
        self.changeover: Changeover | None = None  # an elastic run's view changes, set by init()
        self._left = False  # an elastic worker that left: its node is closed
        self._links_recorded = False  # the kernel's counters per peer, once (at the consensus, else at close)
        self.checkpointer: checkpoint.Checkpointer | None = None
        """Saves this worker's state every N iterations (:func:`init` sets it from ``HOPNET_CHECKPOINT_EVERY``)."""
        self._states: dict[str, Any] = {}
        self._resumed: dict[str, Any] = {}
        """The user state of the checkpoint this worker resumed from, loaded as it registers."""
        held = self.node.protocol.checkpoint_state()
        if held is not None:  # the protocol's own state (DiLoCo's outer optimizer) travels with the model
            self._states[checkpoint.PROTOCOL_STATE] = held
        self.node.max_restarts = max_restarts
        self.node.survives_losses = max_restarts > 0 or max_failures > 0
        self.node.restart = restart
        self.node.mailbox.replaceable = max_restarts > 0
        self.node.handover_now = self._hand_over_on_loop
        self.node.load_state = functools.partial(load_handover, self)
        self._resuming = bool(start_iteration)
        """Resumed from a checkpoint whose load (:meth:`load_checkpoint`) has not yet run the
        protocol's :meth:`~hopnet.protocols.base.Protocol.after_resume`."""
        if start_iteration:
            self.node.protocol.resume_at(start_iteration)
        try:
            self._thread.run(self.node.open(exchange))
            if restart:
                self._take_over(restart)
            self._thread.run(self.node.protocol.start())
        except BaseException:
            try:
                self._thread.run(self.node.close(leave=False), timeout_s=CLOSE_TIMEOUT_S)
            finally:
                self._thread.stop()
            raise
        shutdown.track(self)
        self._compute_started = time.monotonic()

    # ------------------------------------------------------------------ the loop
    @property
    def iteration(self) -> int:
        """The iteration this worker is in (it can jump when skipping is on)."""
        return self.node.protocol.iteration

    def iterations(self, total: int) -> Generator[int, None, None]:
        """Yield the iterations to compute, until ``total``; call :meth:`step` once in each.

        Iteration numbers may jump when a straggler skips ahead; every worker of a run
        stops at the same iteration, so none waits for a neighbour that already left.
        """
        if total < 1:
            raise ConfigError(f"iterations(total) needs total >= 1 (got {total})")
        self._enter_run()
        self._final_iteration = total - 1
        self.node.protocol.final_iteration = total - 1
        if self.model is not None:
            self.model.check_bound()  # before the protocol sends the model (Node.plan begins it)
        self.replica.refresh()
        self._thread.loop.call_soon_threadsafe(self.node.plan, total)
        if self.steps == 0:
            self._compute_started = time.monotonic()  # setup before the loop is not iteration 0's compute
        self._in_loop = True
        try:
            while (current := self.iteration) < total:
                steps = self.steps
                yield current
                if self.steps == steps:
                    # The trainer skipped its optimizer step (an overflow, say): the iteration still
                    # finishes, with no apply, so no peer waits for this worker's part of it.
                    self.step()
                    self.record("step_skipped", iter=current)
                self._step_boundary()
                if current == total - 1:
                    return
        finally:  # (a loop left early: a replacement still waiting is answered at close)
            self._in_loop = False

    def step(self, apply: Callable[[], None] | None = None) -> None:
        """Finish the current iteration: ``apply`` is the optimizer step (Hop's Apply)."""
        if self._closed:
            raise HopnetError("step() on a closed worker")
        self._enter_run()
        if self.consensus_calls:
            raise HopnetError(f"rank {self.rank}: step() after consensus(): training is over, close the worker")
        if self.model is not None:
            self.model.check_bound()
        factor = self.slowdown.factor(self.node.rank, self.iteration)
        if factor > 1.0:
            time.sleep((factor - 1.0) * (time.monotonic() - self._compute_started))
            self.report(slowdown=factor)
        last = self._final_iteration is not None and self.iteration >= self._final_iteration
        # The view's last iteration: its segment ends after it, as a run ends after its last.
        ends = last or (self.changeover is not None and self.changeover.ends_segment(self.iteration))
        compute_s = time.monotonic() - self._compute_started
        finished = self.iteration
        try:
            self._deferral.reducing_now()
            self.replica.before_step()
            reported, self._reported = self._reported, {}
            running = self.node.run_step(self.replica.wrap_apply(apply), last=ends, compute_s=compute_s,
                                         metrics=reported)
            self._thread.run(running if self.changeover is None else self.changeover.run.unless_over(running))
            self.replica.after_step()
        except Exception as exc:
            self.failure = exc
            raise_if_stopped(self.changeover, exc)  # an elastic run's membership ended it: its line says why
            raise
        self.steps += 1
        self._boundary = (finished, last)
        if not self._in_loop:
            self._step_boundary()
        self._compute_started = time.monotonic()

    def _busy_threads(self) -> tuple[int | None, int | None]:
        """The trainer's thread (this one) and the event loop's: where a worker computes and talks."""
        return threading.get_native_id(), self._thread.native_id

    def _enter_run(self) -> None:
        if self.changeover is not None:  # a joiner of an elastic run enters it at its first step, set up
            self.changeover.join_when_due()

    def _step_boundary(self) -> None:
        """Where the trainer's state is whole between two iterations: a checkpoint is due, or a
        replacement waits for this worker's state. Under :meth:`iterations` that is once the loop's
        body is done, so what the trainer steps after the optimizer (an LR schedule, a loss scaler)
        is saved and handed over stepped; a trainer looping on its own gets it at :meth:`step`'s end."""
        pending, self._boundary = self._boundary, None
        if pending is None:
            return
        finished, last = pending
        saved = self.checkpointer is not None and self.checkpointer.due(finished) and not last
        if saved:
            self.save_checkpoint(finished)
        handed = bool(self.node.handover_requests) and not self._closed
        if handed:
            self._hand_over(finished + 1 if last else self.iteration, finished=last)
        changed = self.changeover is not None and not last and not self._closed and self.changeover.boundary(finished)
        if saved or handed or changed:
            self._compute_started = time.monotonic()  # the next iteration's compute starts now

    # ------------------------------------------------------------------ replacements
    def _take_over(self, restart: int) -> None:
        self._resumed = take_over(self, restart)

    def _hand_over(self, iteration: int, finished: bool = False) -> None:
        """Send this worker's state to the replacements that asked for it (at a step boundary, or
        once training is over: the model is consistent)."""
        requests = self._thread.run(self._take_requests(None if finished else iteration))
        if not requests:
            return
        with self.model_lock:
            messages = self._handover_messages(requests, iteration, finished)
        self._thread.run(send_handovers(self.node, messages))

    def _hand_over_on_loop(self, requests: list[int]) -> None:
        """The same on the event loop, while the protocol waits with the trainer blocked in its step
        (:meth:`hopnet.runtime.node.Node.handover_point`)."""
        final = self._final_iteration
        done = self.node.quiesced and final is not None  # training is over here: after the last iteration
        messages = self._handover_messages(requests, final + 1 if done and final is not None
                                           else self.node.protocol.iteration, finished=done, blocked=not done)
        task = self._thread.loop.create_task(send_handovers(self.node, messages))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _handover_messages(self, requests: list[int], iteration: int, finished: bool = False,
                           blocked: bool = False) -> list[Message]:
        # A random stream is each rank's own (taking a neighbour's would make the replacement draw
        # the neighbour's batches): the replacement keeps its own generators. Under fsdp, this
        # member's shards, as a checkpoint holds them.
        state = self.replica.localized({"model": self._model_state(),
                                        "states": {name: checkpoint.state_of(obj) for name, obj in self._states.items()
                                                   if not isinstance(obj, torch.Generator)}})
        model_print = rejoin.fingerprint(self.node.protocol.model_tensors())
        protocol_state = {**self.node.protocol.handover_state(),
                          rejoin.RESTARTS_SEEN: {str(r): n for r, n in self.node.restarts_seen.items()},
                          rejoin.FINISHED: finished, rejoin.BLOCKED: blocked, rejoin.GATHERS: self.gather_calls}
        return [rejoin.handover_message(self.node.rank, peer, iteration, protocol_state, state, model_print)
                for peer in requests]

    async def _take_requests(self, iteration: int | None) -> list[int]:
        return self.node.take_handover_requests(iteration)

    def _answer_late_handovers(self) -> None:
        """Training is over here: a replacement that asked now starts after the last iteration."""
        if self.node.handover_requests and self._thread.alive:
            final = self._final_iteration
            self._hand_over(final + 1 if final is not None else self.iteration, finished=True)

    # ------------------------------------------------------------------ checkpoints
    def register_state(self, name: str, obj: Any) -> None:
        """Save ``obj`` in this worker's checkpoints under ``name``, and load it back on resume
        (now, when the checkpoint resumed from holds it). ``obj``: anything with
        ``state_dict()``/``load_state_dict()``, a ``torch.Generator``, or a dict (updated in place).
        A :class:`~hopnet.optim.DistributedOptimizer` registers itself."""
        checkpoint.state_of(obj)  # refuses an object it could not save
        self._states[name] = obj
        if name in self._resumed:
            checkpoint.load_state_into(obj, self._resumed.pop(name))
        if self.changeover is not None:
            self.changeover.registered(name, obj)

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks of the view this worker trains in (what :class:`hopnet.data.ElasticSampler` divides)."""
        if self.changeover is not None:
            return self.changeover.members
        return tuple(range(self.graph.n * self.replica.size))  # a replica's members read data apart, as under DDP

    @property
    def view(self) -> int:
        """The number of the view this worker trains in (0 unless the run is elastic)."""
        return self.changeover.view if self.changeover is not None else 0

    def save_checkpoint(self, iteration: int) -> Path:
        """Write the state after ``iteration``: the model (parameters and buffers), the registered
        state (the optimizer's included), the RNG states. The worker calls it every
        ``--checkpoint-every`` iterations, once the protocol has finished the iteration and
        before the trainer computes the next: the model then holds that iteration's result,
        and under :meth:`iterations` the loop's body is done (an LR schedule stepped after the
        optimizer is saved stepped).
        The trainer pays for a copy of the state; a thread writes it (:class:`hopnet.checkpoint.Checkpointer`),
        and the next checkpoint, or :meth:`close`, waits for that write."""
        if self.checkpointer is None:
            raise HopnetError("save_checkpoint() needs a checkpoint directory (--checkpoint-every)")
        self.checkpointer.wait()  # the previous write: the copy below must not wait on the disk twice
        path = self.checkpointer.submit(iteration, self.checkpoint_state(iteration))  # written in the background
        self.record("checkpoint", iter=iteration, path=path.name)
        return path

    def checkpoint_state(self, iteration: int) -> dict[str, Any]:
        """What :meth:`save_checkpoint` writes (:func:`checkpoint_state_of`); ``init(resume=)`` takes it."""
        return checkpoint_state_of(self, iteration)

    def _model_state(self) -> dict[str, torch.Tensor]:
        return model_state_of(self)

    def _load_model(self, state: Mapping[str, torch.Tensor]) -> None:
        load_model_into(self, state)

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        """Load what :meth:`save_checkpoint` wrote: the model (if there) and RNG states now, the
        registered state now or when it registers."""
        self.replica.check_resharding(state.get("replica_size", 1))
        if "model" in state:
            self._load_model(state["model"])
        checkpoint.restore_rng_states(state["rng"])
        self._resumed = dict(state["states"])
        for name in list(self._resumed):
            if name in self._states:
                checkpoint.load_state_into(self._states[name], self._resumed.pop(name))
        if self._resuming:  # every rank of the resumed run is here, before its trainer computes
            self._resuming = False
            self._thread.run(self.node.protocol.after_resume())
        self.record("resumed", iter=state["iteration"],
                    fingerprint=rejoin.fingerprint(self.node.protocol.model_tensors()))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync()``, for gradient accumulation: a backward pass whose forward pass ran
        inside it, or which runs inside it, only accumulates into ``.grad``; the next backward pass
        that does neither (or the step) reduces the sum (:mod:`hopnet.deferral`). Without it every
        backward pass reduces the ``.grad`` it accumulated into, as under DDP, which gives the same
        average for more messages."""
        with self._deferral.no_sync():
            yield

    def _defer_gradient_sync(self, deferred: bool) -> None:
        self.node.protocol.defer_gradient_sync(deferred)
        self.replica.deferring(deferred)

    def synchronize(self) -> None:
        """Average this iteration's gradient now, into each ``.grad``, under the protocols that
        average gradients; :meth:`step` then does not average it again. A trainer calls it (or
        :meth:`hopnet.optim.DistributedOptimizer.synchronize`) to clip or unscale the averaged
        gradient. Under the model-averaging protocols the gradient stays local: nothing to do."""
        if self._closed:
            raise HopnetError("synchronize() on a closed worker")
        try:
            self._deferral.reducing_now()
            self.replica.before_synchronize()
            self._thread.run(self.node.protocol.synchronize())
            self.replica.after_synchronize()
        except Exception as exc:
            self.failure = exc
            raise

    def allreduce(self, group: Sequence[int], tensor: torch.Tensor, op: ReduceOp = "mean", *,
                  tag: str) -> torch.Tensor:
        """All-reduce ``tensor`` in place among ``group`` on the node's collective, blocking this
        thread until it is done (see :class:`hopnet.collectives.base.Collective`)."""
        collective = self.node.collective
        if isinstance(collective, Collective):
            done = collective.allreduce_blocking(group, tensor, op, tag=tag)
            if done is not None:
                return done
        return self._thread.run(collective.allreduce(group, tensor, op, tag=tag))

    def gather(self, value: Any) -> dict[int, Any]:
        """Every live worker's ``value``, by rank, the same dict on every one (:func:`run_gather`)."""
        if self._closed:
            raise HopnetError("gather() on a closed worker")
        self.gather_calls += 1
        return self._thread.run(run_gather(self.node, value, self.gather_calls - 1))

    def consensus(self) -> ConsensusResult:
        """End training with one model: every live worker's parameters (and buffers) become the
        exact mean of the live workers' ones. Call it on every worker once its training loop is
        over, before :meth:`close`; no :meth:`step` may follow.

        The protocol first finishes what is still in flight (ad-psgd's averagings, the groups of
        partial-reduce and Prague, eager-SGD's and Pipe-SGD's rounds) and tells its neighbours it
        is done; then the live workers agree on who they are (workers that left or died, under
        ``--max-failures``, are left out) and all-reduce their models
        (:mod:`hopnet.collectives.consensus`). Every wait has ``--timeout`` and fails naming the
        ranks it waited on. Under ``hopnet launch --save-model`` the lowest live rank then writes
        the model's state_dict to ``model.pt`` in the run directory (:attr:`saved_model`).

        Returns the members averaged and the agreement rounds it took.
        """
        if self._closed:
            raise HopnetError("consensus() on a closed worker")
        self._answer_late_handovers()
        self._links_recorded = self._links_recorded or _record_kernel_counters(self)  # training over, peers still connected
        call = self.consensus_calls
        self.consensus_calls += 1
        try:
            result = self._thread.run(run_consensus(self.node, call))
            self.replica.after_step(mixed=True)  # every member of a replica holds what its lanes averaged
        except Exception as exc:
            self.failure = exc
            raise
        if self.save_model_to is not None and self.node.rank == result.members[0]:
            state = consensus_state(self)
            if state is not None:
                save_state_dict(state, self.save_model_to)
                self.saved_model = self.save_model_to
                self.record("model_saved", path=str(self.save_model_to), members=list(result.members))
        return result

    @property
    def model_lock(self) -> threading.Lock:
        """Hold it to read the parameters from another thread while nothing changes them: the
        protocols that write the model on the event loop while the trainer computes (ad-psgd's
        averagings) take it around each write, and around the optimizer step."""
        return self.node.model_lock

    def report(self, **metrics: Any) -> None:
        """Attach metrics (``loss=...``) to this iteration's record in the event log."""
        self._reported.update(metrics)  # (the step takes them to the loop: no wake-up of its own per call)

    def record(self, event: str, **fields: Any) -> None:
        """Write a free-form event (an evaluation result, say) to the event log."""
        self._thread.loop.call_soon_threadsafe(lambda: self.node.record(event, **fields))

    @property
    def dropped(self) -> dict[str, int]:
        """Messages dropped by validation, by reason (transport and protocol together)."""
        return dict(self.node.dropped_all())

    def close(self) -> None:
        """Leave the run: tell the neighbours, flush, close sockets, stop the loop thread.

        Optional: a worker still open when the interpreter exits is closed then (see
        :mod:`hopnet.runtime.shutdown`).
        """
        if self._closed:
            return
        self._closed = True
        shutdown.untrack(self)
        self._deferral.close()
        try:
            if self.checkpointer is not None:
                self.checkpointer.wait()
            self._answer_late_handovers()
            if not self._left:
                self._links_recorded = self._links_recorded or _record_kernel_counters(self)
                self._thread.run(self.node.close(), timeout_s=CLOSE_TIMEOUT_S)
            close_elastic(self.changeover, CLOSE_TIMEOUT_S)
        finally:
            self._thread.stop()
            self._run_after_close(aborted=False)

    def _run_after_close(self, aborted: bool) -> None:
        for hook in self.after_close:
            hook(aborted)

    def abort(self, error: BaseException | None = None, exit_code: int = 1) -> None:
        """Leave promptly because the process is failing with ``error`` / ``exit_code``.

        Writes the ``error`` record (naming the peer to blame when the error names one),
        says ``bye`` to the neighbours, waits at most :data:`ABORT_FLUSH_S` for sends in
        flight, and closes. Never waits for the neighbours themselves.
        """
        if self._closed:
            return
        self._closed = True
        shutdown.untrack(self)
        if isinstance(error, SystemExit) and self.failure is not None:
            error = self.failure  # sys.exit(1) after catching a hopnet error: blame what step() raised
        fields = shutdown.error_fields(error, exit_code)
        iteration = shutdown.iteration_of(error)
        try:
            if self._thread.alive:
                if self._left:
                    self.node.record_error(fields, iteration)
                else:
                    self._thread.run(self._abort(fields, iteration), timeout_s=CLOSE_TIMEOUT_S)
                close_elastic(self.changeover, CLOSE_TIMEOUT_S)
        finally:
            self._thread.stop()
            self._run_after_close(aborted=True)

    async def _abort(self, fields: dict[str, Any], iteration: int | None) -> None:
        self.node.record_error(fields, iteration)
        # A member of a replica group fails with its replica, which --max-restarts brings back: a bye
        # would tell the neighbours it left for good.
        comes_back = self.replica.size > 1 and self.node.max_restarts > 0
        await self.node.close(leave=not comes_back, flush_timeout_s=ABORT_FLUSH_S)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncWorker:
    """The same worker for asyncio code: the node runs on the caller's own event loop.

    ::

        worker = await AsyncWorker.start(rank=..., graph=..., config=..., params=..., transport=...)
        while worker.iteration < total:
            ...                                   # compute (off the loop for heavy work)
            await worker.step(apply, last=worker.iteration == total - 1)
        await worker.close()

    Over ZeroMQ the node sends heartbeats from this loop: code that blocks the loop for
    longer than ``peer_timeout_s`` makes the neighbours declare this worker dead.
    """

    def __init__(self, node: Node) -> None:
        self.node = node
        self._compute_started = time.monotonic()
        self._consensus_calls = 0

    @classmethod
    async def start(cls, *, rank: int, graph: Graph, config: ProtocolConfig, params: ModelState | torch.Tensor | None,
                    transport: Transport, exchange: AddressExchange | None = None,
                    events: EventLog | None = None,
                    grads: FlatGradients | torch.Tensor | None = None,
                    collective_factory: CollectiveFactory | None = None,
                    coordinator: CoordinatorClient | None = None) -> AsyncWorker:
        node = assemble_node(rank=rank, graph=graph, config=config, params=params, grads=grads,
                             transport=transport, events=events, collective_factory=collective_factory,
                             coordinator=coordinator)
        try:
            await node.start(exchange)
        except BaseException:
            await node.close(leave=False)
            raise
        return cls(node)

    @property
    def iteration(self) -> int:
        return self.node.protocol.iteration

    async def step(self, apply: Callable[[], None] | None = None, *, last: bool = False) -> None:
        """Finish the current iteration; with ``last`` the worker does not enter another."""
        if self._consensus_calls:
            raise HopnetError(f"rank {self.node.rank}: step() after consensus(): training is over, close the worker")
        model = self.node.protocol.model
        if model is not None:
            model.check_bound()
        compute_s = time.monotonic() - self._compute_started
        await self.node.run_step(apply, last=last, compute_s=compute_s)
        self._compute_started = time.monotonic()

    def plan(self, total: int) -> None:
        """Tell the event log's readers (progress, report) that the run has ``total`` iterations."""
        self.node.plan(total)

    def report(self, **metrics: Any) -> None:
        self.node.report(**metrics)

    async def consensus(self) -> ConsensusResult:
        """:meth:`Worker.consensus` on this worker's loop: every live worker ends with the exact
        mean of the live workers' models. No :meth:`step` may follow."""
        call = self._consensus_calls
        self._consensus_calls += 1
        return await run_consensus(self.node, call)

    async def close(self) -> None:
        await self.node.close()


def init(model: torch.nn.Module | None = None, *, params: torch.Tensor | None = None,
         config: ProtocolConfig | None = None, graph: Graph | str | os.PathLike[str] | None = None,
         resume: Mapping[str, Any] | None = None, **options: Any) -> Worker:
    """Start this process's worker as its launcher configured it.

    Under `hopnet launch` the rank, graph, peers and protocol come from the launcher. Under
    torchrun or srun (see :mod:`hopnet.bootstrap.external`) the rank and world size come from
    their variables, the graph from ``graph`` (a :class:`Graph`, a JSON path or a spec such
    as ``"ring:4"``), else ``HOPNET_GRAPH``, else a ring, the protocol from ``HOPNET_*``
    variables, and the workers meet through the run's TCPStore.

    ``model``'s trainable parameters and floating buffers are moved into one flat tensor per
    dtype (see :class:`hopnet.model_state.ModelState`), and its gradients into others (see
    :class:`hopnet.params.FlatGradients`): each ``.grad`` is a view, so gradient protocols such
    as ``allreduce`` reduce one tensor. Load weights after ``init`` with
    ``model.load_state_dict(state)`` (it copies into the views); whatever the model holds when
    the trainer's loop starts is what the protocol sends first.
    They stay on the model's device: CUDA models need ``bulk="torch"`` or ``"auto"`` (NCCL
    moves their tensors; they never pass through host memory).
    The protocol comes from the launcher's flags; ``config`` replaces it, and keyword
    ``options`` (``max_ig=4``, ``backup_workers=1``...) override single fields, except
    those given explicitly on the launcher's command line (a :class:`ConfigError` names
    both). Every rank must end up with the same options: the rendezvous refuses a rank
    whose options differ from another's.

    ``resume``: a state :meth:`Worker.checkpoint_state` returned after iteration K, for a trainer
    that keeps its checkpoints itself: the worker starts at iteration K + 1 from it, as
    ``--resume`` does from hopnet's own checkpoints (every rank must resume from the same K).
    Without ``"model"`` in it, the model stays as the trainer loaded it.

    The steps are the phases of :mod:`hopnet.bootstrap.init`, in order.
    """
    spec = InitSpec(model=model, params=params, config=config, graph=graph, options=options)
    context = find_launcher(spec.graph, os.environ)
    cfg = resolve_options(spec, context)
    check_inputs(spec, context, cfg)
    run = open_run(context, cfg)
    process, (context, tensors, replica) = context, place_in_replica(spec, context, cfg)
    restarts = check_restarts(Restarts.from_environ(os.environ), cfg, context, tensors)
    elastic = ElasticSettings.from_environ(os.environ)
    channel = None
    if elastic is not None:
        check_elastic(cfg, tensors.device.type, restarts.allowed, replica.size)
        if replica.member == 0:  # in a replica group, member 0 speaks for the replica (hopnet.elastic.replicas)
            channel, _ = open_control(context, cfg)
    joining = elastic is not None and elastic.joining
    # A joiner starts alone, on a graph of one node, until a view admits it (hopnet.elastic.setup).
    alone = dataclasses.replace(context, rank=0, world_size=1, graph=lone_graph()) if joining else context
    transport, factory = connect(alone, cfg, tensors, replaceable=restarts.allowed > 0)
    try:
        settings = checkpoint.CheckpointSettings.from_environ(os.environ, run.run_dir)
        resume_after = settings.resume_iteration(process.world_size)
        saved = (checkpoint.load(settings.directory, process.rank, resume_after)
                 if resume_after is not None and settings.directory is not None else None)
        if resume is not None:
            if saved is not None:
                raise ConfigError("hopnet.init(resume=...) in a run resumed by --resume (HOPNET_RESUME): pass one")
            saved, resume_after = dict(resume), int(resume["iteration"])
        worker = Worker(rank=context.rank, graph=alone.graph, config=cfg, params=tensors.params,
                        transport=transport, exchange=None if joining else context.exchange(cfg, restarts.this),
                        events=JsonlEventLog(event_log_path(run.run_dir, context)), grads=tensors.grads,
                        collective_factory=factory,
                        coordinator=replica.coordinator(client_from_environ(context.rank, cfg.peer_timeout_s)),
                        start_iteration=0 if resume_after is None or restarts.this else resume_after + 1,
                        max_restarts=restarts.allowed, restart=restarts.this, max_failures=restarts.losses,
                        module=spec.model, members=(context.rank,) if joining else None,
                        replica=replica, process_rank=process.rank)
    except BaseException:
        run.finish(aborted=True)
        raise
    if elastic is not None:
        try:
            start_elastic(worker, elastic, channel, context, cfg, run.run_dir, store_endpoint=process.store_endpoint)
        except BaseException as exc:
            worker.abort(exc)
            raise
    worker.after_close.append(run.finish)
    if settings.every and settings.directory is not None:
        worker.checkpointer = checkpoint.Checkpointer(settings.directory, process.rank, settings.every)
    if saved is not None and not restarts.this:  # a replacement takes a neighbour's state instead
        worker.load_checkpoint(saved)
    if save_model_requested(os.environ):
        worker.save_model_to = Path(run.run_dir) / MODEL_FILE
    return worker
