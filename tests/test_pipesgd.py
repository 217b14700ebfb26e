"""Pipe-SGD: Algorithm 1's schedule, the K = 1 baseline, per-hop compression, virtual time, failures."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from hopnet import ConfigError, DistributedOptimizer, Graph, HopnetError, PeerFailure, ProtocolConfig, Worker
from hopnet.collectives.codec import IdentityCodec
from hopnet.collectives.compression import (Int8Codec, Trunc16Codec, dequantize8, expand16, make_codec,
                                            quantize8, truncate16)
from hopnet.collectives.ring import RingCollective
from hopnet.params import FlatGradients, flatten_parameters
from hopnet.protocols import make_protocol
from hopnet.protocols.pipesgd.protocol import PipeSgdProtocol
from hopnet.runtime.clock import Clock
from hopnet.runtime.node import Node
from hopnet.sim.engine import SimSpec, simulate
from hopnet.transports.inproc import InprocNetwork, LinkModel


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    return torch.randn(16, 5, generator=gen), torch.randint(3, (16,), generator=gen)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run_workers(n: int, steps: int | list[int], config: ProtocolConfig
                ) -> tuple[list[torch.nn.Module], list[PipeSgdProtocol | None], dict[int, BaseException]]:
    """``n`` trainer threads over the in-process transport; ``steps`` may differ per rank."""
    per_rank = steps if isinstance(steps, list) else [steps] * n
    network = InprocNetwork()
    graph = Graph.ring(n)
    barrier = threading.Barrier(n)
    models = [make_model() for _ in range(n)]
    protocols: list[PipeSgdProtocol | None] = [None] * n
    errors: dict[int, BaseException] = {}

    async def exchange(address: str) -> dict[int, str]:
        await asyncio.to_thread(barrier.wait, 60)
        return {r: f"inproc://{r}" for r in range(n)}

    def run(rank: int) -> None:
        try:
            model = models[rank]
            worker = Worker(rank=rank, graph=graph, config=config, params=flatten_parameters(model),
                            grads=FlatGradients(model), transport=network.transport(rank, frozenset(graph.peers(rank))),
                            exchange=exchange)
            protocols[rank] = worker.node.protocol  # type: ignore[assignment]
            opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), worker)
            loss_fn = torch.nn.CrossEntropyLoss()
            try:
                for step in worker.iterations(per_rank[rank]):
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
    assert not any(t.is_alive() for t in threads), "a worker hung"
    return models, protocols, errors


def algorithm1_reference(n: int, steps: int, k: int) -> torch.Tensor:
    """Algorithm 1 in one process: the step closing iteration t applies the mean gradient of t+1-K."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    computed: dict[int, list[torch.Tensor]] = {}
    for t in range(steps):
        opt.zero_grad()
        for rank in range(n):
            x, y = batch(rank, t)
            (loss_fn(model(x), y) / n).backward()
        computed[t] = [p.grad.clone() for p in model.parameters()]
        due = t + 1 - k
        if due >= 0:
            for p, g in zip(model.parameters(), computed.pop(due)):
                p.grad = g
            opt.step()
    return flat(model)


# ---------------------------------------------------------------------- the schedule


@pytest.mark.parametrize("k", [2, 3])
def test_each_step_applies_exactly_the_gradient_of_k_iterations_back(k: int) -> None:
    n, steps = 3, 9
    models, protocols, errors = run_workers(n, steps, ProtocolConfig(protocol="pipe-sgd", pipeline_k=k,
                                                                     timeout_s=30))
    assert not errors, errors
    for protocol in protocols:
        assert protocol is not None
        # the step closing iteration t used iteration t+1-K's average (Algorithm 1's g[t-K]); warm-up: none
        assert protocol.applied == [None] * (k - 1) + list(range(steps - k + 1))
        assert protocol.discarded == k - 1  # drained at the end, never applied
    finals = [flat(m) for m in models]
    for r in range(1, n):
        assert torch.equal(finals[r], finals[0]), f"rank {r} differs"
    expected = algorithm1_reference(n, steps, k)
    torch.testing.assert_close(finals[0], expected, rtol=1e-5, atol=1e-6)
    # A fresher gradient gives a different model: the schedule is what the comparison checks.
    assert not torch.allclose(algorithm1_reference(n, steps, k - 1), expected, rtol=1e-4, atol=1e-5)


def test_k1_is_the_allreduce_protocol_bit_for_bit() -> None:
    n, steps = 3, 8
    pipe, protocols, errors = run_workers(n, steps, ProtocolConfig(protocol="pipe-sgd", pipeline_k=1, timeout_s=30))
    assert not errors, errors
    sync, _, errors = run_workers(n, steps, ProtocolConfig(protocol="allreduce", timeout_s=30))
    assert not errors, errors
    assert all(p is not None and p.applied == list(range(steps)) for p in protocols)
    for r in range(n):
        assert torch.equal(flat(pipe[r]), flat(sync[r])), f"rank {r}"
    assert not torch.equal(flat(pipe[0]), flat(make_model()))


@pytest.mark.parametrize("compress", ["trunc16", "int8"])
def test_compressed_pipe_sgd_keeps_models_identical_and_near_the_exact_run(compress: str) -> None:
    n, steps = 3, 9
    models, _, errors = run_workers(n, steps, ProtocolConfig(protocol="pipe-sgd", compress=compress, timeout_s=30))
    assert not errors, errors
    finals = [flat(m) for m in models]
    for r in range(1, n):
        assert torch.equal(finals[r], finals[0]), f"rank {r} differs"
    exact = algorithm1_reference(n, steps, 2)
    assert not torch.equal(finals[0], exact)  # the compression was really lossy
    torch.testing.assert_close(finals[0], exact, rtol=0, atol=0.05)


def test_a_member_that_leaves_fails_the_pending_allreduces_naming_it() -> None:
    n = 4
    # rank 2 stops after 3 iterations; the others wanted 8. In the ring rank 3 receives from rank 2.
    _, _, errors = run_workers(n, [8, 8, 3, 8], ProtocolConfig(protocol="pipe-sgd", timeout_s=30))
    assert sorted(errors) == [0, 1, 3], errors
    assert all(isinstance(e, PeerFailure) for e in errors.values()), errors
    failure = errors[3]
    assert isinstance(failure, PeerFailure)
    assert failure.peer == 2 and failure.peer_state == "departed"
    assert "'pipe/" in str(failure)


# ---------------------------------------------------------------------- codecs


def wide_values(numel: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen) * torch.exp2(torch.randint(-60, 60, (numel,), generator=gen).float())


def test_trunc16_keeps_sign_never_grows_and_loses_less_than_2_to_the_minus_7() -> None:
    x = wide_values(100_000)
    bits = truncate16(x)
    assert bits.dtype == torch.int16 and bits.numel() == x.numel()
    y = expand16(bits)
    assert torch.equal(torch.sign(y), torch.sign(x))
    assert bool((y.abs() <= x.abs()).all())
    assert bool(((x - y).abs() < torch.exp2(torch.tensor(-7.0)) * x.abs()).all())
    assert not torch.equal(x, y)
    # exactly bf16 rounded toward zero: the low 16 bits cleared
    assert torch.equal(y.view(torch.int32), x.view(torch.int32) & ~0xFFFF)
    with pytest.raises(ConfigError, match="float32"):
        truncate16(x.double())


def test_int8_is_off_by_at_most_half_a_scale_and_sends_zeros_for_zeros() -> None:
    for seed in range(5):
        x = torch.randn(10_001, generator=torch.Generator().manual_seed(seed)) * (10.0 ** (seed - 2))
        levels, scale = quantize8(x)
        assert levels.dtype == torch.int8 and scale.shape == (1,)
        assert scale.item() == pytest.approx(x.abs().max().item() / 127, rel=1e-6)
        assert int(levels.abs().max()) == 127
        error = (dequantize8(levels, scale, x.dtype) - x).abs().max().item()
        assert error <= scale.item() / 2 * (1 + 1e-5)
        assert error > scale.item() / 4  # it really quantized
    levels, scale = quantize8(torch.zeros(7))
    assert scale.item() == 0 and torch.equal(levels, torch.zeros(7, dtype=torch.int8))


async def _ring_round(n: int, codec_name: str, before: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    network = InprocNetwork()
    graph = Graph.ring(n)
    config = ProtocolConfig(protocol="allreduce", timeout_s=30)
    nodes = [Node(r, graph, network.transport(r, frozenset(graph.peers(r))), make_protocol(config, None),
                  clock=Clock(30.0), collective_factory=lambda node: RingCollective(node, chunk_bytes=4096))
             for r in range(n)]
    for node in nodes:
        await node.open()
    try:
        tensors = [t.clone() for t in before]
        codec = make_codec(codec_name)
        rings = [node.collective.with_codec(codec) for node in nodes]  # type: ignore[attr-defined]
        await asyncio.gather(*(rings[r].allreduce(range(n), tensors[r], "mean", tag="c") for r in range(n)))
        return tensors, sum(node.transport.stats.sent_bytes for node in nodes)
    finally:
        for node in nodes:
            await node.close(leave=False)


def test_compressed_rings_end_bit_identical_within_bounds_at_half_and_a_quarter_of_the_bytes() -> None:
    n, numel = 4, 20_011
    before = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    exact = torch.stack([b.double() for b in before]).mean(0)
    results: dict[str, tuple[list[torch.Tensor], int]] = {}
    for name in ("none", "trunc16", "int8"):
        results[name] = asyncio.run(_ring_round(n, name, before))
    for name, (tensors, _) in results.items():
        for r in range(1, n):
            assert torch.equal(tensors[r], tensors[0]), (name, r)
    plain = results["none"][1]
    assert plain == pytest.approx(n * 2 * (n - 1) / n * numel * 4, rel=1e-3)
    assert plain / results["trunc16"][1] == pytest.approx(2.0, rel=1e-6)
    assert plain / results["int8"][1] == pytest.approx(4.0, rel=0.01)  # plus one 4-byte scale per chunk

    # trunc16: p-1 truncations of partial sums (|partial| <= total), divided by p with the sum, then
    # one of the mean (<= total / p): each loses < 2^-7 of its value, so the error is < 2^-7 * total
    total = torch.stack([b.double().abs() for b in before]).sum(0)
    trunc_err = (results["trunc16"][0][0].double() - exact).abs()
    assert bool((trunc_err <= total * 2 ** -7).all())
    assert bool((trunc_err > 0).any())
    # int8: every quantization is off by at most scale/2, scale <= (sum of the members' max |x|) / 127;
    # the p-1 reduce-scatter hops are divided by p with the sum, the final one is of the mean
    bound_sum = sum(b.abs().max().item() for b in before) / 127 / 2
    int8_err = (results["int8"][0][0].double() - exact).abs().max().item()
    assert int8_err <= ((n - 1) / n + 1 / n) * bound_sum * 1.01
    assert int8_err > 0


def test_codecs_describe_their_payloads() -> None:
    assert [s.dtype for s in Trunc16Codec().payload_specs(10, torch.float32)] == [torch.int16]
    assert [(s.dtype, s.shape) for s in Int8Codec().payload_specs(10, torch.float32)] == [
        (torch.int8, (10,)), (torch.float32, (1,))]
    assert isinstance(make_codec("none"), IdentityCodec)
    with pytest.raises(ConfigError, match="float32"):
        Trunc16Codec().payload_specs(10, torch.float64)


# ---------------------------------------------------------------------- virtual time


def _steady_period(k: int, compute_s: float, compress: str = "none") -> tuple[float, float]:
    n, latency, bandwidth, model_bytes = 4, 1e-3, 1.25e9, 50_000_000
    comm_s = 2 * (n - 1) * latency + 2 * (n - 1) / n * model_bytes / bandwidth
    spec = SimSpec(graph=Graph.ring(n), config=ProtocolConfig(protocol="pipe-sgd", pipeline_k=k, compress=compress),
                   iterations=16, link=LinkModel(latency, bandwidth), model_bytes=model_bytes)
    spec.compute = spec.compute.parse(str(compute_s * 1000))
    result = simulate(spec)
    assert result.iterations == [16] * n
    times = result.finish_times[0]
    steady = [b - a for a, b in zip(times[5:14], times[6:15])]  # after the warm-up, before the drain
    assert max(steady) == pytest.approx(min(steady), rel=1e-6)
    return steady[0], comm_s


@pytest.mark.parametrize("ratio", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_simulated_period_is_c_plus_m_for_k1_and_max_c_m_beyond(k: int, ratio: float) -> None:
    comm_s = _steady_period(1, 0.0)[1]
    compute_s = ratio * comm_s
    period, _ = _steady_period(k, compute_s)
    expected = compute_s + comm_s if k == 1 else max(compute_s, comm_s)
    assert period == pytest.approx(expected, rel=1e-3)


def test_simulated_int8_shrinks_the_allreduce_about_fourfold() -> None:
    plain, comm_s = _steady_period(1, 0.0)
    quantized, _ = _steady_period(1, 0.0, "int8")
    assert plain == pytest.approx(comm_s, rel=1e-3)
    latency_part = 2 * 3 * 1e-3
    assert (quantized - latency_part) == pytest.approx((comm_s - latency_part) / 4, rel=0.01)


# ---------------------------------------------------------------------- options


def test_pipe_sgd_options_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"--pipeline-k, --compress: option\(s\) that --protocol allreduce does not take \(taken by diloco, pipe-sgd\)"):
        ProtocolConfig(protocol="allreduce", pipeline_k=3, compress="int8")
    with pytest.raises(ConfigError, match="--pipeline-k must be an integer >= 1"):
        ProtocolConfig(protocol="pipe-sgd", pipeline_k=0)
    with pytest.raises(ConfigError, match=r"--compress must be one of none, trunc16, int8 \(got 'fp8'\)"):
        ProtocolConfig(protocol="pipe-sgd", compress="fp8")
    with pytest.raises(ConfigError, match=r"--max-ig: option\(s\) that --protocol pipe-sgd does not take"):
        ProtocolConfig(protocol="pipe-sgd", max_ig=4)
    config = ProtocolConfig(protocol="pipe-sgd", pipeline_k=3, compress="trunc16")
    assert ProtocolConfig.from_json(config.to_json()) == config
    assert ProtocolConfig(protocol="pipe-sgd").to_dict()["pipeline_k"] == 2


def test_pipe_sgd_without_gradients_says_what_it_needs() -> None:
    network = InprocNetwork()
    worker = Worker(rank=0, graph=Graph.ring(1), config=ProtocolConfig(protocol="pipe-sgd", timeout_s=5),
                    params=torch.zeros(3), transport=network.transport(0, frozenset()))
    try:
        with pytest.raises(HopnetError, match="pipe-sgd averages gradients"):
            for _ in worker.iterations(1):
                worker.step()
    finally:
        worker.close()


def test_rebinding_flat_gradients_moves_every_grad_view_and_checks_the_buffer() -> None:
    # Pipe-SGD rotates its all-reduce buffers this way instead of copying the gradients.
    model = make_model()
    grads = FlatGradients(model)
    n = grads.buffer.numel()
    other = torch.arange(n, dtype=grads.buffer.dtype)
    grads.rebind(other)
    assert grads.buffer is other and grads.aliased()
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), other)
    grads.zero()
    assert not other.any()
    with pytest.raises(ConfigError, match="rebind needs"):
        grads.rebind(torch.zeros(n + 1))
