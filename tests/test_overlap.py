"""``--protocol allreduce`` reduces the gradient in buckets while the backward pass runs
(hopnet/protocols/overlap.py): the buckets, a gradient already averaged when ``backward()`` returns,
DDP's ``no_sync()``, and the results against torch DDP (gloo, small buckets, with and without
gradient accumulation). Ranks are threads of this process (tests/support/threaded.py), DDP a
torchrun launch."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hopnet import AsyncWorker, DistributedOptimizer, Graph, PeerFailure, ProtocolConfig
from hopnet.params import FlatGradients, flatten_parameters
from hopnet.collectives.torchdist import TorchCollective
from hopnet.rendezvous.store import connect_store, host_store
from hopnet.protocols.allreduce.options import AllReduceOptions
from hopnet.protocols.overlap import MB, plan_buckets
from hopnet.protocols.pipesgd.options import PipeSgdOptions
from hopnet.transports.inproc import InprocNetwork

from support.ddp import run_ddp
from support.bn_task import LR, cnn, set_lr, state
from support.once import made_once
from support.overlap_task import MICRO_BATCHES, micro_batch
from support.paths import WORKERS
from support.threaded import Start, run_ranks, seeded

WORLD = 2
STEPS = 8
SMALL_MB = 1000 / MB  # the test model's 5.2 K parameters in 3 buckets
TIMEOUT_S = 30.0


def config(bucket_mb: float, protocol: str = "allreduce") -> ProtocolConfig:
    options = AllReduceOptions(bucket_mb=bucket_mb) if protocol == "allreduce" \
        else PipeSgdOptions(pipeline_k=1, bucket_mb=bucket_mb)
    return ProtocolConfig(protocol, options=options, timeout_s=TIMEOUT_S)


def test_buckets_are_contiguous_slices_in_reverse_parameter_order() -> None:
    buckets = plan_buckets([3, 5, 2, 9, 1], element_size=4, cap_bytes=32)
    assert [b.members for b in buckets] == [(4,), (3,), (2, 1), (0,)]
    assert [(b.start, b.stop) for b in buckets] == [(19, 20), (10, 19), (3, 10), (0, 3)]
    one = plan_buckets([3, 5, 2], element_size=4, cap_bytes=25 * MB)
    assert [(b.start, b.stop, b.members) for b in one] == [(0, 10, (2, 1, 0))]


def train(bucket_mb: float, run: str = "plain", steps: int = STEPS, protocol: str = "allreduce",
          devices: tuple[str, ...] = ("cpu",) * WORLD, *, over_torch: bool = False,
          summaries: dict[int, dict[str, object]] | None = None) -> list[dict[str, torch.Tensor]]:
    """Every rank's state after ``steps`` steps of bn_task's model: one backward pass per step
    (``plain``), two (``accumulate``), or two with the first under ``opt.no_sync()`` (``no_sync``; or
    only its forward pass under it, ``no_sync_forward``, which DDP's rule defers all the same);
    rank ``r``'s model on ``devices[r]``. ``over_torch``: the ranks reduce over torch.distributed
    (gloo), not the node's ring; ``summaries`` gets each rank's protocol summary."""

    def body(rank: int, start: Start) -> dict[str, torch.Tensor]:
        device = devices[rank]
        model = seeded(cnn).to(device)
        worker = start(model)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), worker)
        loss_fn = torch.nn.CrossEntropyLoss()
        micro = 1 if run == "plain" else MICRO_BATCHES
        for step in worker.iterations(steps):
            set_lr(opt, LR, step, steps)
            opt.zero_grad()
            for m in range(micro):
                x, y = (t.to(device) for t in micro_batch(rank, WORLD, step, m))
                if run == "no_sync" and m < micro - 1:
                    with opt.no_sync():
                        (loss_fn(model(x), y) / micro).backward()
                elif run == "no_sync_forward" and m < micro - 1:  # DDP's rule: the forward pass decides
                    with opt.no_sync():
                        loss = loss_fn(model(x), y) / micro
                    loss.backward()
                else:
                    (loss_fn(model(x), y) / micro).backward()
            opt.step()
        if summaries is not None:
            summaries[rank] = worker.node.protocol.summary()
        return state(model)

    if not over_torch:
        return run_ranks(WORLD, config(bucket_mb, protocol), body)
    hosted = host_store("127.0.0.1")
    try:
        return run_ranks(WORLD, config(bucket_mb, protocol), body, collective=lambda rank: TorchCollective(
            rank, WORLD, connect_store(hosted.endpoint, TIMEOUT_S), timeout_s=TIMEOUT_S))
    finally:
        hosted.close()


def grads_after_backward(bucket_mb: float, deferred: bool, protocol: str = "allreduce",
                         devices: tuple[str, ...] = ("cpu",) * WORLD) -> list[torch.Tensor]:
    """Each rank's gradient as ``backward()`` (inside ``no_sync()`` if ``deferred``) leaves it."""

    def body(rank: int, start: Start) -> torch.Tensor:
        device = devices[rank]
        model = seeded(cnn).to(device)
        worker = start(model)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), worker)
        x, y = (t.to(device) for t in micro_batch(rank, WORLD, 0, 0))
        with opt.no_sync() if deferred else _nothing():
            torch.nn.CrossEntropyLoss()(model(x), y).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        opt.step()
        return grads

    return run_ranks(WORLD, config(bucket_mb, protocol), body)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("protocol", ["allreduce", "pipe-sgd"])  # pipe-sgd with K = 1
def test_the_gradient_is_averaged_when_backward_returns(protocol: str) -> None:
    averaged = grads_after_backward(SMALL_MB, deferred=False, protocol=protocol)
    torch.testing.assert_close(averaged[0], averaged[1], rtol=0, atol=0)
    local = grads_after_backward(SMALL_MB, deferred=True, protocol=protocol)  # no_sync(): the step averages it
    assert not torch.equal(local[0], local[1])
    torch.testing.assert_close(averaged[0], (local[0] + local[1]) / 2, rtol=0, atol=1e-6)
    at_step = grads_after_backward(0.0, deferred=False, protocol=protocol)  # --bucket-mb 0: nothing before the step
    assert torch.equal(at_step[0], local[0]) and torch.equal(at_step[1], local[1])


def test_pipe_sgd_with_k_1_in_buckets_is_bitwise_allreduce_in_buckets() -> None:
    pipe, allreduce = train(SMALL_MB, "accumulate", steps=4, protocol="pipe-sgd"), train(SMALL_MB, "accumulate", steps=4)
    for name, tensor in allreduce[0].items():
        assert torch.equal(tensor, pipe[0][name]), name


def test_bucket_mb_0_and_one_bucket_give_bitwise_the_same_model() -> None:
    at_step, one_bucket = train(0.0, steps=4), train(25.0, steps=4)
    for name, tensor in at_step[0].items():
        assert torch.equal(tensor, one_bucket[0][name]), name


@pytest.fixture(scope="module")
def ddp_states(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    def accumulate_under_ddp(out: Path) -> None:
        run_ddp(WORKERS / "ddp_accumulate.py", WORLD, [str(STEPS), str(SMALL_MB), str(out)],
                out.with_name(out.name + ".run"))

    states: dict[str, dict[str, torch.Tensor]] = torch.load(made_once(tmp_path_factory, "overlap_ddp.pt",
                                                                      accumulate_under_ddp))
    return states


@pytest.mark.slow  # the DDP reference run on its processes
@pytest.mark.parametrize("run, bucket_mb", [("plain", SMALL_MB), ("plain", 0.0), ("accumulate", SMALL_MB),
                                            ("no_sync", SMALL_MB), ("no_sync_forward", SMALL_MB),
                                            ("accumulate", 0.0)])
def test_allreduce_in_buckets_equals_ddp(ddp_states: dict[str, dict[str, torch.Tensor]], run: str,
                                         bucket_mb: float) -> None:
    ranks = train(bucket_mb, run)
    # no_sync_forward is no_sync under DDP. With --bucket-mb 0 the micro-batches' gradients are summed
    # locally and reduced once, at the step: DDP's arithmetic under no_sync, not the one all-reduce per
    # backward pass of its accumulate run (the two round apart, and 8 steps of this model turn that
    # into 3e-4).
    reference = ddp_states["no_sync" if run == "no_sync_forward" or (run == "accumulate" and bucket_mb == 0)
                           else run]
    assert ranks[0].keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(ranks[0][name], tensor, rtol=0, atol=1e-5, msg=f"{run}: {name} differs from DDP's")
    for name, tensor in ranks[0].items():
        if "running" not in name and "num_batches" not in name:  # buffers: each rank's own (flatten_parameters)
            assert torch.equal(tensor, ranks[1][name]), name


def test_a_peer_gone_in_the_backward_pass_fails_the_step_naming_it() -> None:
    def body(rank: int, start: Start) -> str:
        model = seeded(cnn)
        worker = start(model)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), worker)
        for step in worker.iterations(STEPS):
            if rank == 1 and step == 2:
                worker.close()  # leaves: it takes part in no round of iteration 2
                return "left"
            opt.zero_grad()
            x, y = micro_batch(rank, WORLD, step, 0)
            torch.nn.CrossEntropyLoss()(model(x), y).backward()  # the round's failure is kept for the step
            try:
                opt.step()
            except PeerFailure as exc:
                return f"{step}: {exc}"
        return "finished"

    left, failed = run_ranks(WORLD, config(SMALL_MB), body)[::-1]
    assert left == "left"
    assert failed.startswith("2: ") and "rank 1" in failed, failed


@pytest.mark.parametrize("run", ["plain", "accumulate", "no_sync", "no_sync_forward"])
def test_over_torch_distributed_the_backward_pass_issues_the_buckets_itself(run: str) -> None:
    """Over gloo, once the first round has formed the group, the hooks issue each bucket's reduce from
    the backward pass's thread and its end waits for them there (no hand-off to the loop): the model
    is bit for bit the one the same buckets give reduced on the loop, by the node's ring (two ranks:
    each element's sum is one addition, whoever adds)."""
    summaries: dict[int, dict[str, object]] = {}
    issued = train(SMALL_MB, run, steps=4, over_torch=True, summaries=summaries)
    on_the_loop = train(SMALL_MB, run, steps=4)
    for name, tensor in on_the_loop[0].items():
        assert torch.equal(tensor, issued[0][name]), name
        assert torch.equal(issued[1][name], issued[0][name]) or "running" in name or "num_batches" in name
    backward_passes = 4 * (1 if run == "plain" else MICRO_BATCHES)
    reducing = 4 if run.startswith("no_sync") else backward_passes  # (one reduce per step under no_sync)
    for summary in summaries.values():
        assert summary["overlapped"] == 4 and summary["buckets"] == 3
        assert summary["issued_in_backward"] == reducing - 1, summary  # all but the group's first round


class _WithUnused(torch.nn.Module):
    """bn_task's model beside a layer no forward pass reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.used = cnn()
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_replaced_grads_are_copied_back_and_unused_parameters_end_their_bucket() -> None:
    """The trainer zeroes with set_to_none on the wrapped optimizer (backward then makes new .grad tensors)
    and one layer gets no gradient: every bucket still completes, each .grad is its view again, averaged."""

    def body(rank: int, start: Start) -> tuple[torch.Tensor, bool, torch.Tensor]:
        model = seeded(_WithUnused)
        worker = start(model)
        inner = torch.optim.SGD(model.parameters(), lr=LR)
        for step in worker.iterations(3):
            inner.zero_grad(set_to_none=True)
            x, y = micro_batch(rank, WORLD, step, 0)
            torch.nn.CrossEntropyLoss()(model(x), y).backward()
            grads = worker.grads.buffer.clone()
            aliased = worker.grads.aliased()
            worker.step(inner.step)
        return grads, aliased, torch.cat([p.detach().flatten() for p in model.parameters()])

    for bucket_mb in (SMALL_MB, 0.0):
        ranks = run_ranks(WORLD, config(bucket_mb), body)
        if bucket_mb:  # (with --bucket-mb 0 the step copies them back)
            assert all(aliased for _, aliased, _ in ranks)
            assert torch.equal(ranks[0][0], ranks[1][0])  # averaged during the backward pass
            in_buckets = ranks[0][2]
        else:
            torch.testing.assert_close(ranks[0][2], in_buckets, rtol=0, atol=1e-6)
    unused = seeded(_WithUnused).unused
    assert torch.equal(in_buckets[-12:], torch.cat([unused.weight.detach().flatten(), unused.bias.detach()]))


# ---------------------------------------------------------------------- on a GPU, and on the loop's thread
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
GPU_AND_CPU = ("cuda", "cpu")
"""Rank 0 on the GPU, rank 1 on the CPU. (Two ranks of one process on one GPU would share autograd's
thread for it, where a rank's end of backward waits for its round, which needs the other rank's
hooks: that thread runs them only after. Ranks in processes of their own, as runs have, do not.)"""


@pytest.fixture
def exact_cuda_float32() -> Iterator[None]:
    """cuDNN convolutions in float32, not TF32 (its default), and deterministic: the GPU runs are
    compared with the CPU's, and with each other bit for bit."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = False, True
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = before


@needs_cuda
def test_on_a_gpu_the_gradient_is_averaged_when_backward_returns(exact_cuda_float32: None) -> None:
    """A CUDA parameter's hook runs on autograd's device thread, not the trainer's: the buckets are
    reduced by the time ``backward()`` returns all the same (rank 0 on the GPU)."""
    averaged = [g.cpu() for g in grads_after_backward(SMALL_MB, deferred=False, devices=GPU_AND_CPU)]
    local = [g.cpu() for g in grads_after_backward(SMALL_MB, deferred=True, devices=GPU_AND_CPU)]
    assert torch.equal(averaged[0], averaged[1]) and not torch.equal(local[0], local[1])
    torch.testing.assert_close(averaged[0], (local[0] + local[1]) / 2, rtol=0, atol=1e-6)


@needs_cuda
def test_a_rank_on_a_gpu_trains_in_buckets_as_on_the_cpu(exact_cuda_float32: None) -> None:
    gpu, cpu = train(SMALL_MB, "accumulate", devices=GPU_AND_CPU), train(SMALL_MB, "accumulate")
    for name, tensor in cpu[0].items():  # (cuDNN's and the CPU's convolutions round differently)
        torch.testing.assert_close(gpu[0][name].cpu(), tensor, rtol=0, atol=1e-4, msg=name)
    for name, tensor in gpu[0].items():
        if "running" not in name and "num_batches" not in name:
            assert torch.equal(tensor.cpu(), gpu[1][name]), name
    at_step, one_bucket = train(0.0, steps=4, devices=GPU_AND_CPU), train(25.0, steps=4, devices=GPU_AND_CPU)
    for name, tensor in at_step[0].items():
        assert torch.equal(tensor, one_bucket[0][name]), name


async def _train_on_the_loop(device: str, steps: int = 4) -> list[dict[str, torch.Tensor]]:
    """bn_task's model under AsyncWorkers whose trainers compute on their event loop's own thread."""
    network = InprocNetwork()
    graph = Graph.ring(WORLD)
    models = [seeded(cnn).to(device) for _ in range(WORLD)]  # (one event loop: one thread runs every backward)

    async def exchange(address: str) -> dict[int, str]:
        return {r: f"inproc://{r}" for r in range(WORLD)}

    workers = await asyncio.gather(*(
        AsyncWorker.start(rank=r, graph=graph, config=config(SMALL_MB), params=flatten_parameters(models[r]),
                          grads=FlatGradients(models[r]), transport=network.transport(r, frozenset(graph.peers(r))),
                          exchange=exchange) for r in range(WORLD)))

    async def run(rank: int) -> dict[str, torch.Tensor]:
        worker, model = workers[rank], models[rank]
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        try:
            for step in range(steps):
                set_lr(opt, LR, step, steps)
                opt.zero_grad(set_to_none=False)
                x, y = (t.to(device) for t in micro_batch(rank, WORLD, step, 0))
                torch.nn.CrossEntropyLoss()(model(x), y).backward()  # on the loop's thread
                await worker.step(opt.step, last=step == steps - 1)
            return state(model)
        finally:
            await worker.close()

    return list(await asyncio.gather(*(run(r) for r in range(WORLD))))


@pytest.mark.parametrize("device", DEVICES)
def test_a_trainer_computing_on_the_loop_is_reduced_at_its_step(device: str, exact_cuda_float32: None) -> None:
    """An AsyncWorker's trainer that runs ``backward()`` on the event loop's thread: no bucket can be
    reduced before the loop is free again, so the step reduces the gradient, once. With CUDA
    parameters, whose hooks run on autograd's own thread, waiting for the loop there would hang."""
    result: list[list[dict[str, torch.Tensor]]] = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(_train_on_the_loop(device))), daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the trainer on the loop hung in its backward pass"
    ranks = result[0]
    for name, tensor in ranks[0].items():
        if "running" not in name and "num_batches" not in name:
            assert torch.equal(tensor, ranks[1][name]), name
    reference = train(0.0, steps=4)  # threads, reduced at the step
    for name, tensor in reference[0].items():
        if "running" not in name and "num_batches" not in name:
            torch.testing.assert_close(ranks[0][name].cpu(), tensor, rtol=0, atol=1e-4, msg=name)
