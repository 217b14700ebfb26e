"""Run N workers of a hopnet protocol in one process, in virtual time.

The workers are the real thing: each is a :class:`hopnet.runtime.node.Node` with the
protocol object `hopnet launch` would use, talking over the in-process transport.
Only time is modelled: a compute phase is a virtual sleep drawn from a
:class:`ComputeModel` and stretched by the slowdown rules, and a message arrives after
the link model's latency plus its size over the bandwidth. Everything is derived from
the seed, so a run is reproducible byte for byte.

A run with churn (``SimSpec.churn``: workers joining and leaving) runs as one segment per view,
as an elastic run does: :mod:`hopnet.sim.views`.
"""

from __future__ import annotations

import asyncio
import gc
import random
import time

import torch

from hopnet.analysis import GapTracker
from hopnet.coordinator import make_coordinator
from hopnet.coordinator.sim import SimCoordinator
from hopnet.output_spec import SKIPS
from hopnet.protocols import make_protocol
from hopnet.protocols.base import Protocol
from hopnet.runtime.clock import Clock
from hopnet.runtime.events import EventLog
from hopnet.runtime.node import Node
from hopnet.sim import stand_in as stand_ins
from hopnet.sim.spec import ComputeModel, SimResult, SimSpec
from hopnet.sim.views import ChurnRun
from hopnet.sim.vloop import VirtualTimeLoop


def simulate(spec: SimSpec) -> SimResult:
    """Run ``spec`` to completion in virtual time and report what happened."""
    spec.validate()
    started = time.perf_counter()
    loop = VirtualTimeLoop()
    # A large run creates hundreds of thousands of short-lived objects that hold no cycles;
    # without this the cyclic collector takes about a third of the time at 1024 workers.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    # Every simulated worker's tensors are small and run one after another on this thread:
    # torch's intra-op threads only contend for the cores (one 65k-element mul_ took 0.27 s
    # on a loaded 2-core machine), and virtual time does not count them anyway.
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if spec.churn:
            return loop.run_until_complete(ChurnRun(spec, loop, started).run())
        return loop.run_until_complete(_run(spec, started, loop))
    finally:
        torch.set_num_threads(torch_threads)
        loop.close()
        if gc_was_enabled:
            gc.enable()


async def _run(spec: SimSpec, started: float, loop: VirtualTimeLoop) -> SimResult:
    graph, config = spec.graph, spec.config
    n = graph.n
    stand_in, scale = stand_ins.stand_in_gradients(spec, n)
    network = stand_ins.network(spec, scale)
    gaps = GapTracker(n, matrix=spec.keeps_gap_matrix())
    slowdown = config.make_slowdown()
    virtual_time = loop.time
    machine = make_coordinator(config, graph)
    coordinator = SimCoordinator(machine, spec.link, keep_events=spec.keep_events) if machine is not None else None
    nodes: list[Node[Protocol]] = []
    models: list[torch.Tensor] = []  # the workers' models, which their protocols average in place
    for rank in range(n):
        params = stand_ins.initial_model(spec, rank, stand_in)
        if params is not None:
            models.append(params)
        protocol = make_protocol(config, params, stand_ins.gradients(spec, rank, stand_in))
        protocol.final_iteration = spec.iterations - 1
        transport = network.transport(rank, frozenset(graph.peers(rank)))
        nodes.append(Node(rank, graph, transport, protocol, clock=Clock(config.timeout_s),
                          events=EventLog(keep=spec.keep_events), on_enter=gaps.entered, timer=virtual_time,
                          coordinator=coordinator.client(rank) if coordinator is not None else None))
    for node in nodes:
        await node.open()
    finish_times: list[list[float]] = [[] for _ in range(n)]
    completed = [0] * n  # iterations each worker got through, skipped ones included

    async def worker(node: Node[Protocol]) -> None:
        rank = node.rank
        protocol = node.protocol
        rng = random.Random(f"{config.seed}:{rank}")
        compute = spec.compute.for_rank(rank)
        stop = spec.stop_at.get(rank)
        last = spec.iterations - 1
        finished = finish_times[rank]
        slowed = bool(slowdown)
        await protocol.start()
        node.plan(spec.iterations)
        while True:
            k = protocol.iteration
            if stop is not None and k >= stop:
                break
            compute_s = compute.sample(rng)
            if slowed:  # (a factor of 1.0 would leave compute_s as it is)
                compute_s *= slowdown.factor(rank, k)
            await loop.sleep(compute_s)
            await node.run_step(None, last=k >= last, compute_s=compute_s)
            finished.append(virtual_time())
            completed[rank] = k + 1 if protocol.iteration == k else protocol.iteration
            if k >= last:
                break
        await node.close()

    await asyncio.gather(*(worker(node) for node in nodes))
    protocols = [node.protocol for node in nodes]
    rates = []
    for times in finish_times:
        rates.append(len(times) / times[-1] if times and times[-1] > 0 else 0.0)
    skips = sorted((dict(event) for p in protocols for event in p.skip_log),
                   key=lambda e: (e["t"], e["rank"]))
    return SimResult(
        n=n,
        iterations=completed,
        finish_times=finish_times,
        rates=rates,
        max_gap=gaps.max_gap,
        largest_gap=gaps.largest,
        queue_high_water=[p.summary().get("queue_high_water") or 0 for p in protocols],
        token_high_water=[p.summary().get("token_high_water") or 0 for p in protocols],
        skips=skips,
        virtual_time=max((t[-1] for t in finish_times if t), default=0.0),
        wall_seconds=time.perf_counter() - started,
        dropped_late_updates=sum(p.late_updates_dropped for p in protocols),
        updates_not_sent=sum(p.updates_not_sent for p in protocols),
        params=models if spec.param_dim else None,
        events=[node.events.records for node in nodes] if spec.keep_events else None,
        coordinator=coordinator.summary() if coordinator is not None else None,
        coordinator_events=coordinator.records if coordinator is not None and spec.keep_events else None,
        counts=[{**p.summary(), SKIPS: len(p.skip_log)} for p in protocols],
    )



__all__ = ["ComputeModel", "SimResult", "SimSpec", "simulate"]
