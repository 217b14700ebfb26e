"""AD-PSGD between real processes over ZeroMQ, started by `hopnet launch`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from support.paths import EXAMPLES
from support.records import records
from support.launch import launch_in_process

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


def test_a_graph_that_is_not_bipartite_is_refused_before_spawning(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    result = launch_in_process(["--protocol", "ad-psgd", "--graph", "ring:5", "--run-dir", str(run_dir), DIGITS])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hopnet launch: error: ring:5 is not bipartite: odd cycle 0-1-2-3-4-0 "
        "(--protocol ad-psgd needs active and passive sides with every edge between them)"]
    assert not list(run_dir.glob("rank*.jsonl"))

