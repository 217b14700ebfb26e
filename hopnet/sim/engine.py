"""Run N workers of a hopnet protocol in one process, in virtual time.

The workers are the real thing: each is a :class:`hopnet.runtime.node.Node` with the
protocol object `hopnet launch` would use, talking over the in-process transport.
Only time is modelled: a compute phase is a virtual sleep drawn from a
:class:`ComputeModel` and stretched by the slowdown rules, and a message arrives after
the link model's latency plus its size over the bandwidth. Everything is derived from
the seed, so a run is reproducible byte for byte.
"""

from __future__ import annotations

import asyncio
import gc
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hopnet.analysis import GapTracker
from hopnet.config import ProtocolConfig
from hopnet.coordinator import make_coordinator
from hopnet.coordinator.sim import SimCoordinator
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.output_spec import SKIPS
from hopnet.protocols import make_protocol
from hopnet.protocols.base import Protocol
from hopnet.protocols.adpsgd.options import REPLY as AVERAGING_REPLY
from hopnet.protocols.adpsgd.options import REQUEST as AVERAGING_REQUEST
from hopnet.registry import Averages
from hopnet.runtime.clock import Clock
from hopnet.runtime.events import EventLog
from hopnet.runtime.mailbox import COLLECTIVE_KIND
from hopnet.runtime.node import Node
from hopnet.sim import GAP_MATRIX_MAX_N
from hopnet.sim.vloop import VirtualTimeLoop
from hopnet.transports.inproc import InprocNetwork, LinkModel


@dataclass(frozen=True)
class ComputeModel:
    """Compute time per iteration, in seconds: ``const:MS``, ``uniform:LO:HI``, ``exp:MEAN``
    or ``normal:MEAN:SD`` (milliseconds; a bare number means ``const``), optionally per rank."""

    kind: str = "const"
    a: float = 0.01
    b: float = 0.0
    per_rank: tuple[tuple[int, ComputeModel], ...] = ()

    @classmethod
    def parse(cls, text: str) -> ComputeModel:
        parts = text.strip().split(":")
        try:
            if len(parts) == 1:
                return cls._checked("const", float(parts[0]), 0.0, text)
            kind, numbers = parts[0], [float(x) for x in parts[1:]]
        except ValueError:
            raise ConfigError(f"compute time {text!r}: expected MS, uniform:LO:HI, exp:MEAN or normal:MEAN:SD") from None
        arity = {"const": 1, "uniform": 2, "exp": 1, "normal": 2}
        if kind not in arity or len(numbers) != arity[kind]:
            raise ConfigError(f"compute time {text!r}: expected MS, uniform:LO:HI, exp:MEAN or normal:MEAN:SD")
        return cls._checked(kind, numbers[0], numbers[1] if len(numbers) > 1 else 0.0, text)

    @classmethod
    def _checked(cls, kind: str, a_ms: float, b_ms: float, text: str) -> ComputeModel:
        if not (math.isfinite(a_ms) and math.isfinite(b_ms)) or a_ms < 0 or b_ms < 0:
            raise ConfigError(f"compute time {text!r}: times must be finite and >= 0")
        if kind == "uniform" and b_ms < a_ms:
            raise ConfigError(f"compute time {text!r}: HI must be >= LO")
        return cls(kind, a_ms / 1000.0, b_ms / 1000.0)

    def with_rank(self, rank: int, model: ComputeModel) -> ComputeModel:
        return ComputeModel(self.kind, self.a, self.b, self.per_rank + ((rank, model),))

    def for_rank(self, rank: int) -> ComputeModel:
        for r, model in reversed(self.per_rank):
            if r == rank:
                return model
        return self

    def sample(self, rng: random.Random) -> float:
        if self.kind == "const":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        if self.kind == "exp":
            return rng.expovariate(1.0 / self.a) if self.a > 0 else 0.0
        return max(0.0, rng.gauss(self.a, self.b))

    @property
    def mean(self) -> float:
        return {"const": self.a, "uniform": (self.a + self.b) / 2, "exp": self.a, "normal": self.a}[self.kind]




@dataclass
class SimSpec:
    """Everything a simulated run depends on."""

    graph: Graph
    config: ProtocolConfig
    iterations: int
    compute: ComputeModel = field(default_factory=ComputeModel)
    link: LinkModel = field(default_factory=LinkModel)
    model_bytes: int = 0
    param_dim: int = 0
    stop_at: dict[int, int] = field(default_factory=dict)
    keep_events: bool = False
    gap_matrix: bool | None = None
    """Keep every pair's largest gap (``SimResult.max_gap``, O(n^2) memory and O(n) per iteration
    entered); ``None``: only up to :data:`GAP_MATRIX_MAX_N` workers."""

    def keeps_gap_matrix(self) -> bool:
        return self.graph.n <= GAP_MATRIX_MAX_N if self.gap_matrix is None else self.gap_matrix

    def validate(self) -> None:
        if self.iterations < 1:
            raise ConfigError(f"--iterations must be >= 1 (got {self.iterations})")
        if self.model_bytes < 0 or self.param_dim < 0:
            raise ConfigError("model size must be >= 0")
        for rank, it in self.stop_at.items():
            if not 0 <= rank < self.graph.n:
                raise ConfigError(f"stop_at: rank {rank} out of range")
            if it < 0:
                raise ConfigError(f"stop_at: iteration for rank {rank} must be >= 0")
        self.config.validate_ranks(self.graph.n)  # per-protocol graph checks run when each worker binds


@dataclass
class SimResult:
    n: int
    iterations: list[int]
    finish_times: list[list[float]]
    rates: list[float]
    max_gap: np.ndarray | None
    """``[i][j]``: the largest Iter(i) - Iter(j) observed; None unless the run kept it
    (:attr:`SimSpec.gap_matrix`)."""
    largest_gap: tuple[int, int, int]
    """``(gap, i, j)``: the largest gap between any two workers, and the first pair in rank order
    that showed it."""
    queue_high_water: list[int]
    token_high_water: list[int]
    skips: list[dict[str, Any]]
    virtual_time: float
    wall_seconds: float
    dropped_late_updates: int
    updates_not_sent: int
    params: list[torch.Tensor] | None = None
    events: list[list[dict[str, Any]]] | None = None
    coordinator: dict[str, Any] | None = None
    """The coordinator's summary (group protocols), None when the run had none."""
    coordinator_events: list[dict[str, Any]] | None = None
    counts: list[dict[str, Any]] = field(default_factory=list)
    """Per rank, what a real worker's ``stop`` record would carry of its protocol's counts
    (``protocol.summary()``, and ``skips``): what ``ProtocolSpec.output`` names."""

    def to_dict(self, include_wall: bool = False) -> dict[str, Any]:
        data: dict[str, Any] = {
            "n": self.n,
            "iterations": self.iterations,
            "virtual_time": _round(self.virtual_time),
            "rates": [_round(r) for r in self.rates],
            "mean_rate": _round(sum(self.rates) / len(self.rates)),
            "max_gap": None if self.max_gap is None else self.max_gap.tolist(),
            "largest_gap": dict(zip(("gap", "i", "j"), self.largest_gap)),
            "queue_high_water": self.queue_high_water,
            "token_high_water": self.token_high_water,
            "skips": self.skips,
            "dropped_late_updates": self.dropped_late_updates,
            "updates_not_sent": self.updates_not_sent,
            "finish_times": [[_round(t) for t in ts] for ts in self.finish_times],
        }
        if self.coordinator is not None:
            data["coordinator"] = self.coordinator
        if include_wall:
            data["wall_seconds"] = round(self.wall_seconds, 3)
        return data


def _round(x: float) -> float:
    return float(f"{x:.9g}")


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
        return loop.run_until_complete(_run(spec, started, loop))
    finally:
        torch.set_num_threads(torch_threads)
        loop.close()
        if gc_was_enabled:
            gc.enable()


STAND_IN_MAX_ELEMENTS = 1 << 16
"""Largest stand-in gradient (float32 elements) the simulator all-reduces for a model it
only knows the size of; the links are charged the model's bytes, scaled up."""


def _stand_in_gradients(spec: SimSpec, n: int) -> tuple[int, float]:
    """Elements of the float32 gradient stand-in, and the factor its bytes are charged at."""
    numel = max(n, min(spec.model_bytes // 4, STAND_IN_MAX_ELEMENTS))
    return numel, spec.model_bytes / (4 * numel)


def _gradients(spec: SimSpec, rank: int, stand_in: int) -> torch.Tensor | None:
    """What a gradient protocol reduces every iteration (there is no trainer to compute any):
    random values of the model's size, or of the stand-in's when only its bytes are known."""
    if spec.config.spec.averages is not Averages.GRADIENTS:
        return None
    gen = torch.Generator().manual_seed(spec.config.seed * 1_000_003 + rank + 1)
    if spec.param_dim:
        return torch.randn(spec.param_dim, generator=gen, dtype=torch.float64)
    return torch.randn(stand_in, generator=gen, dtype=torch.float32)


async def _run(spec: SimSpec, started: float, loop: VirtualTimeLoop) -> SimResult:
    graph, config = spec.graph, spec.config
    n = graph.n
    stand_in, scale = _stand_in_gradients(spec, n)
    stand_in_kinds = (COLLECTIVE_KIND, AVERAGING_REQUEST, AVERAGING_REPLY)
    network = InprocNetwork(spec.link, virtual_bytes={"update": spec.model_bytes} if spec.model_bytes else None,
                            byte_scale=None if spec.param_dim else {kind: scale for kind in stand_in_kinds})
    gaps = GapTracker(n, matrix=spec.keeps_gap_matrix())
    slowdown = config.make_slowdown()
    virtual_time = loop.time
    machine = make_coordinator(config, graph)
    coordinator = SimCoordinator(machine, spec.link, keep_events=spec.keep_events) if machine is not None else None
    nodes: list[Node[Protocol]] = []
    models: list[torch.Tensor] = []  # the workers' models, which their protocols average in place
    for rank in range(n):
        params = None
        if spec.param_dim:
            gen = torch.Generator().manual_seed(config.seed * 1_000_003 + rank)
            params = torch.randn(spec.param_dim, generator=gen, dtype=torch.float64)
        elif config.spec.averages is Averages.MODELS and not config.spec.simulated_without_tensors:
            # A model stand-in to average (there is no trainer); links are charged the model's bytes.
            gen = torch.Generator().manual_seed(config.seed * 1_000_003 + rank)
            params = torch.randn(stand_in, generator=gen, dtype=torch.float32)
        if params is not None:
            models.append(params)
        protocol = make_protocol(config, params, _gradients(spec, rank, stand_in))
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

