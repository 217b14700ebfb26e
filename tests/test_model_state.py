"""The model's state beyond its parameters (hopnet/model_state.py, hopnet/protocols/buffer_sync.py).

BatchNorm's running statistics travel with the model: gradient protocols keep them in step as
torch DDP does (compared with DDP itself, run by torchrun), model-averaging
protocols mix them with the parameters. Parameters of two dtypes train. Weights loaded between
``init`` and the first step are what Hop sends first; a load that replaces the model's tensors is
refused. The hopnet workers run as AsyncWorkers on one virtual-time event loop over the in-process
transport (the group protocols' coordinators on the same loop), each step computing a small
conv + BatchNorm model on digits and then sleeping a seeded random compute time: every run is
the same, and the ranks reach the protocols' sync points in varying order.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hopnet import AsyncWorker, ConfigError, Graph, ProtocolConfig
from hopnet.coordinator import make_coordinator
from hopnet.coordinator.sim import SimCoordinator
from hopnet.model_state import ModelState
from hopnet.params import FlatGradients
from hopnet.protocols import make_protocol
from hopnet.registry import names as protocol_names
from hopnet.sim.vloop import VirtualTimeLoop
from hopnet.transports.inproc import InprocNetwork

from support.ddp import run_ddp
from support.bn_task import LR, batch, cnn, digits, set_lr, state
from support.paths import WORKERS

COMPUTE_S = 0.002


def bn_spread(models: list[torch.nn.Sequential]) -> float:
    """The largest difference between ranks of any BatchNorm running statistic."""
    stats = torch.stack([torch.cat([m[1].running_mean, m[1].running_var]) for m in models])
    return float((stats.max(dim=0).values - stats.min(dim=0).values).max())


def train(config: ProtocolConfig, graph: Graph, models: list[torch.nn.Sequential], steps: int, *,
          lr: float = LR, buffers: bool = True,
          before_loop: Callable[[list[torch.nn.Sequential], list[torch.optim.Optimizer]], None] | None = None,
          after_step: Callable[[int, int], None] | None = None) -> None:
    """Train ``models`` (one per rank) for ``steps`` steps of SGD under ``config``; ``buffers=False``
    leaves the buffers out of the model state (local only); ``before_loop`` runs between
    ``AsyncWorker.start`` (hopnet.init) and the first step, ``after_step(rank, step)`` after each step."""
    loop = VirtualTimeLoop()  # the same run every time, whatever the machine's load
    try:
        loop.run_until_complete(_train(config, graph, models, steps, lr, buffers, before_loop, after_step))
    finally:
        loop.close()


async def _train(config: ProtocolConfig, graph: Graph, models: list[torch.nn.Sequential], steps: int, lr: float,
                 buffers: bool, before_loop: Callable[..., None] | None,
                 after_step: Callable[[int, int], None] | None) -> None:
    n = graph.n
    network = InprocNetwork()
    machine = make_coordinator(config, graph)
    coordinator = SimCoordinator(machine) if machine is not None else None
    addresses: dict[int, str] = {}
    everyone = asyncio.Barrier(n)

    def exchange_for(rank: int) -> Callable[[str], asyncio.Future[dict[int, str]]]:
        async def exchange(address: str) -> dict[int, str]:
            addresses[rank] = address
            await everyone.wait()
            return dict(addresses)
        return exchange  # type: ignore[return-value]

    workers = list(await asyncio.gather(*(
        AsyncWorker.start(rank=r, graph=graph, config=config, params=ModelState.of(models[r], buffers=buffers),
                          grads=FlatGradients(models[r]), transport=network.transport(r, frozenset(graph.peers(r))),
                          exchange=exchange_for(r), coordinator=coordinator.client(r) if coordinator else None)
        for r in range(n))))
    optimizers: list[torch.optim.Optimizer] = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in models]
    if before_loop is not None:
        before_loop(models, optimizers)
    loss_fn = torch.nn.CrossEntropyLoss()

    async def run(rank: int) -> None:
        worker, model, optimizer = workers[rank], models[rank], optimizers[rank]
        try:
            worker.plan(steps)
            while True:
                step = worker.iteration
                set_lr(optimizer, lr, step, steps)
                optimizer.zero_grad(set_to_none=False)
                x, y = batch(rank, n, step)
                loss_fn(model(x), y).backward()
                last = step >= steps - 1
                await worker.step(optimizer.step, last=last)
                if after_step is not None:
                    after_step(rank, step)
                if last:
                    return
                # the ranks take turns on this loop: a compute time of their own keeps them at one pace, on
                # average, and in no fixed order (Partial Reduce would otherwise always group the same ones)
                await asyncio.sleep(COMPUTE_S * random.Random(rank * 1000 + step).uniform(0.5, 1.5))
        finally:
            await worker.close()

    await asyncio.gather(*(run(r) for r in range(n)))


# ---------------------------------------------------------------------- gradient protocols
def ddp_rank0(world: int, steps: int, out: Path) -> dict[str, torch.Tensor]:
    """Rank 0's state after ``steps`` steps of torch DDP (gloo, buffers broadcast), in processes of
    its own: tests/workers/ddp_batchnorm.py. (Threads of this process would share a gloo teardown
    that can deadlock on the GIL.)"""
    run_ddp(WORKERS / "ddp_batchnorm.py", world, [str(steps), str(out)], out.with_name(out.name + ".run"))
    return torch.load(out)


@pytest.mark.slow
def test_allreduce_keeps_parameters_and_buffers_equal_to_ddp(tmp_path: Path) -> None:
    world, steps = 2, 50
    models = [cnn() for _ in range(world)]
    train(ProtocolConfig("allreduce", timeout_s=30), Graph.ring(world), models, steps)
    reference = ddp_rank0(world, steps, tmp_path / "ddp.pt")
    ours = state(models[0])
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-5, msg=f"{name} differs from DDP's")
    assert bn_spread(models) <= 1e-6  # every rank holds rank 0's buffers


@pytest.mark.parametrize("protocol", ["allreduce", "pipe-sgd", "eager-sgd"])
def test_the_buffers_option_of_the_gradient_protocols(protocol: str) -> None:
    world, steps = 3, 12
    spread: dict[str, float] = {}
    for mode in ("broadcast", "average", "local"):
        models = [cnn() for _ in range(world)]
        train(ProtocolConfig(protocol, timeout_s=30, buffers=mode), Graph.ring(world), models, steps)
        spread[mode] = bn_spread(models)
        for m in models[1:]:  # the gradients are averaged whatever --buffers says
            assert all(torch.equal(p, q) for p, q in zip(m.parameters(), models[0].parameters()))
    assert spread["broadcast"] == 0.0 and spread["average"] <= 1e-6, spread
    assert spread["local"] > 1e-3, spread


# How much closer mixing brings the ranks' running statistics than keeping them local, at the
# end of training. A rank's own last forward pass stays in its statistics with about its self
# weight times BatchNorm's momentum (0.1), while unmixed statistics differ by their EMA's spread,
# sqrt(0.1 / 1.9) of the batch statistics' deviation: mixing at every mix cannot do better than
# about 1 / (w_self * 4.4) of that, less where some ranks' last passes are never mixed.
# Hop mixes with both ring neighbours after every pass (12x here) and Prague's last groups leave
# the ranks equal. AD-PSGD's passives are averaged only when an active picks them, so one whose
# last passes no active met keeps them (7x). Partial Reduce's ranks finish at different times and
# the others train on after the first has left, so its end says nothing about mixing: it is
# measured while every rank trains (the mean over rank 0's steps 30-49: 5x).
MIXING_GAIN = {"hop": ("end", 10), "prague": ("end", 10), "ad-psgd": ("end", 5), "partial-reduce": ("during", 4)}


@pytest.mark.slow  # 4 ranks x 60 CNN steps, twice, per protocol: about a minute of the inner loop
@pytest.mark.parametrize("protocol", sorted(MIXING_GAIN))
def test_model_averaging_mixes_the_buffers_with_the_parameters(protocol: str) -> None:
    world, steps = 4, 60
    when, gain = MIXING_GAIN[protocol]
    spread: dict[bool, float] = {}
    for mixed in (True, False):
        models = [cnn() for _ in range(world)]
        during: list[float] = []

        def sample(rank: int, step: int) -> None:
            if rank == 0 and 30 <= step < 50:
                during.append(bn_spread(models))

        train(ProtocolConfig(protocol, timeout_s=30), Graph.ring(world), models, steps, buffers=mixed,
              after_step=sample)
        spread[mixed] = bn_spread(models) if when == "end" else sum(during) / len(during)
    assert spread[True] * gain <= spread[False], \
        f"{protocol} ({when}): with mixing {spread[True]:.2e}, local {spread[False]:.2e}"


def test_the_model_state_lays_out_parameters_then_floating_buffers_per_dtype() -> None:
    model = cnn(bf16_head=True)
    before = state(model)
    model_state = ModelState.of(model)
    assert [f.dtype for f in model_state.flats] == [torch.float32, torch.bfloat16]
    conv, bn, head = model[0], model[1], model[5]
    assert model_state.params[0].numel() == conv.weight.numel() + conv.bias.numel() + 2 * 8
    assert model_state.buffers[0].numel() == 2 * 8  # running mean and variance; num_batches_tracked stays local
    assert model_state.local_buffers == ["1.num_batches_tracked"]
    assert model_state.params[1].numel() == head.weight.numel() + head.bias.numel()
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
    model_state.flats[0].zero_()
    assert bn.running_var.abs().sum() == 0 and conv.weight.abs().sum() == 0  # views, not copies


# ---------------------------------------------------------------------- mixed dtypes
def linear(model: torch.nn.Sequential) -> torch.nn.Linear:
    return next(m for m in model if isinstance(m, torch.nn.Linear))


def accuracy(model: torch.nn.Module) -> float:
    x, y = digits()
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


@pytest.mark.parametrize("protocol", ["allreduce", "pipe-sgd", "eager-sgd", "hop", "prague"])
def test_a_model_with_fp32_and_bf16_parameters_trains_as_an_fp32_one_does(protocol: str) -> None:
    world, steps = 3, 40
    accuracies: dict[bool, list[float]] = {}
    for bf16 in (False, True):
        models = [cnn(bf16_head=bf16) for _ in range(world)]
        conv, head = models[0][0].weight.detach().clone(), linear(models[0]).weight.detach().clone()
        train(ProtocolConfig(protocol, timeout_s=30), Graph.ring(world), models, steps)
        for m in models:
            assert linear(m).weight.dtype == (torch.bfloat16 if bf16 else torch.float32)
            assert not torch.equal(m[0].weight, conv) and not torch.equal(linear(m).weight, head)
        if protocol in ("allreduce", "pipe-sgd"):  # the gradients of both dtypes are averaged alike everywhere
            for m in models[1:]:
                assert all(torch.equal(p, q) for p, q in zip(m.parameters(), models[0].parameters()))
        accuracies[bf16] = [accuracy(m) for m in models]
    assert all(abs(a - b) <= 0.03 for a, b in zip(accuracies[True], accuracies[False])), accuracies


# ---------------------------------------------------------------------- loading weights
def test_weights_loaded_after_init_are_what_hop_sends_first() -> None:
    world = 4
    models = [cnn(seed=rank) for rank in range(world)]  # every rank starts from other weights...
    checkpoint = state(cnn(seed=99))
    optimizer_state = torch.optim.SGD(cnn(seed=99).parameters(), lr=LR, momentum=0.9).state_dict()

    def load(models: list[torch.nn.Sequential], optimizers: list[torch.optim.Optimizer]) -> None:
        for model, optimizer in zip(models, optimizers):  # ...and loads the same checkpoint after init
            model.load_state_dict(checkpoint)
            optimizer.load_state_dict(optimizer_state)
            model.eval()  # the step moves nothing of its own: no running statistics either

    train(ProtocolConfig("hop", timeout_s=30), Graph.ring(world), models, 1, lr=0.0, before_loop=load)
    for model in models:
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(tensor, checkpoint[name], rtol=1e-6, atol=1e-7, msg=name)


def test_a_load_that_replaces_the_models_tensors_is_refused() -> None:
    model = cnn()
    model_state = ModelState.of(model)
    model.load_state_dict(state(cnn(seed=1)))  # copies into the views: fine
    model_state.check_bound()
    model.load_state_dict(state(cnn(seed=2)), assign=True)
    with pytest.raises(ConfigError, match=r"'0.weight'.*assign=True"):
        model_state.check_bound()


def test_a_step_after_such_a_load_fails_naming_the_tensor() -> None:
    def load_by_assignment(models: list[torch.nn.Sequential], optimizers: list[torch.optim.Optimizer]) -> None:
        for model in models:
            model.load_state_dict(state(cnn(seed=3)), assign=True)

    with pytest.raises(ConfigError, match=r"tensor '0.weight' is no longer the one hopnet.init\(\) placed"):
        train(ProtocolConfig("hop", timeout_s=30), Graph.ring(2), [cnn(), cnn()], 3, before_loop=load_by_assignment)


def test_every_protocol_names_the_tensors_that_hold_the_model() -> None:
    model = cnn(bf16_head=True)
    model_state = ModelState.of(model)
    for name in protocol_names():
        protocol = make_protocol(ProtocolConfig(name), model_state, FlatGradients(model))
        tensors = protocol.model_tensors()
        assert [t.data_ptr() for t in tensors] == [f.data_ptr() for f in model_state.flats], name
        assert sum(t.numel() for t in tensors) == sum(p.numel() for p in model.parameters()) + 2 * 8, name
