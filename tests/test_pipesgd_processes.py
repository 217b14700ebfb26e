"""Pipe-SGD between real processes over ZeroMQ: `hopnet launch --protocol pipe-sgd` trains the digits example."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import EXAMPLES

DIGITS = str(EXAMPLES / "train_digits.py")
ACCURACY = re.compile(r"^\[rank (\d+)\] final held-out accuracy ([0-9.]+)", re.MULTILINE)


@pytest.mark.slow
@pytest.mark.parametrize("compress", ["none", "int8"])
def test_pipe_sgd_k2_trains_digits_with_identical_models(launch, tmp_path: Path, compress: str) -> None:
    n, iterations = 4, 300
    run_dir = tmp_path / "run"
    result = launch(["--protocol", "pipe-sgd", "--pipeline-k", "2", "--compress", compress, "--nproc", str(n),
                     "--run-dir", str(run_dir), DIGITS, "--iterations", str(iterations)])
    assert result.returncode == 0, result.stderr
    accuracies = {int(r): float(a) for r, a in ACCURACY.findall(result.stdout)}
    assert sorted(accuracies) == list(range(n)), result.stdout
    assert min(accuracies.values()) >= 0.95, accuracies
    params = [torch.load(run_dir / f"final_rank{r}.pt") for r in range(n)]
    for r in range(1, n):
        assert torch.equal(params[r], params[0]), f"rank {r}'s model differs from rank 0's"
    records = [json.loads(line) for line in (run_dir / "rank0.jsonl").read_text().splitlines()]
    applied = [r["grad_iter"] for r in records if r["event"] == "iteration"]
    assert applied == [None] + list(range(iterations - 1))  # iteration t applied the average of t-1


def test_pipe_sgd_flags_with_another_protocol_are_refused_in_one_line(launch, tmp_path: Path) -> None:
    result = launch(["--protocol", "allreduce", "--pipeline-k", "3", "--run-dir", str(tmp_path / "r"), DIGITS])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hopnet launch: error: --pipeline-k: Pipe-SGD option(s) that --protocol allreduce does not take"]
