"""AD-PSGD between real processes over ZeroMQ, started by `hopnet launch`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from support.paths import EXAMPLES
from support.records import records

DIGITS = str(EXAMPLES / "train_digits.py")
ACCURACY = re.compile(r"^\[rank (\d+)\] final held-out accuracy ([0-9.]+)", re.MULTILINE)


@pytest.mark.slow
def test_adpsgd_trains_digits_on_a_ring_of_four(launch, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = launch(["--protocol", "ad-psgd", "--graph", "ring:4", "--run-dir", str(run_dir), DIGITS])
    assert result.returncode == 0, result.stderr
    accuracies = {int(r): float(a) for r, a in ACCURACY.findall(result.stdout)}
    assert sorted(accuracies) == [0, 1, 2, 3], result.stdout
    assert min(accuracies.values()) >= 0.95, accuracies
    roles = {r: records(run_dir, r, "role")[0]["role"] for r in range(4)}
    assert roles == {0: "active", 1: "passive", 2: "active", 3: "passive"}
    for active in (0, 2):
        partners = [r["partner"] for r in records(run_dir, active, "iteration")]
        assert len(partners) == 300 and set(partners) == {1, 3}, "one random passive neighbour per iteration"
    served = sum(records(run_dir, p, "stop")[0]["averagings_served"] for p in (1, 3))
    assert served == 600
    # Models are averaged, not kept identical; they end close to each other.
    params = [torch.load(run_dir / f"final_rank{r}.pt") for r in range(4)]
    spread = max((p - params[0]).abs().max().item() for p in params)
    assert spread < 0.5, spread


def test_a_graph_that_is_not_bipartite_is_refused_before_spawning(launch, tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    result = launch(["--protocol", "ad-psgd", "--graph", "ring:5", "--run-dir", str(run_dir), DIGITS])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hopnet launch: error: ring:5 is not bipartite: odd cycle 0-1-2-3-4-0 "
        "(--protocol ad-psgd needs active and passive sides with every edge between them)"]
    assert not list(run_dir.glob("rank*.jsonl"))


@pytest.mark.slow
def test_a_killed_passive_fails_the_actives_waiting_on_it_naming_it_dead(tmp_path: Path) -> None:
    """SIGKILL passive 1 of ring:4: actives 0 and 2 soon pick it, wait for its reply, and fail
    once their heartbeats declare it dead, naming it; nobody waits out the 60 s timeout."""
    import signal
    import time

    from support.cluster import Cluster

    from hopnet import Graph, ProtocolConfig

    config = ProtocolConfig(protocol="ad-psgd", timeout_s=60.0, peer_timeout_s=3.0)
    with Cluster(Graph.ring(4), config, tmp_path / "run", ["--iterations", "100000", "--compute-ms", "5"]) as c:
        c.wait_for_iteration(0, 40)
        c.signal(1, signal.SIGKILL)
        killed = time.monotonic()
        assert c.wait([0, 2], timeout_s=55.0) == {0: 1, 2: 1}
        assert time.monotonic() - killed < config.timeout_s
        for rank in (0, 2):
            failure = c.failure(rank)
            assert (failure["error"], failure["peer"], failure["peer_state"]) == ("PeerFailure", 1, "dead"), failure
            assert "passive partner 1 went silent (dead) during the averaging" in failure["message"], failure
        assert c.procs[3].poll() is None  # passive 3 trains on alone (it waits on no one); closed by the test
