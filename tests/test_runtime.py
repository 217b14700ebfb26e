"""The trainer-facing runtime in one process: Worker, AsyncWorker, timeouts, apply order."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest
import torch

from hopnet import AsyncWorker, DistributedOptimizer, Graph, ProtocolConfig, WaitTimeout, Worker
from hopnet.transports.inproc import InprocNetwork
from hopnet.transports.zmq import ZmqTransport


def run_workers(graph: Graph, config: ProtocolConfig, body: Callable[[Worker], None],
                params: list[torch.Tensor]) -> dict[int, BaseException]:
    """One thread per rank, each with a Worker on the in-process transport."""
    network = InprocNetwork()
    barrier = threading.Barrier(graph.n)
    errors: dict[int, BaseException] = {}

    async def exchange(address: str) -> dict[int, str]:
        await asyncio.to_thread(barrier.wait)  # everyone attached before anyone sends
        return {r: f"inproc://{r}" for r in range(graph.n)}

    def run(rank: int) -> None:
        try:
            worker = Worker(rank=rank, graph=graph, config=config, params=params[rank],
                            transport=network.transport(rank, frozenset(graph.peers(rank))),
                            exchange=exchange)
            try:
                body(worker)
            finally:
                worker.close()
        except BaseException as exc:  # collected for the test to assert on
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(graph.n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return errors


@pytest.mark.parametrize("serial,expected", [(False, [1.0, 2.0]), (True, [1.5, 1.5])])
def test_parallel_mixes_before_apply_and_serial_after(serial: bool, expected: list[float]) -> None:
    """x0 = 0, x1 = 2, apply adds the rank: parallel -> avg then +rank; serial -> +rank then avg."""
    params = [torch.tensor([0.0]), torch.tensor([2.0])]

    def body(worker: Worker) -> None:
        for _ in worker.iterations(1):
            worker.step(lambda: worker.params.add_(float(worker.rank)))

    errors = run_workers(Graph.ring(2), ProtocolConfig(serial=serial, timeout_s=10), body, params)
    assert not errors
    assert [p.item() for p in params] == expected


def test_a_wait_that_expires_names_the_peer_and_the_iteration() -> None:
    params = [torch.zeros(3), torch.zeros(3)]
    stall = threading.Event()

    def body(worker: Worker) -> None:
        if worker.rank == 1:
            next(worker.iterations(5))  # starts its loop (its update of iteration 0 goes out)...
            stall.wait(10)  # ...but never steps: rank 0 will not get its update of iteration 1
            return
        try:
            for _ in worker.iterations(5):
                worker.step()
        finally:
            stall.set()

    errors = run_workers(Graph.ring(2), ProtocolConfig(timeout_s=0.5), body, params)
    assert isinstance(errors.get(0), WaitTimeout), errors
    message = str(errors[0])
    assert "updates" in message and "peer 1" in message and "iteration 1" in message


def test_distributed_optimizer_trains_a_shared_linear_model() -> None:
    """Two workers, each seeing half the data of y = 3x - 1, agree on the right line."""
    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    y = 3 * x - 1
    models = [torch.nn.Linear(1, 1) for _ in range(2)]
    for m in models:
        m.load_state_dict(models[0].state_dict())
    from hopnet import flatten_parameters
    params = [flatten_parameters(m) for m in models]

    def body(worker: Worker) -> None:
        model = models[worker.rank]
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), worker)
        xs, ys = x[worker.rank::2], y[worker.rank::2]
        for _ in worker.iterations(200):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs), ys).backward()
            opt.step()

    errors = run_workers(Graph.ring(2), ProtocolConfig(timeout_s=10), body, params)
    assert not errors
    for model in models:
        assert model.weight.item() == pytest.approx(3.0, abs=1e-2)
        assert model.bias.item() == pytest.approx(-1.0, abs=1e-2)


async def test_async_worker_runs_on_the_callers_loop() -> None:
    graph = Graph.ring(3)
    network = InprocNetwork()
    params = [torch.full((4,), float(r)) for r in range(3)]
    config = ProtocolConfig(timeout_s=10)
    barrier = asyncio.Barrier(3)

    async def exchange(address: str) -> dict[int, str]:
        await barrier.wait()  # every endpoint attached before anyone sends
        return {r: f"inproc://{r}" for r in range(3)}

    workers = await asyncio.gather(*(
        AsyncWorker.start(rank=r, graph=graph, config=config, params=params[r],
                          transport=network.transport(r, frozenset(graph.peers(r))), exchange=exchange)
        for r in range(3)))

    async def train(worker: AsyncWorker) -> None:
        while True:
            last = worker.iteration >= 29
            await worker.step(last=last)
            if last:
                return

    await asyncio.gather(*(train(w) for w in workers))
    await asyncio.gather(*(w.close() for w in workers))
    for p in params:
        assert torch.allclose(p, torch.ones(4), atol=1e-6)


async def test_a_round_started_during_the_rendezvous_waits_for_the_addresses() -> None:
    """Ranks 0 to 2 get the addresses first and start eager-SGD round 0; its activation reaches
    rank 3 while rank 3 still waits for the rendezvous. Rank 3 sends its part once the addresses
    come, instead of into connections it does not have yet (the round would then never end)."""
    n = 4
    graph = Graph.ring(n)
    config = ProtocolConfig(protocol="eager-sgd", eager_mode="solo", timeout_s=10)
    table: dict[int, str] = {}
    everyone = asyncio.Event()
    grads = [torch.full((8,), float(r)) for r in range(n)]

    def exchange_of(rank: int) -> Callable[[str], Awaitable[dict[int, str]]]:
        async def exchange(address: str) -> dict[int, str]:
            table[rank] = address
            if len(table) == n:
                everyone.set()
            await everyone.wait()
            if rank == 3:
                await asyncio.sleep(0.5)  # the others start round 0 meanwhile
            return dict(table)
        return exchange

    async def run(rank: int) -> torch.Tensor:
        worker = await AsyncWorker.start(rank=rank, graph=graph, config=config, params=torch.zeros(8),
                                         grads=grads[rank], transport=ZmqTransport(rank, frozenset(graph.peers(rank))),
                                         exchange=exchange_of(rank))
        try:
            await worker.step(last=True)
        finally:
            await worker.close()
        return grads[rank].clone()

    results = await asyncio.gather(*(run(r) for r in range(n)))
    assert all(torch.equal(r, results[0]) for r in results), results  # one round, taken by every rank
