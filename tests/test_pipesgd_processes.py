"""Pipe-SGD between real processes over ZeroMQ: `hopnet launch --protocol pipe-sgd` trains the digits example."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import torch

from hopnet import Graph, ProtocolConfig

from support.paths import EXAMPLES
from support.records import records
from support.launch import launch_in_process

DIGITS = str(EXAMPLES / "train_digits.py")
ACCURACY = re.compile(r"^\[rank (\d+)\] final held-out accuracy ([0-9.]+)", re.MULTILINE)


@pytest.mark.slow
@pytest.mark.parametrize("compress", ["int8"])  # the uncompressed K=2 path is the same ring with the identity codec
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
    applied = [r["grad_iter"] for r in records(run_dir, 0, "iteration")]
    assert applied == [None] + list(range(iterations - 1))  # iteration t applied the average of t-1


def test_pipe_sgd_flags_with_another_protocol_are_refused_in_one_line(tmp_path: Path) -> None:
    result = launch_in_process(["--protocol", "allreduce", "--pipeline-k", "3", "--run-dir", str(tmp_path / "r"), DIGITS])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hopnet launch: error: --pipeline-k: option(s) that --protocol allreduce does not take "
        "(taken by pipe-sgd)"]


@pytest.mark.slow
def test_a_killed_worker_fails_the_pending_allreduces_naming_it_dead(tmp_path: Path) -> None:
    from support.cluster import Cluster

    config = ProtocolConfig(protocol="pipe-sgd", timeout_s=60.0, peer_timeout_s=3.0)
    with Cluster(Graph.ring(4), config, tmp_path / "run",
                 ["--iterations", "100000", "--compute-ms", "5", "--model"]) as c:
        c.wait_for_iteration(2, 20)
        c.signal(2, signal.SIGKILL)
        killed = time.monotonic()
        # Nobody hangs: every survivor fails on its own, long before the 60 s wait timeout.
        assert c.wait([0, 1, 3], timeout_s=55.0) == {0: 1, 1: 1, 3: 1}, c.report()
        assert time.monotonic() - killed < config.timeout_s
        failure = c.failure(3)  # in the ring, rank 3 receives from rank 2
        assert (failure["error"], failure["peer"], failure["peer_state"]) == ("PeerFailure", 2, "dead"), failure
        assert "pipe/" in failure["message"], failure
        for rank in (0, 1):
            assert c.failure(rank)["error"] == "PeerFailure", c.failure(rank)
