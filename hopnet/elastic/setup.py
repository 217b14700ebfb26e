"""An elastic worker's start: what :func:`hopnet.init` adds when the launcher made the run elastic."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from hopnet.bootstrap.init import WorkerContext
from hopnet.config import ProtocolConfig
from hopnet.bootstrap.lanes import LaneContext
from hopnet.elastic.changeover import Changeover
from hopnet.elastic.control import ControlChannel
from hopnet.elastic.replicas import FollowerRun, ReplicaChangeover, ViewStore
from hopnet.elastic.run import ElasticRun
from hopnet.elastic.settings import STOP_FILE, ElasticSettings
from hopnet.elastic.support import elastic_refusal
from hopnet.errors import ConfigError, HopnetError
from hopnet.graph import Graph
from hopnet.membership import MembershipConfig, View
from hopnet.rendezvous.client import barrier, register_control
from hopnet.runtime import shutdown
from hopnet.security import CurveKeys

GATHER_S = 0.2
"""How long the proposer waits for more joiners after the first asks (those of one `hopnet join`
ask within milliseconds of each other), so they enter in one view."""

REGISTER_POLL_S = 0.1
"""How often a joiner that started before the run's first workers asks the rendezvous again."""

DEFAULT_PEER_TIMEOUT_S = 10.0
"""The membership's silence limit when the run sets no ``--peer-timeout``."""


def check_elastic(config: ProtocolConfig, device_type: str, max_restarts: int, replica_size: int = 1) -> None:
    """Refuse what an elastic worker cannot run, before any socket opens."""
    refusal = elastic_refusal(config, replica_size)
    if refusal is None and device_type != "cpu":
        refusal = "an elastic run needs CPU tensors for now: the ZeroMQ plane carries them"
    if refusal is None and max_restarts:
        refusal = "--max-restarts replaces a dead worker in place; an elastic run re-forms without it instead"
    if refusal is not None:
        raise ConfigError(f"--min-nproc/--max-nproc: {refusal}")


def lone_config() -> ProtocolConfig:
    """A joiner's protocol until it is admitted: one that needs no coordinator, never started."""
    return ProtocolConfig(protocol="allreduce")


def lone_graph() -> Graph:
    """A joiner's graph until it is admitted: itself alone."""
    return Graph(1, [], name="joining")


def open_control(context: WorkerContext, config: ProtocolConfig) -> tuple[ControlChannel, dict[int, str]]:
    """Bind this worker's control channel and register it with the run's rendezvous."""
    launched = context.launched
    if launched is None:
        raise ConfigError("--min-nproc/--max-nproc needs `hopnet launch` (or `hopnet join`)")
    channel = ControlChannel(context.rank, context.bind_host, context.curve)
    address = channel.open()
    table = register_control(launched.rendezvous, context.rank, address, config.timeout_s, context.curve)
    return channel, table


def start_elastic(worker: Any, settings: ElasticSettings, channel: ControlChannel | None, context: WorkerContext,
                  config: ProtocolConfig, run_dir: str, *, store_endpoint: str = "") -> Changeover:
    """Start ``worker``'s membership; a joiner asks to be admitted at its first step. In a run of replica
    groups the views' members are replicas, ``context`` is this process's lane's, and only member 0 of a
    replica has a ``channel`` (:mod:`hopnet.elastic.replicas`); ``store_endpoint``: the run's c10d store."""
    assert context.launched is not None
    layout = context.layout if isinstance(context, LaneContext) else None
    first = None if settings.joining else View(0, tuple(range(context.world_size)))
    batch = tuple(sorted({r // layout.size for r in settings.batch})) if layout is not None else settings.batch
    run: ElasticRun | FollowerRun
    begin: Callable[[], None] = lambda: None
    if channel is not None:
        run, begin = _membership(worker, settings, channel, context, config, first, batch)
    else:
        run = FollowerRun(context.rank, worker.record, lambda: worker.node.protocol.iteration)
    kwargs: dict[str, Any] = dict(graph_spec=settings.graph, bind_host=context.bind_host, curve=context.curve,
                                  safe_point=lambda k: worker.node.protocol.view_change_iteration(k), run_dir=run_dir,
                                  ask_to_join=begin if settings.joining else None)
    changeover: Changeover
    if layout is not None:
        assert isinstance(context, LaneContext)
        lanes = worker.replica.lanes
        if lanes is not None:  # positions in a view go up to the largest view's size
            for agreement in (lanes, lanes.side):
                if agreement is not None:
                    agreement.candidates = max(agreement.candidates, settings.max_nproc)
        changeover = ReplicaChangeover(worker, run, layout=layout, member=context.member, group=worker.replica.group,
                                       views=ViewStore(store_endpoint, config.timeout_s), **kwargs)
    else:
        assert isinstance(run, ElasticRun)
        changeover = Changeover(worker, run, **kwargs)
    if not settings.joining:
        begin()
    worker.changeover = changeover
    # until it is admitted a joiner is alone (what a sampler it builds now divides the data over)
    changeover.members = changeover.view_members(first.members if first is not None else (context.rank,))
    changeover.view = 0
    _leave_on_sigterm(worker, run, Path(run_dir) / STOP_FILE)
    changeover.joining = settings.joining  # it asks to be admitted at its first step
    return changeover


def _membership(worker: Any, settings: ElasticSettings, channel: ControlChannel, context: WorkerContext,
                config: ProtocolConfig, first: View | None, batch: tuple[int, ...]
                ) -> tuple[ElasticRun, Callable[[], None]]:
    """This worker's membership (member 0's, for its replica) and how it starts: at once, or at a
    joiner's first step once it met its fellow joiners."""
    assert context.launched is not None
    table = register_control(context.launched.rendezvous, context.rank, channel.address, config.timeout_s,
                             context.curve)  # complete now: every first member registered before its exchange
    channel.learn(table)
    peer_timeout = config.peer_timeout_s or DEFAULT_PEER_TIMEOUT_S
    membership = MembershipConfig(peer_timeout=peer_timeout, max_members=settings.max_nproc,
                                  min_members=settings.min_nproc, gather_s=GATHER_S,
                                  unit="replica" if isinstance(context, LaneContext) else "rank")
    contacts = sorted(r for r in table if r != context.rank)
    run = ElasticRun(context.rank, channel, membership, first_view=first, contacts=contacts,
                     record=worker.record, iteration=lambda: worker.node.protocol.iteration,
                     timeout_s=config.timeout_s)

    async def start() -> None:
        run.start()

    rendezvous, rank = context.launched.rendezvous, context.rank

    def begin() -> None:
        if not settings.joining:
            worker._thread.run(start())
            return
        # A joiner's first step: the members it may ask now, its fellow joiners met, its requests out.
        fresh = _members_registered(rendezvous, rank, channel, batch, config.timeout_s, context.curve)
        run.membership.set_contacts(r for r in fresh if r != rank and r not in batch)
        if len(batch) > 1:  # the joiners of one `hopnet join` ask together, to enter in one view
            barrier(rendezvous, rank, f"join-{batch[0]}", config.timeout_s, context.curve, count=len(batch))
        worker._thread.run(start())
    return run, begin


def _members_registered(rendezvous: str, rank: int, channel: ControlChannel, batch: Sequence[int],
                        timeout_s: float, curve: CurveKeys | None) -> dict[int, str]:
    """The control addresses the rendezvous knows, once they include a rank outside this joiner's
    batch (a member to ask): a joiner may start before the run's first workers have registered."""
    deadline = time.monotonic() + timeout_s
    while True:
        table = register_control(rendezvous, rank, channel.address, timeout_s, curve)
        channel.learn(table)
        if any(r != rank and r not in batch for r in table):
            return table
        if time.monotonic() >= deadline:
            raise HopnetError(f"rank {rank}: no member of the run registered with its rendezvous within "
                              f"{timeout_s:g}s; nobody to ask to join")
        time.sleep(REGISTER_POLL_S)


def _leave_on_sigterm(worker: Any, run: ElasticRun | FollowerRun, stop_file: Path) -> None:
    """A SIGTERM the launcher did not send (a preemption) makes this worker leave at its next
    view change; the launcher's own (it wrote ``stop_file`` first), or a second one, stops it."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: FrameType | None) -> Any:
        if run.leaving or stop_file.exists() or not worker._thread.alive or worker._closed:
            signal.signal(signal.SIGTERM, previous)
            if callable(previous):
                return previous(signum, frame)
            raise shutdown.Terminated(signum)
        worker._thread.loop.call_soon_threadsafe(run.leave)
        return None

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: SIGTERM keeps its meaning (the process stops)
        pass


__all__ = ["check_elastic", "lone_config", "lone_graph", "open_control", "start_elastic"]
