"""Clusters of workers for peer-failure tests: real processes, or in-process on one loop.

:class:`Cluster` starts one process per rank the way `hopnet launch` starts them, minus the
launcher: a RendezvousServer and the launcher's ``HOPNET_*`` environment, each worker in a
process group of its own. So no launcher notices a death and stops the others; whatever the
survivors do, they do on their own. It ends every process it started, also when a test fails.

:func:`start_workers` runs the ranks as :class:`hopnet.AsyncWorker` objects on the test's own
event loop, over whatever transport ``transport_for`` builds; :class:`FaultyCluster` does so
over a :class:`support.faults.FaultyTransport` around ZeroMQ per rank, which is what most
peer-failure logic needs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hopnet import AsyncWorker, Graph, ProtocolConfig
from hopnet.errors import HopnetError, PeerFailure
from hopnet.bootstrap.env import WorkerEnv
from hopnet.launch import forkserver
from hopnet.launch.forkserver import TEMPLATE_VAR, ForkedWorker, ForkServer
from hopnet.rendezvous.server import RendezvousServer
from hopnet.transports.base import Transport
from hopnet.transports.zmq import ZmqTransport

from support.env import clean_env
from support.faults import FaultyTransport
from support.paths import ROOT, WORKERS
from support.wait import wait_until

PEER_WORKER = str(WORKERS / "peer_worker.py")
START_TIMEOUT_S = 120.0  # a loaded 2-core machine can take long to import torch 6 times
COMPUTE_S = 0.002
"""What an in-process worker's iteration computes (sleeps), so that its peers' messages interleave."""
GIVE_UP_S = 60.0
"""An in-process failure that is never detected ends the test here, not at pytest's timeout."""


class Cluster:
    """Worker processes (tests/workers/peer_worker.py) started without a launcher."""

    def __init__(self, graph: Graph, config: ProtocolConfig, run_dir: Path, worker_args: list[str],
                 *, store: str = "") -> None:
        """``store``: the run's c10d store (``host:port``), for the torch plane (``--bulk torch``)."""
        self.graph = graph
        self.run_dir = run_dir
        run_dir.mkdir(parents=True)
        graph_path = run_dir / "graph.json"
        graph.to_json(graph_path)
        self.server = RendezvousServer(graph.n).start()
        self.procs: list[subprocess.Popen[bytes] | ForkedWorker] = []
        self._drains: list[threading.Thread] = []
        base = clean_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        # Forked from the session's template, as a launch's workers are: 6 workers that each import
        # torch cost about 15 CPU-s, forked about 1.
        self.fork_server = ForkServer(base) if TEMPLATE_VAR in base and forkserver.available() else None
        for rank in range(graph.n):
            env = {**base, **WorkerEnv(rank=rank, world_size=graph.n, local_rank=rank, graph_path=str(graph_path),
                                       rendezvous=self.server.endpoint, run_dir=str(run_dir),
                                       config_json=config.to_json(), store=store).to_environ()}
            if self.fork_server is not None:
                self.procs.append(self._fork(rank, [PEER_WORKER, *worker_args], env))
                continue
            with open(run_dir / f"out{rank}.txt", "wb") as out, open(run_dir / f"err{rank}.txt", "wb") as err:
                self.procs.append(subprocess.Popen([sys.executable, PEER_WORKER, *worker_args], env=env,
                                                   stdout=out, stderr=err, cwd=ROOT, start_new_session=True))

    def _fork(self, rank: int, argv: list[str], env: dict[str, str]) -> ForkedWorker:
        """A worker forked by the fork server (a session of its own), its streams copied to
        ``out{rank}.txt`` and ``err{rank}.txt`` as they come."""
        assert self.fork_server is not None
        worker = self.fork_server.spawn(rank, argv, env, piped=True)
        for stream, name in ((worker.stdout, f"out{rank}.txt"), (worker.stderr, f"err{rank}.txt")):
            (self.run_dir / name).touch()
            drain = threading.Thread(target=_copy_stream, args=(stream, self.run_dir / name), daemon=True)
            drain.start()
            self._drains.append(drain)
        return worker

    def signal(self, rank: int, sig: signal.Signals) -> None:
        os.killpg(self.procs[rank].pid, sig)

    def wait_for_iteration(self, rank: int, iteration: int) -> None:
        """Until ``rank``'s event log shows it reached ``iteration`` (its log is flushed in batches)."""
        log = self.run_dir / f"rank{rank}.jsonl"
        wait_until(lambda: log.exists() and any(json.loads(line).get("iter", -1) >= iteration
                                                for line in log.read_text().splitlines() if line.endswith("}")),
                   START_TIMEOUT_S, interval=0.1, what=lambda: f"rank {rank}'s iteration {iteration}\n{self.report()}",
                   while_running=self.procs)

    def wait(self, ranks: list[int], timeout_s: float) -> dict[int, int]:
        """Exit codes of ``ranks``, which must all exit on their own within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        codes: dict[int, int] = {}
        for rank in ranks:
            try:
                codes[rank] = self.procs[rank].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {rank} did not exit within {timeout_s}s\n{self.report()}") from None
        return codes

    def failure(self, rank: int) -> dict[str, Any]:
        return json.loads((self.run_dir / f"failure_rank{rank}.json").read_text())

    def stderr(self, rank: int) -> str:
        return (self.run_dir / f"err{rank}.txt").read_text(errors="replace")

    def report(self) -> str:
        return "\n".join(f"--- rank {r} (exit {p.poll()}):\n{self.stderr(r)[-2000:]}"
                         for r, p in enumerate(self.procs))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process must be woken to die
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        pass
            proc.wait()
        if self.fork_server is not None:
            self.fork_server.close()
        for drain in self._drains:
            drain.join(timeout=10)
        self.server.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _copy_stream(stream: Any, path: Path) -> None:
    with open(path, "wb", buffering=0) as out:
        for chunk in iter(lambda: stream.read1(65536), b""):
            out.write(chunk)
    stream.close()


def zmq_transport(rank: int, graph: Graph) -> Transport:
    return ZmqTransport(rank, frozenset(graph.peers(rank)))


async def start_workers(graph: Graph, config: ProtocolConfig, *,
                        transport_for: Callable[[int, Graph], Transport] = zmq_transport,
                        params: Callable[[int], torch.Tensor] = lambda rank: torch.zeros(8)) -> list[AsyncWorker]:
    """One :class:`AsyncWorker` per rank of ``graph`` on the running loop, addresses exchanged
    among themselves (no rendezvous server). Close them with :func:`close_workers`."""
    addresses: dict[int, str] = {}
    everyone = asyncio.Barrier(graph.n)

    def exchange_for(rank: int) -> Callable[[str], Awaitable[dict[int, str]]]:
        async def exchange(address: str) -> dict[int, str]:
            addresses[rank] = address
            await everyone.wait()
            return dict(addresses)
        return exchange

    return list(await asyncio.gather(*(
        AsyncWorker.start(rank=r, graph=graph, config=config, params=params(r),
                          transport=transport_for(r, graph), exchange=exchange_for(r))
        for r in range(graph.n))))


async def close_workers(workers: list[AsyncWorker]) -> None:
    await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)


async def train(worker: AsyncWorker, total: int) -> None:
    """Step ``worker`` until it has run ``total`` iterations, the last one marked as such."""
    while True:
        last = worker.iteration >= total - 1
        await worker.step(last=last)
        if last:
            return


@dataclass
class Outcome:
    """How one rank's training ended: the error it raised (None: it finished) and when."""

    error: HopnetError | None
    iteration: int
    at: float


class FaultyCluster:
    """Workers of ``graph`` on the running loop, each over a FaultyTransport around ZeroMQ:
    ``faults[rank]`` stages that rank's failures (see :mod:`support.faults`)."""

    def __init__(self, graph: Graph, config: ProtocolConfig,
                 params: Callable[[int], torch.Tensor] = lambda rank: torch.zeros(8)) -> None:
        self.graph = graph
        self.config = config
        self.params = params
        self.faults: dict[int, FaultyTransport] = {}
        self.workers: list[AsyncWorker] = []
        self.halt = asyncio.Event()

    def _transport(self, rank: int, graph: Graph) -> FaultyTransport:
        self.faults[rank] = FaultyTransport(zmq_transport(rank, graph))
        return self.faults[rank]

    async def __aenter__(self) -> FaultyCluster:
        self.workers = await start_workers(self.graph, self.config, transport_for=self._transport,
                                           params=self.params)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.halt.set()
        await asyncio.gather(*(w.close() for w in self.workers), return_exceptions=True)

    async def train(self, rank: int, total: int) -> Outcome:
        """Train ``rank`` as a user's loop does; on a hopnet error it closes (a ``bye`` to its peers)."""
        worker = self.workers[rank]
        loop = asyncio.get_running_loop()
        try:
            while True:
                await asyncio.sleep(COMPUTE_S)
                last = worker.iteration >= total - 1
                await worker.step(last=last)
                if last:
                    break
        except HopnetError as exc:
            await worker.close()
            return Outcome(exc, worker.iteration, loop.time())
        await worker.close()
        return Outcome(None, worker.iteration, loop.time())

    async def fall_silent(self, rank: int, at_iteration: int) -> float:
        """Train ``rank`` to ``at_iteration``, then cut it off from everyone, as if its process
        had died; it steps no more. Returns when it went silent."""
        worker = self.workers[rank]
        while worker.iteration < at_iteration:
            await asyncio.sleep(COMPUTE_S)
            await worker.step()
        self.faults[rank].silence()
        return asyncio.get_running_loop().time()


async def within(*aws: Awaitable[Any]) -> list[Any]:
    """The results of ``aws``, run together, which must all end within GIVE_UP_S."""
    return await asyncio.wait_for(asyncio.gather(*aws), GIVE_UP_S)


async def failure_after_a_peer_vanishes(workers: list[AsyncWorker], steps: int = 5) -> tuple[PeerFailure, float]:
    """Rank 1 of ``workers`` shuts down without a bye, as a crash would; rank 0 trains on: the
    ``PeerFailure`` it fails with and how long it took (rank 0 closed either way)."""
    await workers[1].node.close(leave=False)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        with pytest.raises(PeerFailure) as info:
            await train(workers[0], steps)
    finally:
        await workers[0].close()
    return info.value, loop.time() - started
