"""DistributedOptimizer is a torch optimizer: LR schedulers, clipping of the averaged gradient
(against DDP), state_dict, Horovod's synchronize()/skip_synchronize(); ranks are threads of
this process (tests/support/threaded.py), DDP a torchrun launch."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from hopnet import DistributedOptimizer, Graph, HopnetError, ProtocolConfig, Worker
from hopnet.params import FlatGradients, flatten_parameters
from hopnet.protocols.allreduce.options import AllReduceOptions
from hopnet.protocols.gradient_options import DEFAULT_BUCKET_MB
from hopnet.transports.inproc import InprocNetwork

from support.ddp import run_ddp
from support.clip_task import MAX_NORM, STEPS, batch, flat, make_model, make_optimizer
from support.paths import WORKERS
from support.threaded import Start, run_ranks

TIMEOUT_S = 30.0


class RecordingSGD(torch.optim.SGD):
    """SGD that notes the learning rate of every step it takes."""

    def __init__(self, params: object, lr: float) -> None:
        super().__init__(params, lr=lr)  # type: ignore[arg-type]
        self.lrs: list[float] = []

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.lrs.append(float(self.param_groups[0]["lr"]))
        super().step()


def scheduled_training(config: ProtocolConfig, n: int = 2, steps: int = 8) -> list[tuple[list[float], float]]:
    """Each rank trains under CosineAnnealingLR stepped every iteration; per rank: the
    learning rates its steps used, and the learning rate its groups hold at the end."""

    def body(rank: int, start: Start) -> tuple[list[float], float]:
        model = make_model()
        worker = start(model)
        inner = RecordingSGD(model.parameters(), lr=0.1)
        opt = DistributedOptimizer(inner, worker)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        loss_fn = torch.nn.CrossEntropyLoss()
        for step in worker.iterations(steps):
            opt.zero_grad()
            x, y = batch(rank, step)
            loss_fn(model(x), y).backward()
            opt.step()
            scheduler.step()
        return inner.lrs, float(opt.param_groups[0]["lr"])

    return run_ranks(n, config, body)


def cosine_lrs(steps: int) -> list[float]:
    """The learning rate of each iteration under the same schedule on a plain torch optimizer."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    lrs = []
    for _ in range(steps + 1):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("config", [
    ProtocolConfig(protocol="allreduce", timeout_s=TIMEOUT_S),
    ProtocolConfig(protocol="pipe-sgd", pipeline_k=2, timeout_s=TIMEOUT_S),
    ProtocolConfig(protocol="pipe-sgd", pipeline_k=3, timeout_s=TIMEOUT_S),
    ProtocolConfig(protocol="hop", timeout_s=TIMEOUT_S),
], ids=["allreduce", "pipe-sgd-k2", "pipe-sgd-k3", "hop"])
def test_an_lr_scheduler_takes_it_without_a_warning_and_its_schedule_is_not_shifted(config: ProtocolConfig) -> None:
    steps = 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ranks = scheduled_training(config, steps=steps)
    assert not [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    delay = config.options.pipeline_k - 1 if config.protocol == "pipe-sgd" else 0
    schedule = cosine_lrs(steps)
    for used, final in ranks:
        # Each gradient is applied with the learning rate of the iteration that computed it:
        # under pipe-sgd the first step (after K-1 warm-up iterations) uses iteration 0's.
        assert used == pytest.approx(schedule[:steps - delay], rel=1e-12)
        assert final == pytest.approx(schedule[steps], abs=1e-12)  # the groups keep the live schedule


def clipped_training(n: int, *, synchronize: bool, bucket_mb: float = DEFAULT_BUCKET_MB) -> list[torch.Tensor]:
    """tests/support/clip_task.py under allreduce, clipping after synchronize() (or not)."""

    def body(rank: int, start: Start) -> torch.Tensor:
        model = make_model()
        worker = start(model)
        opt = DistributedOptimizer(make_optimizer(model), worker)
        loss_fn = torch.nn.CrossEntropyLoss()
        for step in worker.iterations(STEPS):
            opt.zero_grad()
            x, y = batch(rank, step)
            loss_fn(model(x), y).backward()
            if synchronize:
                opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            with opt.skip_synchronize() if synchronize else _nothing():
                opt.step()
        return flat(model)

    return run_ranks(n, ProtocolConfig(protocol="allreduce", timeout_s=TIMEOUT_S,
                                       options=AllReduceOptions(bucket_mb=bucket_mb)), body)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def mean_gradient_clipped(n: int) -> torch.Tensor:
    """What DDP computes, in one process: the mean of the ranks' gradients, clipped, applied."""
    model = make_model()
    opt = make_optimizer(model)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(n):
            x, y = batch(rank, step)
            (loss_fn(model(x), y) / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    return flat(model)


def test_clipping_after_synchronize_clips_the_averaged_gradient() -> None:
    n = 2
    reference = mean_gradient_clipped(n)
    assert not torch.allclose(reference, flat(make_model()), atol=1e-3)  # it trained
    synced = clipped_training(n, synchronize=True)
    assert torch.equal(synced[0], synced[1])
    torch.testing.assert_close(synced[0], reference, rtol=0, atol=1e-5)
    # With --bucket-mb 0 the gradient is averaged at the step only: clipping each rank's own
    # gradient (no synchronize) is another computation, which the tolerance above tells apart.
    local = clipped_training(n, synchronize=False, bucket_mb=0)
    assert (local[0] - reference).abs().max() > 1e-3
    # In buckets (the default) it is averaged when backward() returns, as under DDP: no synchronize needed.
    overlapped = clipped_training(n, synchronize=False)
    torch.testing.assert_close(overlapped[0], reference, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_clipping_after_synchronize_equals_torch_ddp_with_clipping(tmp_path: Path) -> None:
    ddp_out = tmp_path / "ddp.pt"
    run_ddp(WORKERS / "ddp_clip.py", 2, [str(ddp_out)], tmp_path / "ddp-run")
    ours = clipped_training(2, synchronize=True)[0]
    torch.testing.assert_close(ours, torch.load(ddp_out), rtol=0, atol=1e-5)



def one_worker(model: torch.nn.Module, protocol: str = "allreduce") -> Worker:
    network = InprocNetwork()
    return Worker(rank=0, graph=Graph.ring(1), config=ProtocolConfig(protocol=protocol, timeout_s=TIMEOUT_S),
                  params=flatten_parameters(model), grads=FlatGradients(model),
                  transport=network.transport(0, frozenset()))


def adamw_two_groups(model: torch.nn.Module) -> torch.optim.AdamW:
    first, *rest = model.parameters()
    return torch.optim.AdamW([{"params": [first], "weight_decay": 0.0},
                              {"params": rest, "weight_decay": 0.01}], lr=1e-2)


def test_it_is_a_torch_optimizer_sharing_the_wrapped_ones_groups_and_state_and_its_state_dict_round_trips() -> None:
    model = make_model()
    with one_worker(model) as worker:
        inner = adamw_two_groups(model)
        opt = DistributedOptimizer(inner, worker)
        assert isinstance(opt, torch.optim.Optimizer)
        assert opt.param_groups is inner.param_groups and opt.state is inner.state
        assert opt.defaults is inner.defaults
        loss_fn = torch.nn.CrossEntropyLoss()
        for step in worker.iterations(3):
            opt.zero_grad()
            x, y = batch(0, step)
            loss_fn(model(x), y).backward()
            opt.step()
        saved = opt.state_dict()
        assert saved["param_groups"] == inner.state_dict()["param_groups"]
        assert [g["weight_decay"] for g in saved["param_groups"]] == [0.0, 0.01]
        assert all(int(s["step"]) == 3 for s in saved["state"].values())

    other = make_model()
    with one_worker(other) as worker:
        opt = DistributedOptimizer(adamw_two_groups(other), worker)
        opt.load_state_dict(saved)
        assert opt.param_groups is opt.optimizer.param_groups and opt.state is opt.optimizer.state
        restored = opt.state_dict()
        assert restored["param_groups"] == saved["param_groups"]
        for key, state in saved["state"].items():
            for name, value in state.items():
                assert torch.equal(torch.as_tensor(restored["state"][key][name]), torch.as_tensor(value))
        # A scheduler made after the load drives the restored groups.
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in worker.iterations(1):
            opt.zero_grad()
            x, y = batch(0, step)
            torch.nn.CrossEntropyLoss()(other(x), y).backward()
            opt.step()
            scheduler.step()
        assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)


def test_a_step_under_skip_synchronize_without_synchronize_is_refused() -> None:
    model = make_model()
    with one_worker(model) as worker:
        opt = DistributedOptimizer(make_optimizer(model), worker)
        with pytest.raises(HopnetError, match=r"skip_synchronize\(\) but iteration 0's gradient was never synchronized"):
            for _ in worker.iterations(1):
                with opt.skip_synchronize():
                    opt.step()
