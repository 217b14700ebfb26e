"""eager-SGD between real processes over ZeroMQ (`hopnet launch --protocol eager-sgd`)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch

from support.paths import EXAMPLES
from hopnet import Graph, ProtocolConfig
from support.cluster import Cluster
from support.records import records
from support.launch import launch_in_process

DIGITS = str(EXAMPLES / "train_digits.py")
ACCURACY = re.compile(r"^\[rank (\d+)\] final held-out accuracy ([0-9.]+)", re.MULTILINE)


@pytest.mark.slow
def test_solo_trains_digits_and_reports_active_processes_per_round(launch, tmp_path: Path) -> None:
    n = 4
    run_dir = tmp_path / "run"
    # The full sync every 100 iterations includes the last one (300 steps): the final models
    # are the ranks' average, identical everywhere.
    result = launch(["--protocol", "eager-sgd", "--eager-mode", "solo", "--full-sync-every", "100",
                     "--nproc", str(n), "--run-dir", str(run_dir), DIGITS])
    assert result.returncode == 0, result.stderr
    accuracies = {int(r): float(a) for r, a in ACCURACY.findall(result.stdout)}
    assert sorted(accuracies) == list(range(n)), result.stdout
    assert min(accuracies.values()) >= 0.95, accuracies
    params = [torch.load(run_dir / f"final_rank{r}.pt") for r in range(n)]
    for r in range(1, n):
        assert torch.equal(params[r], params[0]), f"rank {r}'s model differs from rank 0's after the full sync"
    stops = [records(run_dir, r, "stop")[-1] for r in range(n)]
    rounds = stops[0]["rounds"]
    assert all(s["rounds"] == rounds and s["active_histogram"] == stops[0]["active_histogram"] for s in stops)
    assert sum(stops[0]["active_histogram"].values()) == rounds
    assert rounds >= 300 and all(s["mode"] == "solo" for s in stops)
    for r in range(n):
        iterations = records(run_dir, r, "iteration")
        assert len(iterations) == 300
        assert all(1 <= it["active"] <= n for it in iterations)


@pytest.mark.slow
def test_majority_over_zeromq_finishes_with_identical_round_counts(launch, tmp_path: Path) -> None:
    n = 3
    run_dir = tmp_path / "run"
    result = launch(["--protocol", "eager-sgd", "--eager-mode", "majority", "--nproc", str(n),
                     "--slowdown", "rank=1:3", "--run-dir", str(run_dir), DIGITS, "--iterations", "60"])
    assert result.returncode == 0, result.stderr
    stops = [records(run_dir, r, "stop")[-1] for r in range(n)]
    assert len({s["rounds"] for s in stops}) == 1
    assert sum(s["initiated"] for s in stops) >= stops[0]["rounds"]  # every round had an initiator
    # the launcher's summary shows eager-SGD's own quantities (its declaration), no tokens or skips
    header = next(line.split() for line in result.stderr.splitlines() if line.split()[:3] == ["rank", "iterations", "it/s"])
    assert header[3:] == ["wait", "round", "rounds", "started", "late", "contributions", "dropped", "status"]


def test_eager_flags_are_refused_with_other_protocols_in_one_line(tmp_path: Path) -> None:
    result = launch_in_process(["--protocol", "allreduce", "--eager-mode", "majority", "--run-dir", str(tmp_path / "r"),
                                DIGITS])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "hopnet launch: error: --eager-mode: option(s) that --protocol allreduce does not take "
        "(taken by eager-sgd)")


@pytest.mark.slow
def test_a_killed_worker_fails_the_round_naming_it_dead(tmp_path: Path) -> None:
    config = ProtocolConfig(protocol="eager-sgd", timeout_s=60.0)  # the default --peer-timeout
    with Cluster(Graph.ring(4), config, tmp_path / "run",
                 ["--gradients", "--iterations", "100000", "--compute-ms", "5"]) as c:
        c.wait_for_iteration(2, 30)
        c.signal(2, signal.SIGKILL)
        # Its ring neighbours watch it and the first to notice names it dead. A failed worker
        # says goodbye, so the others fail at once too, naming whichever peer they lost first.
        assert c.wait([0, 1, 3], timeout_s=55.0) == {0: 1, 1: 1, 3: 1}
        failures = {rank: c.failure(rank) for rank in (0, 1, 3)}
        assert all(f["error"] == "PeerFailure" and f["peer_state"] in ("dead", "departed")
                   for f in failures.values()), failures
        named_dead = [r for r, f in failures.items() if (f["peer"], f["peer_state"]) == (2, "dead")]
        assert named_dead and set(named_dead) <= {1, 3}, failures
        for rank in named_dead:
            assert failures[rank]["message"].startswith(f"rank {rank}: eager-SGD round "), failures
            assert "rank 2 went silent" in failures[rank]["message"], failures
