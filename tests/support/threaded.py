"""Training loops of several ranks in this process: one thread per rank, each a real
:class:`hopnet.Worker` over the in-process transport (no sockets, no launcher).

``body(rank, start)`` is one rank's trainer: it builds its model (with :func:`seeded`), calls ``start(model)`` for
its worker (parameters and gradients flattened, as ``hopnet.init`` does; its records kept in
``worker.node.events.records``) and trains. The
harness closes every worker it started, and re-raises the first rank's error, if any.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from hopnet import Graph, ProtocolConfig, Worker
from hopnet.model_state import ModelState
from hopnet.params import FlatGradients, flatten_parameters
from hopnet.runtime.events import EventLog
from hopnet.runtime.services import AllReduce
from hopnet.transports.base import Transport
from hopnet.transports.inproc import InprocNetwork

T = TypeVar("T")
M = TypeVar("M", bound=torch.nn.Module)
Start = Callable[[torch.nn.Module], Worker]
JOIN_TIMEOUT_S = 120.0
_GLOBAL_RNG = threading.Lock()


def seeded(build: Callable[[], M], seed: int = 0) -> M:
    """``build()`` after ``torch.manual_seed(seed)``, alone: torch's global generator is shared by
    the threads, so ranks seeding and drawing at once would start from different weights."""
    with _GLOBAL_RNG:
        torch.manual_seed(seed)
        return build()


def run_ranks(n: int, config: ProtocolConfig, body: Callable[[int, Start], T], *,
              graph: Graph | None = None, buffers: bool = False,
              wrap: Callable[[int, Transport], Transport] | None = None,
              collective: Callable[[int], AllReduce] | None = None) -> list[T]:
    """Run ``body`` for ranks ``0..n-1`` in threads; their results, in rank order. ``buffers``: the
    workers hold the model's floating buffers too (:meth:`ModelState.of`, as ``hopnet.init`` does),
    not only its parameters. ``wrap(rank, transport)`` may put a rank's in-process transport inside
    another (a fault-injecting one). ``collective(rank)``: the rank's collective, in place of the
    node's own (a :class:`hopnet.collectives.torchdist.TorchCollective`)."""
    graph = Graph.ring(n) if graph is None else graph
    network = InprocNetwork()
    barrier = threading.Barrier(n)
    results: dict[int, T] = {}
    errors: dict[int, BaseException] = {}

    async def exchange(address: str) -> dict[int, str]:
        await asyncio.to_thread(barrier.wait)
        return {r: f"inproc://{r}" for r in range(n)}

    def run(rank: int) -> None:
        workers: list[Worker] = []

        def start(model: torch.nn.Module) -> Worker:
            transport: Transport = network.transport(rank, frozenset(graph.peers(rank)))
            if wrap is not None:
                transport = wrap(rank, transport)
            worker = Worker(rank=rank, graph=graph, config=config,
                            params=ModelState.of(model) if buffers else flatten_parameters(model),
                            grads=FlatGradients(model), module=model, transport=transport, exchange=exchange,
                            events=EventLog(),
                            collective_factory=(lambda _: collective(rank)) if collective is not None else None)
            workers.append(worker)
            return worker

        try:
            try:
                results[rank] = body(rank, start)
            finally:
                for worker in workers:
                    worker.close()
        except BaseException as exc:  # re-raised in the test's thread
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=JOIN_TIMEOUT_S)
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"still running after {JOIN_TIMEOUT_S}s: {alive}"
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} failed: {errors[rank]!r} (all: {errors})") from errors[rank]
    return [results[r] for r in range(n)]
