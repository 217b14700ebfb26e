"""Flat gradients and the allreduce protocol in one process (in-process transport, one thread per rank)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from hopnet import ConfigError, DistributedOptimizer, Graph, ProtocolConfig, Worker
from hopnet.params import FlatGradients, flatten_parameters
from hopnet.sim.engine import SimSpec, simulate
from hopnet.transports.inproc import InprocNetwork, LinkModel


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    return torch.randn(16, 5, generator=gen), torch.randint(3, (16,), generator=gen)


def test_backward_fills_the_flat_buffer_and_zero_grad_keeps_the_views() -> None:
    model = make_model()
    flat_params = flatten_parameters(model)
    grads = FlatGradients(model)
    assert grads.buffer.numel() == flat_params.numel()
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(3):
        grads.zero()
        x, y = batch(0, step)
        loss_fn(model(x), y).backward()
        assert grads.aliased()
        concatenated = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        assert torch.equal(grads.buffer, concatenated)
        assert grads.buffer.abs().sum() > 0

    # Accumulation across two backwards lands in the buffer too.
    grads.zero()
    x, y = batch(0, 9)
    loss_fn(model(x), y).backward()
    once = grads.buffer.clone()
    loss_fn(model(x), y).backward()
    torch.testing.assert_close(grads.buffer, 2 * once)

    # A bare optimizer that sets grads to None breaks the views; gather() restores them.
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    assert not grads.aliased()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(grads.gather(), expected) and grads.aliased()


def run_allreduce_workers(n: int, steps: int, config: ProtocolConfig) -> list[torch.nn.Module]:
    """``n`` workers training the same model on different data with the README loop."""
    network = InprocNetwork()
    graph = Graph.ring(n)
    barrier = threading.Barrier(n)
    models = [make_model() for _ in range(n)]
    errors: dict[int, BaseException] = {}

    async def exchange(address: str) -> dict[int, str]:
        await asyncio.to_thread(barrier.wait)
        return {r: f"inproc://{r}" for r in range(n)}

    def run(rank: int) -> None:
        try:
            model = models[rank]
            worker = Worker(rank=rank, graph=graph, config=config, params=flatten_parameters(model),
                            grads=FlatGradients(model), transport=network.transport(rank, frozenset(graph.peers(rank))),
                            exchange=exchange)
            opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), worker)
            loss_fn = torch.nn.CrossEntropyLoss()
            try:
                for step in worker.iterations(steps):
                    opt.zero_grad()
                    x, y = batch(rank, step)
                    loss_fn(model(x), y).backward()
                    opt.step()
            finally:
                worker.close()
        except BaseException as exc:  # collected for the test to assert on
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    return models


def test_allreduce_keeps_models_identical_and_equal_to_full_batch_sgd() -> None:
    n, steps = 3, 8
    models = run_allreduce_workers(n, steps, ProtocolConfig(protocol="allreduce", timeout_s=30))
    finals = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
    for r in range(1, n):
        assert torch.equal(finals[r], finals[0]), f"rank {r} differs"

    # The same training in one process: the mean of the ranks' gradients each step.
    reference = make_model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(steps):
        opt.zero_grad()
        for rank in range(n):
            x, y = batch(rank, step)
            (loss_fn(reference(x), y) / n).backward()
        opt.step()
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    assert not torch.equal(expected, torch.cat([p.detach().reshape(-1) for p in make_model().parameters()]))
    torch.testing.assert_close(finals[0], expected, rtol=1e-5, atol=1e-6)


def test_hop_options_are_refused_with_allreduce() -> None:
    with pytest.raises(ConfigError, match=r"--max-ig, --serial: option\(s\) that --protocol allreduce does not take \(taken by hop, notify-ack\)"):
        ProtocolConfig(protocol="allreduce", max_ig=4, serial=True)
    with pytest.raises(ConfigError, match=r"--skip-threshold: option\(s\) that --protocol allreduce does not take"):
        ProtocolConfig(protocol="allreduce", skip_threshold=3)
    ProtocolConfig(protocol="allreduce", slowdown=["rank=1:2"], seed=3, timeout_s=5)  # these apply to every protocol


def test_simulated_allreduce_iteration_is_compute_plus_the_ring_model() -> None:
    n, iterations, compute_s = 4, 10, 0.02
    latency, bandwidth, model_bytes = 1e-3, 1.25e9, 50_000_000
    spec = SimSpec(graph=Graph.ring(n), config=ProtocolConfig(protocol="allreduce"), iterations=iterations,
                   link=LinkModel(latency, bandwidth), model_bytes=model_bytes)
    spec.compute = spec.compute.parse(str(compute_s * 1000))
    result = simulate(spec)
    ring = 2 * (n - 1) * latency + 2 * (n - 1) / n * model_bytes / bandwidth
    assert result.iterations == [iterations] * n
    assert result.virtual_time == pytest.approx(iterations * (compute_s + ring), rel=0.02)


def test_allreduce_without_gradients_says_what_it_needs() -> None:
    network = InprocNetwork()
    worker = Worker(rank=0, graph=Graph.ring(1), config=ProtocolConfig(protocol="allreduce", timeout_s=5),
                    params=torch.zeros(3), transport=network.transport(0, frozenset()))
    try:
        with pytest.raises(ConfigError, match="averages gradients"):
            for _ in worker.iterations(1):
                worker.step()
    finally:
        worker.close()
