"""A Hop worker for the CurveZMQ test: publishes its address, waits for the test's go, gossips.

It writes ``address_rank{R}.txt`` (its transport's address) into the run directory so
the test can attack it, waits until the test creates ``go``, then runs ``--iterations``
of gossip averaging (no gradient) and saves its initial and final parameters.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

import hopnet

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support
from support.wait import WaitTimedOut, wait_until  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--go-timeout", type=float, default=60.0)
    args = parser.parse_args()

    rank = int(os.environ["HOPNET_RANK"])
    run_dir = Path(os.environ["HOPNET_RUN_DIR"])
    params = torch.randn(args.dim, generator=torch.Generator().manual_seed(99 + rank), dtype=torch.float64)
    torch.save(params.clone(), run_dir / f"initial_rank{rank}.pt")
    worker = hopnet.init(params=params)
    address = worker.node.transport.address
    (run_dir / f"address_rank{rank}.tmp").write_text(str(address))
    os.replace(run_dir / f"address_rank{rank}.tmp", run_dir / f"address_rank{rank}.txt")
    try:
        wait_until((run_dir / "go").exists, args.go_timeout, what="the test's go file")
    except WaitTimedOut as timed_out:
        print(timed_out, file=sys.stderr)
        sys.exit(4)
    for _ in worker.iterations(args.iterations):
        worker.step()
    worker.close()
    torch.save(params, run_dir / f"final_rank{rank}.pt")


if __name__ == "__main__":
    main()
