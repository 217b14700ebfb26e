"""A worker for the multi-process collective tests: run under `hopnet launch --protocol allreduce`.

Every rank starts from a seeded random vector per round and saves what it holds after
each all-reduce it takes part in (or does not), for the test to check against the seeds:

* ``all``: every rank, mean;
* ``pair`` / ``trio``: two disjoint groups at the same time (members that are not graph
  neighbours, listed out of rank order), sum;
* ``again0..2``: three back-to-back rounds of the pair alone; the other ranks hold still.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import hopnet

PAIR = (0, 2)
TRIO = (4, 1, 3)


def start(rank: int, name: str, numel: int) -> torch.Tensor:
    seed = 1000 * rank + sum(map(ord, name))
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=300_007)
    args = parser.parse_args()
    rank = int(os.environ["HOPNET_RANK"])
    run_dir = Path(os.environ["HOPNET_RUN_DIR"])
    worker = hopnet.init(params=torch.zeros(1))
    n = worker.graph.n
    results: dict[str, torch.Tensor] = {}

    tensor = start(rank, "all", args.numel)
    results["all"] = worker.allreduce(range(n), tensor, "mean", tag="all")

    for name, group in (("pair", PAIR), ("trio", TRIO)):
        tensor = start(rank, name, args.numel)
        if rank in group:
            worker.allreduce(group, tensor, "sum", tag=name)
        results[name] = tensor

    for k in range(3):
        name = f"again{k}"
        tensor = start(rank, name, args.numel // 3)
        if rank in PAIR:
            worker.allreduce(PAIR, tensor, "mean", tag=name)
        results[name] = tensor

    # A rank that closes says goodbye to its ring neighbours; a last round among all keeps
    # everyone here until the pair's rounds are done.
    barrier = start(rank, "barrier", 4)
    worker.allreduce(range(n), barrier, "sum", tag="barrier")
    torch.save(results, run_dir / f"collective_rank{rank}.pt")
    worker.close()


if __name__ == "__main__":
    main()
