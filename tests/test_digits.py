"""The README's example, end to end: `hopnet launch` training on scikit-learn's digits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from support.paths import EXAMPLES

DIGITS = str(EXAMPLES / "train_digits.py")
ACCURACY = re.compile(r"^\[rank (\d+)\] final held-out accuracy ([0-9.]+)", re.MULTILINE)
CONSENSUS = re.compile(r"^\[rank 0\] consensus model held-out accuracy ([0-9.]+) \(mean of ranks 0, 1, 2, 3\)$",
                       re.MULTILINE)


def _accuracies(stdout: str) -> dict[int, float]:
    return {int(rank): float(acc) for rank, acc in ACCURACY.findall(stdout)}


def _consensus_error(run_dir: Path, n: int) -> float:
    params = torch.stack([torch.load(run_dir / f"final_rank{r}.pt") for r in range(n)])
    mean = params.mean(dim=0)
    return ((params - mean).norm(dim=1) / mean.norm()).max().item()


@pytest.mark.parametrize("protocol_flags", [
    [],                                   # the README command: Hop on the default ring
    ["--backup-workers", "1"],
    ["--staleness", "2"],
    ["--stream-mib", "0.01"],             # updates streamed in chunks of 10 KiB, each mixed as it arrives
], ids=["standard", "backup-workers", "staleness", "streamed"])
@pytest.mark.slow
def test_digits_reaches_95_percent_on_every_worker(launch, tmp_path: Path,
                                                   protocol_flags: list[str]) -> None:
    run_dir = tmp_path / "run"
    result = launch(["--nproc", "4", *protocol_flags, "--run-dir", str(run_dir), DIGITS])
    assert result.returncode == 0, result.stderr
    accuracies = _accuracies(result.stdout)
    assert sorted(accuracies) == [0, 1, 2, 3], result.stdout
    assert min(accuracies.values()) >= 0.95, accuracies
    assert _consensus_error(run_dir, 4) < 1e-3
    consensus = CONSENSUS.search(result.stdout)  # worker.consensus() at the end, printed by rank 0
    assert consensus is not None and float(consensus.group(1)) >= 0.95, result.stdout
