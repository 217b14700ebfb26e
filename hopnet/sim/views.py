"""A simulated run with churn: one segment per view, as an elastic run runs (docs/design/elastic.md).

Each membership change (:mod:`hopnet.sim.churn`) is a new view. When a change comes, every member
reports the iteration it is in; the new view begins at two past the highest, moved forward to the
protocol's safe point (:func:`hopnet.elastic.switch.first_iteration`), so every member runs the old
view's last iteration knowing that it is the last, as a run runs its final one. The old segment
then ends as a run ends (each member quiesces; once all have, they close), and the new one is a
fresh network, nodes and protocol objects over the members, placed on the graph the builder
re-forms for them (:class:`~hopnet.graph.members.MemberGraph`), resumed at the view's first
iteration (``resume_at``, ``after_resume``). A joiner copies its donor's model
(:func:`hopnet.elastic.switch.assign_donors`), and starts once the copy crossed the link.
One change at a time: events that come while one is pending wait until its view has begun.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from hopnet.analysis import GapTracker
from hopnet.elastic.switch import assign_donors, first_iteration
from hopnet.graph.members import MemberGraph
from hopnet.output_spec import SKIPS
from hopnet.protocols import make_protocol
from hopnet.protocols.base import Protocol
from hopnet.runtime.clock import Clock
from hopnet.runtime.events import EventLog
from hopnet.runtime.node import Node
from hopnet.sim import stand_in as stand_ins
from hopnet.sim.churn import Change, Membership, instants
from hopnet.sim.spec import SimResult, SimSpec, rounded
from hopnet.sim.vloop import VirtualTimeLoop


@dataclass
class ViewRecord:
    """One view of the run: who, since when (virtual time and iteration), and what it got done."""

    number: int
    members: tuple[int, ...]
    joined: tuple[int, ...]
    left: tuple[int, ...]
    began_s: float
    iteration: int
    decided_s: float
    """When the change that made it was decided: its events' time, or later when they waited for the
    change before them (the view begins once the old one's last iteration is done)."""
    ended_s: float | None = None
    iterations_done: int = 0
    """Iterations its members finished in it, all together."""

    @property
    def throughput(self) -> float:
        """Iterations per virtual second, all members together."""
        span = (self.ended_s if self.ended_s is not None else self.began_s) - self.began_s
        return self.iterations_done / span if span > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"view": self.number, "members": list(self.members), "joined": list(self.joined),
                "left": list(self.left), "decided_s": rounded(self.decided_s), "began_s": rounded(self.began_s),
                "iteration": self.iteration, "ended_s": None if self.ended_s is None else rounded(self.ended_s),
                "iterations_done": self.iterations_done, "throughput": rounded(self.throughput)}


@dataclass
class _Segment:
    view: ViewRecord
    graph: MemberGraph
    nodes: dict[int, Node[Protocol]]
    """By rank (the nodes are numbered by position)."""
    gaps: GapTracker
    delays: dict[int, float]
    """Joiners: virtual seconds until the donor's model has arrived."""
    last: int | None = None
    """The segment's last iteration, once a change is decided."""
    next_view: tuple[Change, int, float] | None = None
    """The decided change, the next view's first iteration, and when it was decided."""


class ChurnRun:
    """:func:`hopnet.sim.engine.simulate` for a spec with churn."""

    def __init__(self, spec: SimSpec, loop: VirtualTimeLoop, started: float) -> None:
        assert spec.churn and spec.builder is not None  # SimSpec.validate refuses the rest
        self.spec = spec
        self.loop = loop
        self.started = started
        self.last_iteration = spec.iterations - 1
        # One stand-in size for the whole run: a joiner copies its donor's model.
        self.stand_in, self.scale = stand_ins.stand_in_gradients(spec, spec.graph.n)
        self.slowdown = spec.config.make_slowdown()
        self.models: dict[int, torch.Tensor] = {}
        self.finish_times: dict[int, list[float]] = {}
        self.completed: dict[int, int] = {}
        self.began: dict[int, float] = {}
        self.rngs: dict[int, random.Random] = {}
        self.logs: dict[int, EventLog] = {}
        self.protocols: dict[int, list[Protocol]] = {}
        self.views: list[ViewRecord] = []
        self.skipped: list[str] = []
        self.largest_gap = (0, 0, 0)
        self.segment: _Segment | None = None
        self._begun = asyncio.Event()

    # ------------------------------------------------------------------ the run
    async def run(self) -> SimResult:
        first_view = ViewRecord(0, tuple(range(self.spec.graph.n)), (), (), 0.0, 0, 0.0)
        segment = await self._open(first_view, {})
        driver = self.loop.create_task(self._drive(), name="churn")
        try:
            while True:
                await asyncio.gather(*(self._work(segment, rank, node) for rank, node in segment.nodes.items()))
                segment.view.ended_s = self.loop.time()
                self._note_gaps(segment)
                if segment.next_view is None:
                    break
                await asyncio.gather(*(node.close() for node in segment.nodes.values()))
                segment = await self._next(segment, segment.next_view)
                self._begun.set()
        finally:
            driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await driver
        return self._result()

    async def _drive(self) -> None:
        """Apply the schedule's events as their times come; decide each change (one at a time)."""
        spec = self.spec
        assert spec.churn and spec.builder is not None and self.segment is not None
        membership = Membership(self.segment.view.members, spec.builder, spec.config.seed)
        for at_s, events in instants(spec.churn, spec.config.seed):
            if at_s > self.loop.time():
                await self.loop.sleep(at_s - self.loop.time())
            while self.segment.next_view is not None:
                await self._begun.wait()
            change = membership.apply(events)
            self.skipped += change.skipped
            what = ", ".join(repr(event.describe()) for event in events)
            if (change.joined or change.left) and not self._decide(change, what):
                return

    def _decide(self, change: Change, what: str) -> bool:
        """Fix where the next view begins, from the members' reports; False when it would begin
        after the run's last iteration (the run ends first: the change never takes effect)."""
        segment = self.segment
        assert segment is not None
        reports = {rank: node.protocol.iteration for rank, node in segment.nodes.items()}
        safe_point = next(iter(segment.nodes.values())).protocol.view_change_iteration
        first = first_iteration(reports, safe_point)
        if first > self.last_iteration:
            self.skipped.append(f"{what}: its view would begin at iteration {first}, after the run's last "
                                f"({self.last_iteration}): the run ends first")
            return False
        segment.last = first - 1
        for node in segment.nodes.values():
            final = node.protocol.final_iteration
            node.protocol.final_iteration = first - 1 if final is None else min(final, first - 1)
        segment.next_view = (change, first, self.loop.time())
        self._begun = asyncio.Event()
        return True

    async def _next(self, old: _Segment, decided: tuple[Change, int, float]) -> _Segment:
        change, first, decided_s = decided
        view = ViewRecord(old.view.number + 1, change.members, change.joined, change.left, self.loop.time(),
                          first, decided_s)
        graph_spec = self.spec.builder
        assert graph_spec is not None
        graph = MemberGraph.build(graph_spec, view.members)
        old_members = [m for m in view.members if m in old.nodes]
        donors = assign_donors(graph, change.joined, old_members) if change.joined else {}
        return await self._open(view, donors, graph)

    async def _open(self, view: ViewRecord, donors: dict[int, int], graph: MemberGraph | None = None) -> _Segment:
        """The view's segment: a network, and over it a node and a fresh protocol per member, opened."""
        spec, config = self.spec, self.spec.config
        assert spec.builder is not None
        graph = graph or MemberGraph.build(spec.builder, view.members)
        network = stand_ins.network(spec, self.scale)
        segment = _Segment(view, graph, {}, GapTracker(graph.n, matrix=False, start=view.iteration), {})
        for position, rank in enumerate(graph.members):
            donor = donors.get(rank)
            self._enter(rank, donor)
            protocol = make_protocol(config, self.models.get(rank), stand_ins.gradients(spec, rank, self.stand_in))
            protocol.final_iteration = self.last_iteration
            transport = network.transport(position, frozenset(graph.graph.peers(position)))
            node: Node[Protocol] = Node(position, graph.graph, transport, protocol, clock=Clock(config.timeout_s),
                                        events=self.logs[rank], on_enter=segment.gaps.entered, timer=self.loop.time)
            node.owns_events = False
            node.members = graph.members
            if view.number:
                node.start_fields = {"view": view.number}
                protocol.resume_at(view.iteration)
            self._carry_protocol_state(protocol, self.protocols.get(rank if donor is None else donor, []))
            self.protocols.setdefault(rank, []).append(protocol)
            segment.nodes[rank] = node
            if donor is not None:
                segment.delays[rank] = self._copy_s(donor, rank)
        for node in segment.nodes.values():
            await node.open()
        self.views.append(view)
        self.segment = segment
        return segment

    def _enter(self, rank: int, donor: int | None) -> None:
        """A rank's state the first time it is a member: its model (its donor's copy, for a joiner)."""
        if rank in self.finish_times:
            return
        spec = self.spec
        if donor is None:
            model = stand_ins.initial_model(spec, rank, self.stand_in)
        else:
            held = self.models.get(donor)
            model = None if held is None else held.clone()
        if model is not None:
            self.models[rank] = model
        self.finish_times[rank] = []
        self.completed[rank] = 0
        self.began[rank] = self.loop.time()
        self.rngs[rank] = random.Random(f"{spec.config.seed}:{rank}")
        self.logs[rank] = EventLog(keep=spec.keep_events)

    @staticmethod
    def _carry_protocol_state(protocol: Protocol, before: list[Protocol]) -> None:
        """The protocol's own state (DiLoCo's outer optimizer) from the rank's (or donor's) last segment."""
        held = protocol.checkpoint_state()
        carried = before[-1].checkpoint_state() if before else None
        if held is not None and carried is not None:
            held.load_state_dict(copy.deepcopy(carried.state_dict()))

    def _copy_s(self, donor: int, joiner: int) -> float:
        """Virtual seconds for the donor's model to reach a joiner: the link's latency plus its size
        over the bandwidth."""
        spec = self.spec
        size = spec.param_dim * 8 if spec.param_dim else spec.model_bytes
        latency, bytes_per_s = spec.link.params(donor, joiner)
        return latency + (size / bytes_per_s if bytes_per_s > 0 else 0.0)

    async def _work(self, segment: _Segment, rank: int, node: Node[Protocol]) -> None:
        """One member's training in one view: until the view's last iteration, or the run's."""
        loop, spec = self.loop, self.spec
        protocol = node.protocol
        rng = self.rngs[rank]
        compute = spec.compute.for_rank(rank)
        finished = self.finish_times[rank]
        delay = segment.delays.get(rank, 0.0)
        if delay > 0:
            await loop.sleep(delay)
        await protocol.start()
        if segment.view.iteration:
            await protocol.after_resume()
        node.plan(spec.iterations)
        while True:
            k = protocol.iteration
            compute_s = compute.sample(rng)
            if self.slowdown:
                compute_s *= self.slowdown.factor(rank, k)
            await loop.sleep(compute_s)
            last = self.last_iteration if segment.last is None else min(self.last_iteration, segment.last)
            await node.run_step(None, last=k >= last, compute_s=compute_s)
            finished.append(loop.time())
            self.completed[rank] = k + 1 if protocol.iteration == k else protocol.iteration
            segment.view.iterations_done += 1
            if k >= last:
                break
        if segment.last is not None and k >= segment.last:
            await node.quiesce()  # the view ends: closed once every member has quiesced
        else:
            await node.close()

    def _note_gaps(self, segment: _Segment) -> None:
        gap, i, j = segment.gaps.largest
        if gap > self.largest_gap[0]:
            self.largest_gap = (gap, segment.graph.rank(i), segment.graph.rank(j))

    # ------------------------------------------------------------------ the report
    def _result(self) -> SimResult:
        ranks = sorted(self.finish_times)
        protocols = [p for rank in ranks for p in self.protocols[rank]]
        position_to_rank = {id(p): self._members_of(p) for p in protocols}
        skips = sorted(({**event, "rank": position_to_rank[id(p)][event["rank"]]}
                        for p in protocols for event in p.skip_log), key=lambda e: (e["t"], e["rank"]))
        rates = []
        for rank in ranks:
            times = self.finish_times[rank]
            span = times[-1] - self.began[rank] if times else 0.0
            rates.append(len(times) / span if span > 0 else 0.0)
        spec = self.spec
        return SimResult(
            n=len(ranks),
            iterations=[self.completed[rank] for rank in ranks],
            finish_times=[self.finish_times[rank] for rank in ranks],
            rates=rates,
            max_gap=None,
            largest_gap=self.largest_gap,
            queue_high_water=[self._high_water(rank, "queue_high_water") for rank in ranks],
            token_high_water=[self._high_water(rank, "token_high_water") for rank in ranks],
            skips=skips,
            virtual_time=max((t[-1] for t in self.finish_times.values() if t), default=0.0),
            wall_seconds=time.perf_counter() - self.started,
            dropped_late_updates=sum(p.late_updates_dropped for p in protocols),
            updates_not_sent=sum(p.updates_not_sent for p in protocols),
            params=[self.models[rank] for rank in ranks] if spec.param_dim else None,
            events=[self.logs[rank].records for rank in ranks] if spec.keep_events else None,
            counts=[self._counts(rank) for rank in ranks],
            views=[view.to_dict() for view in self.views],
            churn_skipped=self.skipped,
        )

    def _members_of(self, protocol: Protocol) -> tuple[int, ...]:
        members = getattr(protocol.node, "members", None)
        return tuple(members) if members is not None else tuple(range(self.spec.graph.n))

    def _high_water(self, rank: int, key: str) -> int:
        return max((p.summary().get(key) or 0 for p in self.protocols[rank]), default=0)

    def _counts(self, rank: int) -> dict[str, Any]:
        """A rank's counts as `hopnet report` reads an elastic worker's log: its last segment's
        ``stop`` record (each segment's protocol counts afresh), its skips over every segment."""
        protocols = self.protocols[rank]
        return {**protocols[-1].summary(), SKIPS: sum(len(p.skip_log) for p in protocols)}


__all__ = ["ChurnRun", "ViewRecord"]
