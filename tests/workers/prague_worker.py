"""A worker that only averages: random float64 parameters (seeded by rank), no optimizer step.

Every P-Reduce then preserves the sum of the models exactly (up to rounding) and pulls
them together, so a run's outcome is known: the sum of the final models equals the sum
of the initial ones and their spread shrinks. Saves its final model as
``final_rank{R}.pt`` in the run directory.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import hopnet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--compute-ms", type=float, default=5.0)
    parser.add_argument("--dim", type=int, default=256)
    args = parser.parse_args()
    rank = int(os.environ["HOPNET_RANK"])
    params = torch.randn(args.dim, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    worker = hopnet.init(params=params)
    for _ in worker.iterations(args.iterations):
        time.sleep(args.compute_ms / 1000.0)
        worker.step()
    worker.close()
    torch.save(params.clone(), Path(os.environ["HOPNET_RUN_DIR"]) / f"final_rank{rank}.pt")


if __name__ == "__main__":
    main()
