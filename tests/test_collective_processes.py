"""The ring all-reduce and the allreduce protocol between real processes over ZeroMQ."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from support.ddp import run_ddp
from support.paths import EXAMPLES, WORKERS
from support.launch import launch_in_process
from support.once import made_once
from support.records import records

COLLECTIVE_WORKER = str(WORKERS / "collective_worker.py")
DIGITS = str(EXAMPLES / "train_digits.py")
ACCURACY = re.compile(r"^\[rank (\d+)\] final held-out accuracy ([0-9.]+)", re.MULTILINE)


def _start(rank: int, name: str, numel: int) -> torch.Tensor:
    seed = 1000 * rank + sum(map(ord, name))
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
@pytest.mark.parametrize("bulk", ["zmq", "torch"])
def test_groups_reduce_exactly_and_leave_non_members_alone(launch, tmp_path: Path, bulk: str) -> None:
    # zmq: the ring over ZeroMQ. torch: TorchCollective, whose repeated pair ("again0..2")
    # takes Worker.allreduce's path in the calling thread once the pair is cached.
    n, numel = 5, 300_007
    run_dir = tmp_path / "run"
    result = launch(["--protocol", "allreduce", "--nproc", str(n), "--run-dir", str(run_dir), "--bulk", bulk,
                     COLLECTIVE_WORKER, "--numel", str(numel)])
    assert result.returncode == 0, result.stderr
    held = [torch.load(run_dir / f"collective_rank{r}.pt") for r in range(n)]
    cases = {"all": (tuple(range(n)), "mean", numel), "pair": ((0, 2), "sum", numel),
             "trio": ((4, 1, 3), "sum", numel)}
    cases.update({f"again{k}": ((0, 2), "mean", numel // 3) for k in range(3)})
    for name, (group, op, size) in cases.items():
        before = [_start(r, name, size) for r in range(n)]
        stacked = torch.stack([before[r].double() for r in group])
        expected = stacked.mean(0) if op == "mean" else stacked.sum(0)
        for r in range(n):
            if r in group:
                assert torch.equal(held[r][name], held[group[0]][name]), (name, r)
                torch.testing.assert_close(held[r][name].double(), expected, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(held[r][name], before[r]), (name, r)


@pytest.mark.slow
def test_allreduce_protocol_trains_digits_with_identical_models(launch, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = launch(["--protocol", "allreduce", "--nproc", "4", "--run-dir", str(run_dir), DIGITS])
    assert result.returncode == 0, result.stderr
    accuracies = {int(r): float(a) for r, a in ACCURACY.findall(result.stdout)}
    assert sorted(accuracies) == [0, 1, 2, 3], result.stdout
    assert min(accuracies.values()) >= 0.95, accuracies
    params = [torch.load(run_dir / f"final_rank{r}.pt") for r in range(4)]
    for r in range(1, 4):
        assert torch.equal(params[r], params[0]), f"rank {r}'s model differs from rank 0's"


def test_hop_options_with_allreduce_are_refused_in_one_line(tmp_path: Path) -> None:
    result = launch_in_process(["--protocol", "allreduce", "--backup-workers", "1", "--run-dir", str(tmp_path / "r"), DIGITS])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hopnet launch: error: --backup-workers: option(s) that --protocol allreduce does not take "
        "(taken by hop)"]


@pytest.mark.slow
@pytest.mark.parametrize("bulk", ["auto", "torch"])
def test_allreduce_protocol_matches_torch_ddp_after_50_steps(launch, tmp_path: Path, bulk: str,
                                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    """Same model, seeds, data and schedule: hopnet's allreduce against DDP (gloo) on 4 processes. auto: the
    ZeroMQ ring (a model this small); torch: gloo, the backward pass issuing its bucket from the second step on."""
    run_dir = tmp_path / "run"
    result = launch(["--protocol", "allreduce", "--nproc", "4", "--run-dir", str(run_dir), "--bulk", bulk, DIGITS,
                     "--iterations", "50"])
    assert result.returncode == 0, result.stderr
    ours = torch.load(run_dir / "final_rank0.pt")
    theirs = torch.load(made_once(tmp_path_factory, "ddp_digits_50.pt", _ddp_digits_50_steps))
    assert ours.shape == theirs.shape
    assert not torch.equal(ours, _initial_digits_params())  # both really trained
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    if bulk == "torch":
        stop = next(r for r in records(run_dir, 0) if r["event"] == "stop")
        assert stop["issued_in_backward"] == 49, stop


def _ddp_digits_50_steps(out: Path) -> None:
    """DDP's parameters after the same 50 steps (made once per session: both planes compare with it)."""
    run_ddp(WORKERS / "ddp_digits.py", 4, [str(out), "--iterations", "50"], out.with_name(out.name + ".run"))


def _initial_digits_params() -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


